"""A watcher that thaws a daemon's sandboxes the moment the daemon dies, however it dies.

Fork freezes a sandbox's commands and commit freezes the whole sandbox, each for a
moment. A daemon killed in that moment (``kill -9``, the OOM killer) leaves the
sandbox frozen, and nothing thaws it until a daemon starts again on the same data
directory: its agent and everything it runs hang. So the daemon starts this small
process at start-up, holding the write end of a pipe whose read end is this
process's stdin (close-on-exec in the daemon, so no sandbox process keeps it open).
When the read returns end-of-file the daemon is gone, and this process thaws every
cgroup of the daemon's group (:func:`branchbox.runtime.cgroups.thaw_leftovers`) and
exits. It kills nothing: a later daemon decides whether to re-attach the sandboxes
or reap them.

    python -m branchbox.runtime.thaw_guard <cgroup group>
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from branchbox.runtime.cgroups import thaw_leftovers


class ThawGuard:
    """The running watcher of one daemon; ``stop()`` on a graceful stop."""

    def __init__(self, group: str) -> None:
        # Its own session: a ^C meant for a daemon in the foreground must not kill the
        # guard first (the daemon stops gracefully then and thaws by itself anyway).
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "branchbox.runtime.thaw_guard", group],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> None:
        """Close the pipe (the guard thaws what is left, then exits) and reap it."""
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
    with contextlib.suppress(OSError):
        while os.read(0, 4096):  # the daemon never writes: this returns at its death
            pass
    thawed = thaw_leftovers(group)
    if thawed:
        print(f"thaw guard: thawed {thawed} sandbox cgroups of {group}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
