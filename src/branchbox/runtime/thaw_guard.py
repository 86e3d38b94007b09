"""A watcher that cleans up after a daemon the moment it dies, however it dies.

Fork freezes a sandbox's commands and commit freezes the whole sandbox, each for a
moment. A daemon killed in that moment (``kill -9``, the OOM killer) leaves the
sandbox frozen, and nothing thaws it until a daemon starts again on the same data
directory: its agent and everything it runs hang. A daemon killed while applying a
workspace commit leaves the host directory half old, half new until then, too.

So the daemon starts this small process at start-up, holding the write end of a
pipe whose read end is this process's stdin (close-on-exec in the daemon, so no
sandbox process keeps it open). The daemon writes the host directory of every
commit it begins there, one JSON string a line, and the cgroups that must stay
frozen (paused sandboxes: ``{"hold": key}`` / ``{"release": key}``).
When the read returns end-of-file the daemon is gone, and this process thaws every
other cgroup of the daemon's group (:func:`branchbox.runtime.cgroups.thaw_leftovers`;
a paused sandbox stays paused until a later daemon re-attaches to it or reaps it),
finishes or undoes every commit
the daemon left (:func:`branchbox.storage.journal.recover`: idempotent, and it
leaves alone a commit whose process still holds its lock), and exits. It kills
nothing: a later daemon decides whether to re-attach the sandboxes or reap them.

    python -m branchbox.runtime.thaw_guard <cgroup group>
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from branchbox.runtime.cgroups import thaw_leftovers
from branchbox.storage.journal import FAULT_ENV, recover

log = logging.getLogger("branchbox.runtime")
WRITE_WAIT = 1.0
"""Seconds a message to the guard may wait for room in its pipe before the guard is
taken for hung and replaced."""


class ThawGuard:
    """The running watcher of one daemon; ``stop()`` on a graceful stop.

    The daemon keeps what it told the guard (commits begun, cgroups held frozen), so a
    guard that died (killed, crashed) or stopped reading is replaced and told it all
    again: at once when it exits (:meth:`watch`), or when a message finds it hung."""

    def __init__(self, group: str) -> None:
        self._group = group
        self._hosts: dict[str, None] = {}
        self._held: set[str] = set()
        self._pidfd = -1
        self._proc = self._start()

    def _start(self) -> subprocess.Popen:
        # Its own session: a ^C meant for a daemon in the foreground must not kill the
        # guard first (the daemon stops gracefully then and thaws by itself anyway).
        # Without the commit fault point: a crash test's fault is for the daemon's commit,
        # not for the recovery of it.
        env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
        proc = subprocess.Popen(
            [sys.executable, "-m", "branchbox.runtime.thaw_guard", self._group], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        assert proc.stdin is not None
        os.set_blocking(proc.stdin.fileno(), False)  # a guard that stops reading: _write
        return proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _tell(self, message: object) -> None:
        if self._proc.poll() is not None:
            self._restart()
        try:
            self._write([message])
        except OSError:  # it died since the poll
            self._restart()
            self._write([message])

    def _write(self, messages: list[object]) -> None:
        """Write to the guard's pipe, waiting at most WRITE_WAIT for room: the daemon's
        event loop must not hang on a guard that stopped reading (SIGSTOP, stuck)."""
        assert self._proc.stdin is not None
        fd = self._proc.stdin.fileno()
        data = memoryview(b"".join(json.dumps(m).encode() + b"\n" for m in messages))
        while data:
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:
                if not select.select([], [fd], [], WRITE_WAIT)[1]:
                    raise OSError(errno.ETIMEDOUT, "the thaw guard does not read") from None

    def _restart(self) -> None:
        log.warning("the thaw guard of %s died or stopped reading: starting another",
                    self._group)
        with contextlib.suppress(OSError):
            self._proc.kill()
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        self._proc.wait()
        self._proc = self._start()
        self._write([*self._hosts, *({"hold": key} for key in sorted(self._held))])

    def commit_started(self, host: Path) -> None:
        """A commit into ``host`` begins: if the daemon dies now, the guard recovers it."""
        self._hosts[str(host)] = None
        self._tell(str(host))

    def hold_frozen(self, key: str, frozen: bool = True) -> None:
        """Sandbox cgroup ``key`` is frozen on purpose (paused): the guard
        leaves it frozen (or, with ``frozen=False``, no longer does)."""
        if frozen:
            self._held.add(key)
        else:
            self._held.discard(key)
        self._tell({"hold" if frozen else "release": key})

    def watch(self) -> None:
        """From the caller's event loop on, a guard that dies is started again at once
        (not at the next thing the daemon tells it: a daemon dying meanwhile would
        leave a fork's frozen moment frozen)."""
        loop = asyncio.get_running_loop()
        pidfd = self._pidfd = os.pidfd_open(self._proc.pid)

        def died() -> None:  # never after stop(): it closes the pidfd first
            self._unwatch()
            if self._proc.poll() is not None:  # not already replaced (by _tell)
                self._restart()
            self.watch()  # the guard running now

        loop.add_reader(pidfd, died)

    def _unwatch(self) -> None:
        if self._pidfd >= 0:
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    def stop(self) -> None:
        """Close the pipe (the guard thaws what is left, then exits) and reap it."""
        self._unwatch()
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def main(argv: list[str]) -> int:
    (group,) = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    hosts: dict[str, None] = {}
    held: set[str] = set()
    for line in sys.stdin.buffer:  # ends at the daemon's death (or its graceful stop)
        message = json.loads(line)
        if isinstance(message, str):
            hosts[message] = None
        elif "hold" in message:
            held.add(message["hold"])
        else:
            held.discard(message["release"])
    thawed = thaw_leftovers(group, skip=held)
    if thawed:
        print(f"thaw guard: thawed {thawed} sandbox cgroups of {group}", file=sys.stderr)
    for host in hosts:
        try:
            outcome = recover(Path(host))
        except OSError as exc:
            print(f"thaw guard: recovering the commit into {host}: {exc}", file=sys.stderr)
            continue
        if outcome != "clean":
            print(f"thaw guard: commit into {host} {outcome}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
