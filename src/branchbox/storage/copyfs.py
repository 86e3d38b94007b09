"""The plain-copy snapshot backend: works on any filesystem, costs O(bytes).

It is the fallback when btrfs is out of reach, so it trades speed for
fidelity: a snapshot must be usable as an overlayfs layer, which means
whiteouts (0/0 character devices), ``trusted.overlay.*`` xattrs, ownership,
modes, symlinks, hardlinks, holes and timestamps all survive.

The source is a sandbox's writable volume, written by hostile code, and the
copy runs as host root. So the copy is an fd-relative walk that never follows
a symlink: each directory is opened from its parent's fd with
``O_NOFOLLOW | O_DIRECTORY``, every entry is ``fstatat``'ed without following,
a file's content is read only from an fd that ``fstat`` proved to be a regular
file (looked up with ``O_PATH`` first, so a FIFO or a device is never opened),
symlinks are copied as symlinks, FIFOs, sockets and whiteouts are made anew
with ``mknod`` (they have no content), and other device nodes are left out (a
sandbox cannot make one: ``mknod`` of a device is refused in a user namespace,
and one must never appear in the store made by host root). Modes (set-id bits
included: the layer is only ever mounted ``nosuid``) and owners are copied as
stored. ``cp -a``, which this replaced, resolves path strings: a sandbox
swapping a directory and a symlink mid-copy could have made it copy host files
into the layer its children read. The engine also freezes the whole sandbox
for a copy snapshot of its live volume (see ``engine.layers.Layers.freeze``), so
the layer is one instant; the walk's safety does not depend on that.

Read-only snapshots are made immutable at their top directory only (setting
the flag on the files inside would leak into every overlay mount using the
layer: overlayfs copies ``S_IMMUTABLE`` from lower inodes, making those files
unwritable in the sandbox). They need no more, because nothing a sandbox can
reach writes them: a frozen layer is only ever an overlay *lower* layer, and
overlayfs never writes a lower layer (every change is copied up into the
sandbox's own upper layer); the daemon hands the lowers to the kernel as fds it
closes after the mount, the sandbox's mount table shows no store path, no store
directory is mounted into any sandbox, and ``open_by_handle_at`` needs
``CAP_DAC_READ_SEARCH`` in the host's user namespace. The only writers of the
store are the daemon's own (a squash writes a new volume, never a frozen one).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Callable
from pathlib import Path

FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_IMMUTABLE_FL = 0x00000010
# Filesystems without inode flags answer with one of these.
_NO_INODE_FLAGS = (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL)
_FICLONE = 0x40049409
_NO_CLONE = (errno.EXDEV, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTTY, errno.ENOSYS)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 16 << 20


class CopyBackend:
    """Volumes are plain directories; snapshots are full copies."""

    name = "copy"

    def create_volume(self, path: Path) -> None:
        """An empty directory, mode 0755 like a fresh btrfs subvolume."""
        os.mkdir(path, 0o755)

    def snapshot(self, src: Path, dst: Path, *, readonly: bool) -> None:
        """Copy the volume ``src`` to the new path ``dst`` without following any symlink
        below ``src`` (see the module's docstring); a read-only snapshot gets the
        immutable flag on its top directory."""
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(dst))
        src_fd = os.open(src, _DIR)  # ENOTDIR/ELOOP when src is not a directory
        try:
            os.mkdir(dst, 0o700)
            try:
                copy_tree(src_fd, os.fspath(dst))
            except BaseException:
                remove_tree(dst)
                raise
        finally:
            os.close(src_fd)
        if readonly:
            set_immutable(dst, True)

    def delete(self, path: Path) -> None:
        """Remove the volume at ``path``; a missing path is not an error."""
        remove_tree(path)


def copy_tree(src_fd: int, dst: str) -> None:
    """Copy the directory open at ``src_fd`` into the new, empty directory ``dst``.

    Iterative (a deep tree costs one fd pair per level, not a Python frame), and
    directory metadata is applied after the directory's entries, so its times and a
    read-only mode stick.
    """
    dev = os.fstat(src_fd).st_dev
    root = os.open(dst, _DIR)
    links: dict[tuple[int, int], str] = {}  # (dev, ino) of a multiply linked file -> dst path
    # Each frame: the source and destination directory fds, the destination path, and
    # the entries still to copy.
    stack = [(os.dup(src_fd), root, dst, _entries(src_fd))]
    try:
        while stack:
            sfd, dfd, dpath, todo = stack[-1]
            if not todo:
                stack.pop()
                try:
                    _dir_metadata(sfd, dfd)
                finally:
                    os.close(sfd)
                    os.close(dfd)
                continue
            name, st = todo.pop()
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, _DIR, dir_fd=sfd)  # ELOOP if swapped for a symlink
                try:
                    if os.fstat(sub).st_dev != dev:
                        raise OSError(errno.EXDEV, "refusing to copy across a mount",
                                      f"{dpath}/{name}")
                    os.mkdir(name, 0o700, dir_fd=dfd)
                    dsub = os.open(name, _DIR, dir_fd=dfd)
                except BaseException:
                    os.close(sub)
                    raise
                stack.append((sub, dsub, f"{dpath}/{name}", _entries(sub)))
            else:
                _copy_entry(sfd, dfd, dpath, name, st, links)
    finally:
        for sfd, dfd, _, _ in stack:
            os.close(sfd)
            os.close(dfd)


def _entries(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """The entries of an open directory, each ``fstatat``'ed without following."""
    found = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            found.append((entry.name, entry.stat(follow_symlinks=False)))
    return found


def _copy_entry(sfd: int, dfd: int, dpath: str, name: str, st: os.stat_result,
                links: dict[tuple[int, int], str]) -> None:
    """Copy one non-directory entry ``name`` of directory ``sfd`` into ``dfd``."""
    mode = st.st_mode
    key = (st.st_dev, st.st_ino)
    if st.st_nlink > 1 and key in links:  # another name of a file already copied
        os.link(links[key], name, dst_dir_fd=dfd, follow_symlinks=False)
        return
    if stat.S_ISREG(mode):
        _copy_file(sfd, dfd, name, st)
    elif stat.S_ISLNK(mode):
        os.symlink(os.readlink(name, dir_fd=sfd), name, dir_fd=dfd)
    elif stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or (stat.S_ISCHR(mode) and st.st_rdev == 0):
        os.mknod(name, stat.S_IFMT(mode) | 0o600, st.st_rdev, dir_fd=dfd)
    else:
        return  # a device node: never recreated by host root (see the module docstring)
    os.chown(name, st.st_uid, st.st_gid, dir_fd=dfd, follow_symlinks=False)
    if not stat.S_ISLNK(mode):
        os.chmod(name, stat.S_IMODE(mode), dir_fd=dfd)  # after chown, which clears set-id
    _xattrs(f"/proc/self/fd/{sfd}/{name}", f"/proc/self/fd/{dfd}/{name}")
    os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dfd, follow_symlinks=False)
    if st.st_nlink > 1:
        links[key] = f"{dpath}/{name}"


