"""btrfs subvolume operations as direct ioctls.

Fork takes one snapshot per child, so these calls sit on the hot path. The
``btrfs`` CLI costs milliseconds per call (fork + exec + its own setup); the
ioctl costs what the kernel's transaction commit costs and nothing more.

Request numbers and struct layouts were checked against
``/usr/include/linux/btrfs.h`` (linux-libc-dev, kernel 6.x) by compiling the
macros. Every failure is raised as ``OSError(errno, message, path)``, so
callers can catch ``FileExistsError``, ``FileNotFoundError`` and friends.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
import struct
from pathlib import Path

BTRFS_SUPER_MAGIC = 0x9123683E

BTRFS_IOC_SUBVOL_CREATE = 0x5000940E  # _IOW(0x94, 14, struct btrfs_ioctl_vol_args)
BTRFS_IOC_SNAP_DESTROY = 0x5000940F  # _IOW(0x94, 15, struct btrfs_ioctl_vol_args)
BTRFS_IOC_SNAP_CREATE_V2 = 0x50009417  # _IOW(0x94, 23, struct btrfs_ioctl_vol_args_v2)
BTRFS_IOC_SUBVOL_GETFLAGS = 0x80089419  # _IOR(0x94, 25, __u64)
BTRFS_IOC_SUBVOL_SETFLAGS = 0x4008941A  # _IOW(0x94, 26, __u64)
BTRFS_SUBVOL_RDONLY = 1 << 1

# Both argument structs are 4096 bytes. v1: {s64 fd; char name[4088]}.
# v2: {s64 fd; u64 transid; u64 flags; u64 unused[4]; char name[4040]}.
_ARGS_SIZE = 4096
_V1_NAME_AT = 8
_V2_NAME_AT = 56
_V2_HEAD = struct.Struct("=qQQ")

# The root directory of every subvolume has this inode number; a plain
# directory never does. It is how `btrfs subvolume show` tells them apart too.
_SUBVOL_ROOT_INO = 256

_libc = ctypes.CDLL(None, use_errno=True)
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
_STATFS_SIZE = 256  # larger than struct statfs on every Linux ABI; f_type comes first


def is_btrfs(path: Path | str) -> bool:
    """Whether ``path`` lies on a btrfs filesystem (statfs ``f_type``).

    ``os.statvfs`` does not expose the filesystem type, hence ctypes.
    """
    buf = ctypes.create_string_buffer(_STATFS_SIZE)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(path))
    f_type: int = struct.unpack_from("l", buf)[0]
    return f_type & 0xFFFFFFFF == BTRFS_SUPER_MAGIC


def is_subvolume(path: Path | str) -> bool:
    """Whether ``path`` is the root directory of a btrfs subvolume."""
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_ino == _SUBVOL_ROOT_INO and is_btrfs(path)


def create_subvolume(path: Path | str) -> None:
    """Create an empty subvolume at ``path`` (its parent must exist)."""
    parent, name = _parent_and_name(path, _ARGS_SIZE - _V1_NAME_AT - 1)
    args = bytearray(_ARGS_SIZE)
    args[_V1_NAME_AT : _V1_NAME_AT + len(name)] = name
    _ioctl_in(parent, BTRFS_IOC_SUBVOL_CREATE, args, path)


def snapshot(src: Path | str, dst: Path | str, readonly: bool) -> None:
    """Snapshot subvolume ``src`` as a new subvolume ``dst``, in O(1).

    ``src`` must be a subvolume root: given a plain directory the kernel would
    silently snapshot the whole subvolume containing it, so that is refused
    with EINVAL. Nested subvolumes of ``src`` show up in ``dst`` as empty
    directories.
    """
    parent, name = _parent_and_name(dst, _ARGS_SIZE - _V2_NAME_AT - 1)
    src_fd = _open_dir(src)
    try:
        if os.fstat(src_fd).st_ino != _SUBVOL_ROOT_INO:
            raise OSError(errno.EINVAL, "not a btrfs subvolume", os.fspath(src))
        args = bytearray(_ARGS_SIZE)
        _V2_HEAD.pack_into(args, 0, src_fd, 0, BTRFS_SUBVOL_RDONLY if readonly else 0)
        args[_V2_NAME_AT : _V2_NAME_AT + len(name)] = name
        _ioctl_in(parent, BTRFS_IOC_SNAP_CREATE_V2, args, dst)
    finally:
        os.close(src_fd)


def delete_subvolume(path: Path | str) -> None:
    """Destroy subvolume ``path``, read-only or not, with any subvolumes nested in it.

    The common case is one ioctl. The kernel refuses (ENOTEMPTY) a subvolume
    that still contains others; only then is the tree walked to find them,
    after making ``path`` writable, since removing a nested subvolume writes
    to the directory that holds it.
    """
    parent, name = _parent_and_name(path, _ARGS_SIZE - _V1_NAME_AT - 1)
    args = bytearray(_ARGS_SIZE)
    args[_V1_NAME_AT : _V1_NAME_AT + len(name)] = name
    try:
        _ioctl_in(parent, BTRFS_IOC_SNAP_DESTROY, args, path)
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:
            raise
        set_readonly(path, False)
        for nested in nested_subvolumes(path):
            delete_subvolume(nested)
        _ioctl_in(parent, BTRFS_IOC_SNAP_DESTROY, args, path)


def set_readonly(path: Path | str, readonly: bool) -> None:
    """Set or clear the read-only property of subvolume ``path``."""
    fd = _open_dir(path)
    try:
        flags = bytearray(8)
        _ioctl(fd, BTRFS_IOC_SUBVOL_GETFLAGS, flags, path)
        (value,) = struct.unpack("=Q", flags)
        wanted = value | BTRFS_SUBVOL_RDONLY if readonly else value & ~BTRFS_SUBVOL_RDONLY
        if wanted != value:
            _ioctl(fd, BTRFS_IOC_SUBVOL_SETFLAGS, bytearray(struct.pack("=Q", wanted)), path)
    finally:
        os.close(fd)


def nested_subvolumes(path: Path | str) -> list[str]:
    """Subvolume roots inside subvolume ``path``, not descending into them.

    Each subvolume has its own ``st_dev``, so a directory whose device differs
    from its parent's is either a nested subvolume or a mount point; only the
    former has the subvolume root's inode number.
    """
    root = os.fspath(path)
    dev = os.lstat(root).st_dev
    found: list[str] = []
    pending = [root]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                if st.st_dev == dev:
                    pending.append(entry.path)
                elif st.st_ino == _SUBVOL_ROOT_INO:
                    found.append(entry.path)
    return found


def _parent_and_name(path: Path | str, max_len: int) -> tuple[str, bytes]:
    """Split ``path`` into the directory the ioctl runs on and the entry name."""
    parent, name = os.path.split(os.path.normpath(os.fspath(path)))
    raw = os.fsencode(name)
    if raw in (b"", b".", b"..") or len(raw) > max_len:
        raise OSError(errno.EINVAL, "invalid subvolume name", os.fspath(path))
    return parent or ".", raw


def _open_dir(path: Path | str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _ioctl_in(parent: str, request: int, args: bytearray, path: Path | str) -> None:
    """Run ``request`` on the directory ``parent``; errors name ``path``."""
    fd = _open_dir(parent)
    try:
        _ioctl(fd, request, args, path)
    finally:
        os.close(fd)


def _ioctl(fd: int, request: int, args: bytearray, path: Path | str) -> None:
    """ioctl with a mutable buffer (immutable ones are capped at 1024 bytes)."""
    try:
        fcntl.ioctl(fd, request, args, True)
    except OSError as exc:
        # ENOTTY reads "Inappropriate ioctl for device"; say what it means here.
        text = "not on a btrfs filesystem" if exc.errno == errno.ENOTTY else exc.strerror
        raise OSError(exc.errno, text, os.fspath(path)) from None
