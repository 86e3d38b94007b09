"""Squash a chain of frozen overlay layers into one, so layer chains stay bounded.

Every fork stacks one frozen layer under its children, and merge_into makes
the parent adopt the child's deeper stack; a thousand fork→merge rounds
would otherwise mean a thousand lower layers on every path lookup. The
engine squashes when a chain grows past a bound: the bottom layer is
snapshotted (O(1) on btrfs) and the layers above it are applied on top, in
time proportional to what they hold, with overlayfs' rules — a whiteout
removes the path and stays a whiteout (it must still hide the image below),
an opaque directory replaces the whole directory, anything else replaces
the path. File data is cloned (FICLONE) where the filesystem can, so
squashing does not copy bytes on btrfs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
from pathlib import Path

from branchbox.storage.overlay import OPAQUE, is_opaque

_FICLONE = 0x40049409


def _xattrs(src: str, dst: str) -> None:
    with contextlib.suppress(OSError):
        for name in os.listxattr(src, follow_symlinks=False):
            if name.startswith("trusted.overlay.") and name != OPAQUE:
                continue  # origin/impure/redirect refer to the layer the file came from
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False),
                        follow_symlinks=False)


def _metadata(src: str, dst: str, st: os.stat_result) -> None:
    os.lchown(dst, st.st_uid, st.st_gid)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    _xattrs(src, dst)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _copy_file(src: str, dst: str) -> None:
    with open(src, "rb") as fsrc, open(dst, "wb") as fdst:
        try:
            fcntl.ioctl(fdst.fileno(), _FICLONE, fsrc.fileno())
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTTY):
                raise
            shutil.copyfileobj(fsrc, fdst, 1 << 20)


def _copy_entry(src: str, dst: str, st: os.stat_result) -> None:
    """Copy one non-directory entry (file, symlink, whiteout or other node)."""
    if stat.S_ISREG(st.st_mode):
        _copy_file(src, dst)
    elif stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    else:
        os.mknod(dst, st.st_mode, st.st_rdev)
    _metadata(src, dst, st)


def _copy_tree(src: str, dst: str, st: os.stat_result) -> None:
    os.mkdir(dst)
    for entry in os.scandir(src):
        est = entry.stat(follow_symlinks=False)
        target = os.path.join(dst, entry.name)
        if stat.S_ISDIR(est.st_mode):
            _copy_tree(entry.path, target, est)
        else:
            _copy_entry(entry.path, target, est)
    _metadata(src, dst, st)


def apply_layer(src: str, dst: str) -> None:
    """Apply the overlay layer directory ``src`` onto the layer directory ``dst``."""
    for entry in os.scandir(src):
        st = entry.stat(follow_symlinks=False)
        target = os.path.join(dst, entry.name)
        if stat.S_ISDIR(st.st_mode):
            opaque = is_opaque(entry.path)
            existing = os.path.isdir(target) and not os.path.islink(target)
            if opaque or not existing:
                _remove(target)
                _copy_tree(entry.path, target, st)
            else:
                apply_layer(entry.path, target)
                _metadata(entry.path, target, st)
        else:
            _remove(target)
            _copy_entry(entry.path, target, st)


def squash(backend, volumes: list[Path], dst: Path) -> None:
    """Make volume ``dst`` equal to the overlay of ``volumes`` (top first; each has upper/,
    and ws/upper when the sandbox has a workspace)."""
    backend.snapshot(volumes[-1], dst, readonly=False)
    try:
        for volume in reversed(volumes[:-1]):
            for layer in ("upper", "ws/upper"):  # the root, and a workspace if there is one
                if (volume / layer).is_dir():
                    apply_layer(str(volume / layer), str(dst / layer))
    except BaseException:
        backend.delete(dst)
        raise