def _copy_file(sfd: int, dfd: int, name: str, st: os.stat_result) -> None:
    """Copy a regular file's content (cloned where the filesystem can, holes kept).

    The source is looked up ``O_PATH`` and proven a regular file by ``fstat`` before
    it is opened for reading through ``/proc/self/fd`` (the same inode), so a FIFO or
    device swapped in since the listing is never opened; a symlink is never followed.
    """
    pinned = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sfd)
    try:
        if not stat.S_ISREG(os.fstat(pinned).st_mode):
            raise OSError(errno.ESTALE, "changed while copied", name)
        src = os.open(f"/proc/self/fd/{pinned}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(pinned)
    try:
        dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                      | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            try:
                fcntl.ioctl(dst, _FICLONE, src)
            except OSError as exc:
                if exc.errno not in _NO_CLONE:
                    raise
                _copy_data(src, dst, os.fstat(src).st_size)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _copy_data(src: int, dst: int, size: int) -> None:
    """Copy the data ranges of ``src`` (``SEEK_DATA``/``SEEK_HOLE``) and leave its holes
    as holes: a sandbox's 1 EiB sparse file costs nothing to copy."""
    pos = 0
    while pos < size:
        try:
            data = os.lseek(src, pos, os.SEEK_DATA)
            hole = os.lseek(src, data, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                break  # a hole up to the end
            if exc.errno != errno.EINVAL:
                raise
            data, hole = pos, size  # no SEEK_DATA on this filesystem: all data
        end = min(hole, size)
        while data < end:
            n = _copy_range(src, dst, min(_CHUNK, end - data), data)
            if n == 0:  # shorter than it was: keep what there is
                end = size = data
                break
            data += n
        pos = max(end, pos + 1)
    os.ftruncate(dst, size)


def _copy_range(src: int, dst: int, n: int, offset: int) -> int:
    """Copy up to ``n`` bytes at ``offset`` (in-kernel where possible); bytes copied."""
    try:
        return os.copy_file_range(src, dst, n, offset, offset)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    chunk = os.pread(src, n, offset)
    done = 0
    while done < len(chunk):
        done += os.pwrite(dst, chunk[done:], offset + done)
    return len(chunk)


def _xattrs(src: int | str, dst: int | str) -> None:
    """Copy every extended attribute (overlay's ``trusted.*`` ones above all).

    Paths given here are ``/proc/self/fd/<dir fd>/<name>``: the directory is the pinned
    one, and the last component is not followed. A filesystem without xattrs has none
    to copy; any other failure is an error, since a layer without its overlay xattrs
    is silently wrong.
    """
    follow = isinstance(src, int)
    try:
        names = os.listxattr(src, follow_symlinks=follow)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EPERM):
            return
        raise
    for attr in names:
        try:
            value = os.getxattr(src, attr, follow_symlinks=follow)
        except OSError as exc:
            if exc.errno == errno.ENODATA:
                continue  # removed since the listing
            raise
        os.setxattr(dst, attr, value, follow_symlinks=follow)


def _dir_metadata(sfd: int, dfd: int) -> None:
    st = os.fstat(sfd)
    os.fchown(dfd, st.st_uid, st.st_gid)
    os.fchmod(dfd, stat.S_IMODE(st.st_mode))
    _xattrs(sfd, dfd)
    os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))


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
