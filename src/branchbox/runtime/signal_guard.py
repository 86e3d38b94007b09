"""The daemon's answers to signal calls of branches nested deeper than Landlock goes.

Branches of a family share one PID namespace and one set of credentials, so
the kernel would let any of them signal any other. Each sandbox's Landlock
domain (``agent/entry.py``) stops that, up to Landlock's 16 nested domains.
A branch below that adds, once for its line of descent, a seccomp filter
that hands its signal calls (``kill``, ``tkill``, ``tgkill``,
``rt_sigqueueinfo``, ``rt_tgsigqueueinfo``, ``pidfd_open``) to this guard;
the kernel holds the caller until the guard answers.

The rule: a caller in a command namespace (Q, or one it made) can only name
processes of its own sandbox, so it is let through. A caller in the family
namespace P (a REPL, or a process REPL code started) is let through only if
the process, thread or process group it names belongs to its own sandbox —
the same cgroup; ``kill(-1)`` is refused. Everything is read from the host's
/proc and the sandbox's cgroup, never from the caller's memory (a pid
argument is a value the kernel already copied).

Each listener gets one thread (the ioctl that receives a notification
blocks), which also keeps the work off the event loop; a token bucket caps
what a branch that loops on ``kill`` can cost the daemon: past it, its calls
simply wait.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import select
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from branchbox.agent import sysc
from branchbox.agent.confine import SIGNALLING
from branchbox.runtime.cgroups import CGROUP_ROOT

_RECV = 0xC0502100  # SECCOMP_IOCTL_NOTIF_RECV: struct seccomp_notif (80 bytes)
_SEND = 0xC0182101  # SECCOMP_IOCTL_NOTIF_SEND: struct seccomp_notif_resp (24 bytes)
_ID_VALID = 0x40082102
_NOTIF = struct.Struct("=QII iIQ 6Q")  # id, pid, flags, nr, arch, ip, args
_RESP = struct.Struct("=QqiI")  # id, val, error, flags
_CONTINUE = 1  # SECCOMP_USER_NOTIF_FLAG_CONTINUE
_SYS_PIDFD_GETFD = 438
_RATE = 2000.0  # decisions per second per listener before callers are made to wait
_NR = {nr: name for name, nr in SIGNALLING.items()}


def _status(pid: int | str, proc: Path) -> dict[str, str]:
    text = (proc / str(pid) / "status").read_text()
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _sandbox_dir(pid: int, proc: Path, cgroups: Path) -> Path | None:
    """The caller's sandbox cgroup directory (``branchbox/<group>/<key>``) in a hierarchy
    that lists all of its processes (v2, or the v1 pids controller)."""
    for line in (proc / str(pid) / "cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "" or "pids" in controllers.split(","):
            parts = path.strip("/").split("/")
            if len(parts) >= 3 and parts[0] == "branchbox":
                base = cgroups if controllers == "" else cgroups / "pids"
                return base.joinpath(*parts[:3])
    return None


def _members(directory: Path) -> list[int]:
    pids: list[int] = []
    for where, _, files in os.walk(directory):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                pids += [int(p) for p in Path(where, "cgroup.procs").read_text().split()]
    return pids


def _level(status: dict[str, str], key: str) -> int | None:
    """The value of an NS* field in the family namespace (the level below the host's)."""
    values = status.get(key, "").split()
    return int(values[1]) if len(values) > 1 else None


def allowed(caller: int, nr: int, args: tuple[int, ...], proc: Path = Path("/proc"),
            cgroups: Path = CGROUP_ROOT) -> bool:
    """Whether host thread ``caller`` may make signal call ``nr`` with ``args``."""
    try:
        levels = _status(caller, proc).get("NSpid", "").split()
        if len(levels) != 2:  # in Q or below: it can only name its own sandbox's processes
            return len(levels) > 2
        directory = _sandbox_dir(caller, proc, cgroups)
    except (OSError, ValueError):
        return False
    if directory is None:
        return False
    target = ctypes.c_int32(args[0] & 0xFFFFFFFF).value
    name = _NR.get(nr)
    if name == "kill" and target == -1:
        return False
    if name == "kill" and target == 0:
        return True
    field = "NSpgid" if name == "kill" and target < 0 else "NSpid"
    wanted = abs(target)
    for pid in _members(directory):
        with contextlib.suppress(OSError, ValueError):
            if name == "tkill":
                for tid in os.listdir(proc / str(pid) / "task"):
                    if _level(_status(f"{pid}/task/{tid}", proc), "NSpid") == wanted:
                        return True
            elif _level(_status(pid, proc), field) == wanted:
                return True
    return False


class SignalGuard:
    """Answers the notifications of every signal filter listener it is given."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listening: dict[str, int] = {}  # by key, while served
        self._lock = threading.Lock()  # a listener is closed only under it

    def take(self, host_pid: int, fd: int) -> int:
        """Take listener ``fd`` out of process ``host_pid``; returns it (for :meth:`serve`)."""
        pidfd = os.pidfd_open(host_pid)
        try:
            ret = sysc.libc().syscall(ctypes.c_long(_SYS_PIDFD_GETFD), ctypes.c_int(pidfd),
                                      ctypes.c_int(fd), ctypes.c_uint(0))
            if ret < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"pidfd_getfd: {os.strerror(err)}")
        finally:
            os.close(pidfd)
        os.set_inheritable(ret, False)
        return ret

    def serve(self, listener: int, key: str) -> None:
        """Start answering ``listener``, the filter's of body ``key`` (consumed: closed once
        its filter has no process left). Also a listener an earlier daemon took, held by
        the fd keeper meanwhile: until then the kernel holds the calls."""
        with self._lock:
            self._listening[key] = listener
        thread = threading.Thread(target=self._serve, args=(listener, key),
                                  name="bb-signal-guard", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2)

    def listening(self, use: Callable[[list[tuple[str, int]]], None]) -> None:
        """Call ``use`` with every listener served, by key, none of them closed meanwhile
        (a new fd keeper takes copies of them)."""
        with self._lock:
            use(list(self._listening.items()))

    def _serve(self, listener: int, key: str) -> None:
        """Until every process under the filter is gone (POLLHUP) or the daemon stops."""
        poller = select.poll()
        poller.register(listener, select.POLLIN)
        tokens, last = _RATE, time.monotonic()
        buf = bytearray(_NOTIF.size)
        try:
            while not self._stop.is_set():
                events = poller.poll(500)
                if any(ev & (select.POLLHUP | select.POLLERR) for _, ev in events):
                    return
                if not events:
                    continue
                now = time.monotonic()
                tokens = min(_RATE, tokens + (now - last) * _RATE)
                last = now
                if tokens < 1:
                    time.sleep((1 - tokens) / _RATE)
                tokens -= 1
                buf[:] = bytes(_NOTIF.size)
                try:
                    fcntl.ioctl(listener, _RECV, buf)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.EINTR):
                        continue  # the caller died before we looked
                    return
                nid, pid, _, nr, _, _, *args = _NOTIF.unpack(buf)
                ok = allowed(pid, nr, tuple(args))
                with contextlib.suppress(OSError):
                    fcntl.ioctl(listener, _ID_VALID, struct.pack("=Q", nid))
                    reply = _RESP.pack(nid, 0, 0, _CONTINUE) if ok else \
                        _RESP.pack(nid, 0, -errno.EPERM, 0)
                    fcntl.ioctl(listener, _SEND, bytearray(reply))
        finally:
            with self._lock:
                self._listening.pop(key, None)
                os.close(listener)
