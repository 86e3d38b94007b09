"""The Linux system calls branchbox needs that Python's ``os`` module lacks.

libc is loaded once with ``use_errno=True``; every failure is raised as
``OSError(errno, ...)`` so callers get ``PermissionError``,
``FileNotFoundError`` and friends. Syscall numbers are for x86-64 and live
here only. Standard library only: the same module runs in the daemon and,
inside a sandbox, on the image's python3.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# The same libc through PyDLL, whose calls keep the GIL: a CDLL call releases it, so
# during a raw clone another REPL thread could take it, and the child (which has only
# the calling thread) would wait for that thread for ever on its way back into Python.
_libc_gil_held = ctypes.PyDLL(None, use_errno=True)
_libc_gil_held.syscall.restype = ctypes.c_long

# x86-64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl)
_SYS_CLONE = 56
_SYS_PIVOT_ROOT = 155
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_FSOPEN = 430
_SYS_FSCONFIG = 431
_SYS_FSMOUNT = 432
_SYS_MOUNT_SETATTR = 442

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2

OPEN_TREE_CLONE = 0x1
AT_RECURSIVE = 0x8000
AT_EMPTY_PATH = 0x1000
MOVE_MOUNT_F_EMPTY_PATH = 0x4

FSCONFIG_SET_FLAG = 0
FSCONFIG_SET_STRING = 1
FSCONFIG_SET_FD = 5
FSCONFIG_CMD_CREATE = 6
FSMOUNT_CLOEXEC = 0x1

PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24


def libc() -> ctypes.CDLL:
    """libc, loaded with use_errno (for the few raw syscalls made outside this module)."""
    return _libc


def _check(ret: int, what: str, path: str | None = None) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", path)
    return ret


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    """Join the namespace behind ``fd`` (a namespace file or a pidfd)."""
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


_SIOCGSKNS = 0x894C


def netns_fd() -> int:
    """An fd of this process's network namespace (close-on-exec), without /proc: a
    template's launchers see a /proc where they do not appear."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        return fcntl.ioctl(s.fileno(), _SIOCGSKNS)


def mount(
    source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None
) -> None:
    ret = _libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data))
    _check(ret, f"mount {fstype or source or ''} on {target}", target)


def umount2(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(_b(target), ctypes.c_int(flags)), f"umount {target}", target)


def syncfs(fd: int) -> None:
    """Write back everything dirty on the filesystem holding ``fd`` and wait for it.

    One call instead of an fsync per file: a commit of 23,000 files paid ~20 s of
    fsyncs (each a journal commit and a disk flush) where one syncfs takes well under
    a second. Since Linux 5.8 it reports writeback errors (EIO, ENOSPC) of the
    filesystem as fsync does.
    """
    _check(_libc.syncfs(ctypes.c_int(fd)), "syncfs")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(_SYS_PIVOT_ROOT, _b(new_root), _b(put_old)), "pivot_root", new_root)


def open_tree(path: str, flags: int, dirfd: int = -100) -> int:
    """A detached copy of the mount at ``path`` (with OPEN_TREE_CLONE)."""
    ret = _libc.syscall(_SYS_OPEN_TREE, ctypes.c_int(dirfd), _b(path), ctypes.c_uint(flags))
    return _check(ret, "open_tree", path)


def move_mount_fd(tree_fd: int, target: str) -> None:
    """Attach the detached mount ``tree_fd`` at ``target``."""
    ret = _libc.syscall(
        _SYS_MOVE_MOUNT,
        ctypes.c_int(tree_fd),
        b"",
        ctypes.c_int(-100),
        _b(target),
        ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH),
    )
    _check(ret, "move_mount", target)


def fsopen(fstype: str) -> int:
    return _check(_libc.syscall(_SYS_FSOPEN, _b(fstype), ctypes.c_uint(0x1)), f"fsopen {fstype}")


