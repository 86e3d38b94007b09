"""A process that holds the daemon's end of every control socket, so sandboxes outlive it.

A sandbox's REPL serves the daemon over a socketpair; when the daemon's end closes
the agent sees end-of-file and exits. A daemon that dies (``kill -9``, a crash, an
upgrade's restart) would take every REPL with it. So the daemon hands a duplicate of
its end of each control socket to this small process, keyed by the body that owns
it, and a daemon that starts later on the same data directory takes the duplicates
back and talks to the same REPLs again (``engine.reattach``).

The keeper never reads from a socket it holds (a frame read here would be lost to
the daemon): it polls them for ``POLLRDHUP`` only and drops a socket once the
REPL's end is closed, or when the daemon says the body is gone. It holds the
signal guard's seccomp listeners the same way (keys ``signal:<body>``; a listener
hangs up once no process is under its filter), so deep branches' signal calls
wait for the next daemon instead of failing. No frame passes
through it, so calls cost nothing extra; a body costs one ``sendmsg`` when it is
made. It talks only to the daemon, over a ``SOCK_SEQPACKET`` socket in the daemon's
private run directory (mode 0700): nothing in a sandbox can reach it.

Messages, one JSON object each (fds as ``SCM_RIGHTS``)::

    {"op": "keep", "keys": [k, ...]}  + one fd per key
    {"op": "drop", "keys": [k, ...]}
    {"op": "take"}                    -> {"keys": [k, ...]} + fds, batches; then {"end": true}
    {"op": "quit"}                    closes everything it holds and exits

    python -m branchbox.runtime.fd_keeper <socket path>
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("branchbox.runtime")

BATCH = 200  # fds per message (the kernel takes at most 253 in one SCM_RIGHTS)
SIGNAL_LISTENER = "signal:"
"""Key prefix of a signal guard's listener (runtime.signal_guard), kept like a socket."""
_MSG = 64 * 1024


class KeeperError(RuntimeError):
    """The keeper could not be reached or started."""


def _recv(conn: socket.socket) -> tuple[dict, list[int]]:
    msg, fds, _, _ = socket.recv_fds(conn, _MSG, BATCH)
    if not msg:
        raise EOFError
    return json.loads(msg), fds


