"""The plain-copy snapshot backend: works on any filesystem, costs O(bytes).

It is the fallback when btrfs is out of reach, so it trades speed for
fidelity: a snapshot must be usable as an overlayfs layer, which means
whiteouts (0/0 character devices), ``trusted.overlay.*`` xattrs, ownership,
modes, symlinks and hardlinks all survive. ``cp -a`` does all of that (and
reflinks on XFS/btrfs), so the copy runs it rather than re-implementing it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_IMMUTABLE_FL = 0x00000010
# Filesystems without inode flags answer with one of these.
_NO_INODE_FLAGS = (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL)


class CopyBackend:
    """Volumes are plain directories; snapshots are full copies."""

    name = "copy"

    def create_volume(self, path: Path) -> None:
        """An empty directory, mode 0755 like a fresh btrfs subvolume."""
        os.mkdir(path, 0o755)

    def snapshot(self, src: Path, dst: Path, *, readonly: bool) -> None:
        """Copy ``src`` to the new path ``dst`` with ``cp -a --reflink=auto``.

        ``--preserve=xattr`` on top of ``-a`` turns a lost xattr into an error
        (``-a`` alone ignores it), since a layer without its overlay xattrs is
        silently wrong. A read-only snapshot gets the immutable flag on its
        top directory only: setting it on the files inside would leak into
        every overlay mount using the layer (overlayfs copies ``S_IMMUTABLE``
        from lower inodes), making those files unwritable in the sandbox. So
        read-only here stops entries being added, removed or renamed at the
        top, not writes deeper down; the btrfs backend enforces it fully.
        """
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(dst))
        if not os.path.isdir(src):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), os.fspath(src))
        proc = subprocess.run(
            [
                "cp",
                "-a",
                "--reflink=auto",
                "--preserve=xattr",
                "--no-target-directory",
                "--",
                os.fspath(src),
                os.fspath(dst),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            remove_tree(dst)
            raise OSError(errno.EIO, f"cp -a failed: {proc.stderr.strip()}", os.fspath(dst))
        if readonly:
            set_immutable(dst, True)

    def delete(self, path: Path) -> None:
        """Remove the volume at ``path``; a missing path is not an error."""
        remove_tree(path)


def set_immutable(path: Path | str, immutable: bool) -> None:
    """Set or clear ``FS_IMMUTABLE_FL`` on directory ``path``.

    A no-op on filesystems without inode flags (e.g. older tmpfs), where a
    copy snapshot is simply not protected.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        buf = bytearray(8)
        try:
            fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf, True)
        except OSError as exc:
            if exc.errno in _NO_INODE_FLAGS:
                return
            raise
        flags = int.from_bytes(buf[:4], "little")
        wanted = flags | FS_IMMUTABLE_FL if immutable else flags & ~FS_IMMUTABLE_FL
        if wanted != flags:
            fcntl.ioctl(fd, FS_IOC_SETFLAGS, bytearray(wanted.to_bytes(8, "little")), True)
    finally:
        os.close(fd)


def _refuse_other_filesystem(path: str) -> None:
    raise OSError(errno.EXDEV, "refusing to delete across a mount point", path)


def remove_tree(
    path: Path | str, on_other_device: Callable[[str], None] = _refuse_other_filesystem
) -> None:
    """Delete ``path`` and everything below it; a missing path is not an error.

    Unlike ``shutil.rmtree`` it also empties directories that lack write or
    search permission (chmod u+rwx first, for callers without
    CAP_DAC_OVERRIDE), clears the immutable flag ``snapshot`` sets, and never
    descends into another filesystem: a directory on a different device is
    handed to ``on_other_device`` (the btrfs backend deletes nested
    subvolumes there); by default that is an error, since it is a mount point
    whose contents are not ours to delete.
    """
    top = os.fspath(path)
    try:
        st = os.lstat(top)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(top)
        return
    set_immutable(top, False)
    # Post-order walk without recursion: a directory is pushed back, marked
    # emptied, beneath its subdirectories, so it is removed after them.
    pending: list[tuple[str, bool]] = [(top, False)]
    while pending:
        current, emptied = pending.pop()
        if emptied:
            os.rmdir(current)
            continue
        if not os.access(current, os.R_OK | os.W_OK | os.X_OK):
            os.chmod(current, stat.S_IMODE(os.lstat(current).st_mode) | stat.S_IRWXU)
        pending.append((current, True))
        with os.scandir(current) as entries:
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.path)
                elif entry.stat(follow_symlinks=False).st_dev != st.st_dev:
                    on_other_device(entry.path)
                else:
                    pending.append((entry.path, False))
