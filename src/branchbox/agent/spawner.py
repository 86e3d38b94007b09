"""The REPL's side of bb-init's spawner: start a command in the sandbox's command namespace.

A command must be born in Q, the sandbox's command PID namespace, while the
REPL itself stays in the family namespace P with P as its pid_for_children
for good (see ``bb_init.c`` for why). So the REPL does not start commands
itself: it sends bb-init the command's stdin, stdout and stderr and a memfd
holding ``cwd\\0file\\0argc\\0argv...\\0env...\\0``; bb-init clones it with CLONE_PARENT
(it is then the REPL's own child, which the REPL waits for as it would for a
Popen) and answers once it has exec'd or failed, with a pidfd of it: the agent
watches the command's exit through that (pidfd_open is refused in sandboxes).
"""

from __future__ import annotations

import errno
import os
import socket
from typing import IO

_REPLY_TIMEOUT = 30.0  # bb-init answers as soon as the exec happened; this only guards a wedge


class Spawned:
    """A command started through the spawner: what ``Command`` uses of a ``Popen``."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None,
                 pidfd: int | None = None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.pidfd = pidfd  # the caller's to close: readable once the command has exited
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (user code's os.wait()): gone
                self.returncode = -9
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _request(argv: list[str], cwd: str, env: dict[str, str], executable: str) -> bytes:
    """The request text (cwd, the file to exec or "", argc, the arguments, the
    environment; bb-init's ``parse``); ValueError where Popen would raise it (NUL, "="
    in a name)."""
    parts = [cwd, executable, str(len(argv)), *argv]
    for key, value in env.items():
        if "=" in key or not key:
            raise ValueError(f"illegal environment variable name: {key!r}")
        parts.append(f"{key}={value}")
    if any("\0" in part for part in parts):
        raise ValueError("embedded null byte")
    return b"".join(os.fsencode(part) + b"\0" for part in parts)


def spawn(spawner: int, argv: list[str], cwd: str | None, env: dict[str, str],
          stdin: int | None = None, tty: int | None = None,
          executable: str | None = None) -> Spawned:
    """Start ``argv`` in Q (the file ``executable``, else ``argv[0]`` looked up on
    ``env``'s PATH); OSError as Popen raises it (filename = cwd or argv[0]).

    ``stdin`` (a descriptor the caller keeps and closes) is the command's stdin, else
    /dev/null. With ``tty`` (a terminal's slave end, kept by the caller) the terminal is
    its stdin, stdout and stderr and its controlling terminal, and the result has no
    pipes: the caller reads the master end."""
    cwd = cwd or os.getcwd()
    request = _request(argv, cwd, env, executable or "")
    memfd = os.memfd_create("bb-spawn", os.MFD_CLOEXEC)
    if tty is not None:
        out_r = err_r = None
        stdin, out_w, err_w = os.dup(tty), os.dup(tty), os.dup(tty)
    else:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.O_RDONLY | os.O_CLOEXEC
        stdin = os.open("/dev/null", null) if stdin is None else os.dup(stdin)
    sock = socket.socket(fileno=os.dup(spawner))
    try:
        os.write(memfd, request)
        sock.settimeout(_REPLY_TIMEOUT)
        socket.send_fds(sock, [b"s"], [stdin, out_w, err_w, memfd])
        data, got, _, _ = socket.recv_fds(sock, 64, 1)
        reply = data.split()
    except BaseException:
        _close(out_r, err_r)
        raise
    finally:
        sock.close()
        for fd in (memfd, stdin, out_w, err_w):
            os.close(fd)
    pidfd = got[0] if got else None
    if pidfd is not None:
        os.set_inheritable(pidfd, False)
    try:
        pid, err, step = (int(x) for x in reply)
    except ValueError:
        pid, err, step = -1, errno.EPIPE, 0
    if pid <= 0 or err:
        _close(out_r, err_r, pidfd)
        if pid > 0:  # cloned, but chdir or exec failed: it has exited
            os.waitpid(pid, 0)
        where = cwd if step == 1 else argv[0]
        raise OSError(err or errno.EIO, os.strerror(err or errno.EIO), where)
    if out_r is None or err_r is None:
        return Spawned(pid, None, None, pidfd)
    return Spawned(pid, os.fdopen(out_r, "rb", buffering=0), os.fdopen(err_r, "rb", buffering=0),
                   pidfd)


def _close(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)