def fsconfig(fs_fd: int, cmd: int, key: str | None = None, value: str | None = None) -> None:
    ret = _libc.syscall(
        _SYS_FSCONFIG, ctypes.c_int(fs_fd), ctypes.c_uint(cmd), _b(key), _b(value), ctypes.c_int(0)
    )
    _check(ret, f"fsconfig {key}={value}")


def fsconfig_fd(fs_fd: int, key: str, fd: int) -> None:
    """Give a filesystem context a parameter as a file descriptor (e.g. an overlay layer)."""
    ret = _libc.syscall(_SYS_FSCONFIG, ctypes.c_int(fs_fd), ctypes.c_uint(FSCONFIG_SET_FD),
                        _b(key), None, ctypes.c_int(fd))
    _check(ret, f"fsconfig {key}=<fd {fd}>")


MOUNT_ATTR_IDMAP = 0x00100000


def mount_setattr_idmap(tree_fd: int, userns_fd: int) -> None:
    """Make the detached mount ``tree_fd`` show its files through ``userns_fd``'s id map."""
    attr = ctypes.create_string_buffer(struct.pack("QQQQ", MOUNT_ATTR_IDMAP, 0, 0, userns_fd))
    ret = _libc.syscall(_SYS_MOUNT_SETATTR, ctypes.c_int(tree_fd), b"",
                        ctypes.c_uint(AT_EMPTY_PATH), attr, ctypes.c_size_t(len(attr.raw)))
    _check(ret, "mount_setattr(MOUNT_ATTR_IDMAP)")


def fsmount(fs_fd: int, attr_flags: int = 0) -> int:
    """Turn a configured filesystem context into a detached mount fd."""
    ret = _libc.syscall(
        _SYS_FSMOUNT, ctypes.c_int(fs_fd), ctypes.c_uint(FSMOUNT_CLOEXEC), ctypes.c_uint(attr_flags)
    )
    return _check(ret, "fsmount")


def clone_fork(flags: int) -> int:
    """Raw clone(2) with fork semantics (no new stack); returns pid, 0, or -errno.
    Called with the GIL held throughout, as os.fork() does."""
    ret = _libc_gil_held.syscall(_SYS_CLONE, ctypes.c_ulong(flags), None, None, None, None)
    return -ctypes.get_errno() if ret < 0 else ret


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> None:
    ret = _libc.prctl(
        ctypes.c_int(option),
        ctypes.c_ulong(arg2),
        ctypes.c_ulong(arg3),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
    )
    _check(ret, "prctl")


CAP_DAC_OVERRIDE, CAP_SETGID, CAP_SETUID, CAP_SYS_ADMIN = 1, 6, 7, 21
_SYS_CAPSET = 126
_CAP_V3 = 0x20080522
_CAP_LAST = 63


def keep_only_capabilities(keep: set[int]) -> None:
    """Drop every capability but ``keep`` from this process's bounding, permitted,
    effective and inheritable sets, for good (no_new_privs: no exec regains any)."""
    for cap in range(_CAP_LAST + 1):
        if cap not in keep:
            ret = _libc.prctl(ctypes.c_int(PR_CAPBSET_DROP), ctypes.c_ulong(cap), 0, 0, 0)
            if ret != 0 and ctypes.get_errno() != 22:  # EINVAL: past the kernel's last cap
                _check(ret, "prctl(PR_CAPBSET_DROP)")
    mask = sum(1 << cap for cap in keep)
    header = struct.pack("Ii", _CAP_V3, 0)
    data = struct.pack("6I", mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0,
                       mask >> 32, mask >> 32, 0)  # effective, permitted, inheritable x2
    _check(_libc.syscall(_SYS_CAPSET, ctypes.c_char_p(header), ctypes.c_char_p(data)),
           "capset")
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def set_process_name(name: str) -> None:
    """Name shown by ps/top (comm), so host operators can tell the parts apart."""
    buf = ctypes.create_string_buffer(name.encode()[:15])
    _libc.prctl(ctypes.c_int(PR_SET_NAME), buf, 0, 0, 0)