class FdKeeper:
    """The daemon's connection to its keeper (started if none runs for the data dir)."""

    def __init__(self, conn: socket.socket, on_lost: Callable[[], None] | None) -> None:
        self._conn = conn
        self._on_lost = on_lost

    @classmethod
    def connect(cls, path: Path, timeout: float = 5.0,
                on_lost: Callable[[], None] | None = None) -> FdKeeper:
        """The keeper of ``path``: the one still running from an earlier daemon, or a new
        one. ``on_lost`` is called (once) if the keeper is found gone: the caller starts
        another and hands it again what this one held."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            conn.connect(str(path))
            return cls(conn, on_lost)
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a dead keeper's
        # It returns once the keeper listens (the keeper itself runs on, detached: not
        # the daemon's child, in a session of its own, so a ^C meant for a daemon in the
        # foreground is not for it).
        try:
            subprocess.run([sys.executable, "-m", "branchbox.runtime.fd_keeper", str(path)],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True,
                           timeout=timeout, start_new_session=True)
            conn.connect(str(path))
        except (OSError, subprocess.SubprocessError) as exc:
            conn.close()
            raise KeeperError(f"the fd keeper did not start at {path}: {exc}") from None
        return cls(conn, on_lost)

    def _send(self, message: dict, fds: list[int] = ()) -> bool:
        """Send without ever blocking the daemon: a keeper that does not keep up only costs
        the bodies in this message their survival of a daemon restart."""
        try:
            socket.send_fds(self._conn, [json.dumps(message).encode()], list(fds),
                            socket.MSG_DONTWAIT)
            return True
        except ConnectionError as exc:  # it is gone (killed, crashed)
            self.lost(str(exc))
        except OSError as exc:  # it does not keep up, or an fd closed meanwhile
            log.warning("fd keeper: %s not sent (%s): those sandboxes will not survive a "
                        "daemon restart", message.get("op"), exc)
        return False

    def fileno(self) -> int:
        """The connection: readable only once the keeper is gone (it never writes unasked,
        and a daemon asks only at its start)."""
        return self._conn.fileno()

    def lost(self, why: str) -> None:
        """The keeper is gone: tell ``on_lost``, once."""
        lost, self._on_lost = self._on_lost, None
        if lost is not None:
            log.warning("fd keeper gone (%s): starting another", why)
            lost()

    def keep(self, pairs: list[tuple[str, int]]) -> None:
        """Hold these control sockets (the caller keeps its own fds)."""
        for i in range(0, len(pairs), BATCH):
            batch = pairs[i:i + BATCH]
            self._send({"op": "keep", "keys": [k for k, _ in batch]}, [fd for _, fd in batch])

    def drop(self, keys: list[str]) -> None:
        if keys:
            self._send({"op": "drop", "keys": keys})

    def take(self) -> dict[str, int]:
        """A copy of every fd the keeper holds (it keeps holding them too), by key."""
        self._conn.sendall(json.dumps({"op": "take"}).encode())
        out: dict[str, int] = {}
        while True:
            message, fds = _recv(self._conn)
            if message.get("end"):
                return out
            out.update(zip(message["keys"], fds, strict=True))

    def quit(self) -> None:
        """The daemon stops for good: the keeper lets go of everything and exits."""
        self._send({"op": "quit"})
        self.close()

    def close(self) -> None:
        self._conn.close()


class _Keeper:
    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.conn: socket.socket | None = None
        self.held: dict[str, int] = {}
        self.by_fd: dict[int, str] = {}
        self.poll = select.poll()
        self.poll.register(listener, select.POLLIN)

    def _forget(self, key: str) -> None:
        fd = self.held.pop(key, None)
        if fd is not None:
            del self.by_fd[fd]
            self.poll.unregister(fd)
            os.close(fd)

    def _handle(self, message: dict, fds: list[int]) -> bool:
        op = message.get("op")
        if op == "keep":
            for key, fd in zip(message["keys"], fds, strict=True):
                self._forget(key)
                self.held[key], self.by_fd[fd] = fd, key
                # Only the peer's hang-up: never POLLIN, which would fire on every frame.
                self.poll.register(fd, select.POLLRDHUP)
            return True
        for fd in fds:
            os.close(fd)
        if op == "drop":
            for key in message["keys"]:
                self._forget(key)
        elif op == "take":
            items = list(self.held.items())
            for i in range(0, len(items), BATCH):
                batch = items[i:i + BATCH]
                socket.send_fds(self.conn, [json.dumps({"keys": [k for k, _ in batch]}
                                                       ).encode()], [fd for _, fd in batch])
            self.conn.sendall(json.dumps({"end": True}).encode())
        elif op == "quit":
            return False
        return True

    def run(self) -> None:
        while True:
            for fd, _ in self.poll.poll():
                if fd == self.listener.fileno():
                    conn, _ = self.listener.accept()
                    if self.conn is not None:  # a new daemon: the old one is gone
                        self.poll.unregister(self.conn)
                        self.conn.close()
                    self.conn = conn
                    self.poll.register(conn, select.POLLIN)
                elif self.conn is not None and fd == self.conn.fileno():
                    try:
                        message, fds = _recv(self.conn)
                    except (EOFError, OSError, ValueError):
                        self.poll.unregister(self.conn)
                        self.conn.close()
                        self.conn = None  # the daemon is gone; a later one connects again
                        continue
                    if not self._handle(message, fds):
                        return
                elif fd in self.by_fd:  # the REPL's end is closed: nobody to talk to
                    self._forget(self.by_fd[fd])


def main(argv: list[str]) -> int:
    (path,) = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    old = os.umask(0o077)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(4)
    if os.fork() > 0:  # the daemon's call returns: the keeper listens, and is not its child
        os._exit(0)
    try:
        _Keeper(listener).run()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
