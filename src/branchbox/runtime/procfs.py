"""What a sandbox's REPL holds, read from the host's /proc (for fork).

A fork child re-opens the parent's files in its own root, drops its sockets
and pipes and makes its shared memory mappings its own
(``agent.private_memory``), so the REPL must learn its own fds, shared
mappings and thread count at fork time. It cannot look itself: its /proc shows its sandbox's command
namespace, and the family namespace's proc is exactly what no branch may
mount. The daemon reads them here instead and sends them with the first
fork slot. Paths read through ``/proc/PID/fd`` of a process in another
mount namespace are shown relative to that namespace's root, which is what
the child needs.

Only processes of the sandbox's own cgroup are looked at, so a REPL that
reports a false pid can only point the daemon at its own processes. Work is
bounded: at most ``MAX_FDS`` fds are described (the rest are closed in the
child), and each is a readlink, a stat and a small read; at most ``MAX_SHARED``
shared mappings are described, and a REPL with more cannot be forked
(:class:`TooManyShared`): a child must never keep one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat

MAX_FDS = 4096
MAX_SHARED = 1024


# What maps names shared memory by (tmpfs and shmem: their pages are never evicted, only
# swapped): /dev/zero and System V segments, memfds, /dev/shm blocks.
_SHMEM_PATHS = ("/dev/zero", "/SYSV", "/memfd:", "/dev/shm/")


class TooManyShared(Exception):
    """The REPL has more shared mappings than a fork child can be told about."""


def status(pid: int) -> dict[str, str]:
    """The fields of ``/proc/PID/status`` (values as the kernel writes them)."""
    with open(f"/proc/{pid}/status") as f:
        return dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)


def find_repl(candidates: list[int], ns_pid: int) -> int | None:
    """The host pid of the process among ``candidates`` that is ``ns_pid`` in its family's
    PID namespace (the REPL is one level below the host's; commands are two)."""
    for pid in candidates:
        with contextlib.suppress(OSError, ValueError):
            levels = status(pid)["NSpid"].split()
            if len(levels) == 2 and int(levels[1]) == ns_pid:
                return pid
    return None


def namespaces(pid: int, kinds: tuple[str, ...] = ("mnt", "net", "ipc", "uts")) -> dict[str, int]:
    """The inode of each of process ``pid``'s namespaces of ``kinds`` (the links are the
    kernel's, never a sandbox's)."""
    return {kind: os.stat(f"/proc/{pid}/ns/{kind}").st_ino for kind in kinds}


def root_of(pid: int) -> tuple[int, int]:
    """(device, inode) of process ``pid``'s root directory."""
    st = os.stat(f"/proc/{pid}/root/")
    return st.st_dev, st.st_ino


def describe(pid: int) -> dict:
    """``{"fds": [[fd, kind, path, flags, offset], ...], "threads": n, "shared": [...],
    "swap": bool}`` of process ``pid``; kind is "file" for what a child can re-open by
    path (regular files, directories, character devices), "other" for the rest
    (sockets, pipes, anonymous inodes). ``shared`` and ``swap``: :func:`shared_mappings`,
    and whether the host swaps (then a page not in memory may still hold data)."""
    base = f"/proc/{pid}"
    threads = int(status(pid).get("Threads", "1").strip() or 1)
    entries = []
    for name in sorted(os.listdir(f"{base}/fd"), key=int)[:MAX_FDS]:
        try:
            path = os.readlink(f"{base}/fd/{name}")
            mode = os.stat(f"{base}/fd/{name}").st_mode
            with open(f"{base}/fdinfo/{name}") as f:
                info = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:
            continue  # closed meanwhile
        by_path = stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISCHR(mode)
        kind = "file" if by_path and path.startswith("/") else "other"
        entries.append([int(name), kind, path, int(info["flags"].strip(), 8),
                        int(info["pos"].strip())])
    return {"fds": entries, "threads": threads, "shared": shared_mappings(pid),
            "swap": _swapping()}


def shared_mappings(pid: int) -> list[list]:
    """``[start, end, perms, offset, path, size]`` of every MAP_SHARED mapping of ``pid``
    (perms as in maps, e.g. "rw-s"; path "" when anonymous, relative to the process's own
    root; names that are not UTF-8 as ``os.fsdecode`` gives them). ``size`` is the file's
    size for a mapping of a file on disk (a child that copies it must copy every page in
    it: one evicted from the page cache is not "in memory", yet holds data), else None
    (shared memory: its pages are in memory or swapped). Raises :class:`TooManyShared`
    past ``MAX_SHARED``."""
    found = []
    with open(f"/proc/{pid}/maps", "rb") as f:
        for raw in f:
            fields = os.fsdecode(raw.rstrip(b"\n")).split(maxsplit=5)
            if len(fields) < 5 or not fields[1].endswith("s"):
                continue
            if len(found) == MAX_SHARED:
                raise TooManyShared(f"the REPL has more than {MAX_SHARED} shared memory "
                                    "mappings; a fork child must make each its own")
            start, _, end = fields[0].partition("-")
            path = fields[5] if len(fields) == 6 else ""
            size = None
            if path.startswith("/") and not path.startswith(_SHMEM_PATHS):
                with contextlib.suppress(OSError):
                    size = os.stat(f"/proc/{pid}/map_files/{start}-{end}").st_size
            found.append([int(start, 16), int(end, 16), fields[1], int(fields[2], 16), path,
                          size])
    return found


def _swapping() -> bool:
    with open("/proc/swaps") as f:
        return len(f.read().splitlines()) > 1


def _stat_fields(pid: int) -> list[str]:
    """Fields 3.. of ``/proc/PID/stat`` (after the name, which may hold spaces): index
    ``n - 3`` is field ``n`` of proc(5)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()


def parent(pid: int) -> int:
    """``pid``'s parent (field 4 of its stat)."""
    return int(_stat_fields(pid)[1])


def pidfd_pid(pidfd: int) -> int:
    """The host pid a pidfd refers to (its fdinfo says; -1 once the process is gone)."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise ValueError(f"fd {pidfd} is not a pidfd")


_NS_GET_PARENT = 0xB702


def parent_userns(pid: int) -> int:
    """The inode of the parent of ``pid``'s user namespace."""
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    try:
        up = fcntl.ioctl(fd, _NS_GET_PARENT)
    finally:
        os.close(fd)
    try:
        return os.fstat(up).st_ino
    finally:
        os.close(up)


def start_time(pid: int) -> int:
    """When ``pid`` started (clock ticks after boot, field 22): with the pid, names one
    process for good, where a pid alone may be reused once it dies."""
    return int(_stat_fields(pid)[19])


def cpu_seconds(pids: list[int]) -> float:
    """User and system time of ``pids`` and of the children they reaped, in seconds
    (a process that ends between the listing and the read counts as nothing)."""
    ticks = 0
    for pid in pids:
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        ticks += sum(int(v) for v in fields[11:15])  # utime..cstime: fields 14..17
    return ticks / os.sysconf("SC_CLK_TCK")