# openat2(2): path resolution the caller constrains (linux/openat2.h).
_SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_OPEN_HOW = struct.Struct("=QQQ")  # struct open_how {u64 flags; u64 mode; u64 resolve}


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2): open ``path`` relative to ``dirfd`` under the ``resolve`` constraints.

    The daemon reads trees a sandbox wrote; plain ``open`` follows symlinks in
    every component but the last, ``RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH``
    follows none and never leaves ``dirfd``. ENOSYS on kernels before 5.6.
    """
    how = ctypes.create_string_buffer(_OPEN_HOW.pack(flags, mode, resolve), _OPEN_HOW.size)
    ret = _libc.syscall(
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_int(dirfd),
        _b(path),
        how,
        ctypes.c_size_t(_OPEN_HOW.size),
    )
    return _check(ret, "openat2", path)


# Landlock (linux/landlock.h): a domain scoped for signals.
_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_SCOPE_SIGNAL = 0x2
_RULESET_ATTR = struct.Struct("=QQQ")  # handled_access_fs, handled_access_net, scoped


def landlock_scope_signals() -> None:
    """Enter a new Landlock domain that may signal only itself and domains nested in it.

    E2BIG past the kernel's 16 nested domains; the caller decides what that means.
    """
    attr = ctypes.create_string_buffer(_RULESET_ATTR.pack(0, 0, _LANDLOCK_SCOPE_SIGNAL),
                                       _RULESET_ATTR.size)
    fd = _check(_libc.syscall(ctypes.c_long(_SYS_LANDLOCK_CREATE_RULESET), attr,
                              ctypes.c_size_t(_RULESET_ATTR.size), ctypes.c_uint32(0)),
                "landlock_create_ruleset")
    try:
        _check(_libc.syscall(ctypes.c_long(_SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(fd),
                             ctypes.c_uint32(0)), "landlock_restrict_self")
    finally:
        os.close(fd)


# Memory mappings (raw syscalls: glibc's mremap is variadic). Addresses are ints.
_SYS_MMAP, _SYS_MPROTECT, _SYS_MUNMAP, _SYS_MREMAP, _SYS_MINCORE = 9, 10, 11, 25, 27
PROT_READ, PROT_WRITE, PROT_EXEC = 0x1, 0x2, 0x4
MAP_SHARED, MAP_FIXED, MAP_ANONYMOUS = 0x01, 0x10, 0x20
_MREMAP_MAYMOVE, _MREMAP_FIXED = 0x1, 0x2
PAGE = os.sysconf("SC_PAGE_SIZE")


def _mem(nr: int, what: str, *args: int) -> int:
    ret = _libc.syscall(ctypes.c_long(nr), *(ctypes.c_ulong(a & 0xFFFFFFFFFFFFFFFF)
                                            for a in args))
    return _check(ret, what)


def mmap(addr: int, length: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    return _mem(_SYS_MMAP, "mmap", addr, length, prot, flags, fd, offset)


def mprotect(addr: int, length: int, prot: int) -> None:
    _mem(_SYS_MPROTECT, "mprotect", addr, length, prot)


def munmap(addr: int, length: int) -> None:
    _mem(_SYS_MUNMAP, "munmap", addr, length)


def mremap_onto(old: int, length: int, new: int) -> None:
    """Move the pages mapped at ``old`` to ``new``, replacing what is mapped there."""
    _mem(_SYS_MREMAP, "mremap", old, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, new)


def mincore(addr: int, length: int) -> bytes:
    """One byte per page of ``[addr, addr+length)``: bit 0 set if the page is in memory."""
    vec = ctypes.create_string_buffer((length + PAGE - 1) // PAGE)
    _check(_libc.syscall(ctypes.c_long(_SYS_MINCORE), ctypes.c_ulong(addr),
                         ctypes.c_ulong(length), vec), "mincore")
    return vec.raw
