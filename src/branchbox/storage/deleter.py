"""Volumes deleted in the background: off the event loop, off every caller's path.

Deleting a volume costs in proportion to what it holds: the copy backend removes it
file by file, and destroying a btrfs subvolume evicts its inodes (0.9 s for 300,000
files, measured). A sandbox's close and a fork's dropped layer deleted on the event
loop, so one sandbox holding many files stalled every other sandbox's calls for as
long (0.6 s at 300,000 files on btrfs, 1.3 s per close at 100,000 on the copy
backend, measured through another sandbox's ``run_code``). Nobody needs a freed
volume gone at once: its name is never used again, nothing mounts it any more. So
one thread deletes them in the order they came, and the daemon waits for it only
when it stops (before its store is unmounted). A volume a crash left queued is
removed by the next start's sweep of the store, like any other leftover.

btrfs refuses to destroy a subvolume while a ``send`` reads it (a diff: see
``storage.send_stream``) with EPERM; such a volume is tried again later, a few
times, rather than left for the next start.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("branchbox.storage")

RETRY_AFTER = (1.0, 2.0, 5.0, 15.0, 60.0)  # seconds before each further try of a refusal
_REFUSED = (errno.EPERM, errno.EBUSY)


class Deleter:
    """Deletes the paths :meth:`put` gives it with ``delete``, one at a time, in a
    thread of its own (started at the first)."""

    def __init__(self, delete: Callable[[Path], None]) -> None:
        self._delete = delete
        self._queue: deque[tuple[Path, int]] = deque()  # (path, tries so far)
        self._later: list[tuple[float, Path, int]] = []  # refused: (when, path, tries)
        self._closed = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def put(self, path: Path) -> None:
        """Have ``path`` deleted soon (a missing one is no error); any thread may call.
        Once closed (the daemon stops), it is deleted here and now."""
        with self._changed:
            if not self._closed:
                self._queue.append((path, 0))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="bb-delete",
                                                    daemon=True)
                    self._thread.start()
                self._changed.notify_all()
                return
        self._try(path, len(RETRY_AFTER))

    def close(self) -> None:
        """Delete what is queued (a refused one tried once more at once), then end the
        thread; later puts delete in their caller."""
        with self._changed:
            self._closed = True
            self._queue.extend((path, len(RETRY_AFTER)) for _, path, _ in self._later)
            self._later.clear()
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queue:
                    if self._closed:
                        return
                    now = time.monotonic()
                    due = [item for item in self._later if item[0] <= now]
                    if due:
                        self._later = [item for item in self._later if item[0] > now]
                        self._queue.extend((path, tries) for _, path, tries in due)
                        break
                    wait = min((when for when, _, _ in self._later), default=now + 3600) - now
                    self._changed.wait(wait)
                path, tries = self._queue.popleft()
            refused = self._try(path, tries)
            if refused:
                with self._changed:
                    if self._closed:  # closing: one last try now
                        self._queue.append((path, len(RETRY_AFTER)))
                    else:
                        self._later.append((time.monotonic() + RETRY_AFTER[tries], path,
                                            tries + 1))

    def _try(self, path: Path, tries: int) -> bool:
        """Delete ``path``; True if refused for now and worth another try."""
        try:
            self._delete(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno in _REFUSED and tries < len(RETRY_AFTER):
                return True
            log.warning("deleting %s: %s (the next start removes it)", path, exc)
        except Exception:  # the next start sweeps it; the queue goes on
            log.exception("deleting %s", path)
        return False
