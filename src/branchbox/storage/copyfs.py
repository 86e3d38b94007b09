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
from collections.abc import Callable, Iterator
from pathlib import Path

FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_IMMUTABLE_FL = 0x00000010
# Filesystems without inode flags answer with one of these.
_NO_INODE_FLAGS = (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL)
_FICLONE = 0x40049409
_NO_CLONE = (errno.EXDEV, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTTY, errno.ENOSYS)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # never followed
_CHUNK = 16 << 20
PATH_MAX = 4096  # bytes of a path the kernel takes, its NUL included


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
        src_fd = os.open(src, DIR_FLAGS)  # ENOTDIR/ELOOP when src is not a directory
        try:
            os.mkdir(dst, 0o700)
            try:
                dst_fd = os.open(dst, DIR_FLAGS)
                try:
                    copy_tree(src_fd, dst_fd)
                finally:
                    os.close(dst_fd)
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


class Cursor:
    """One open directory of a depth-first walk: down into a subdirectory, back up
    through ``..``, checked to be the very directory it came from. One fd however deep
    the tree: a sandbox makes a tree of 100,000 levels in a second, and a walk holding
    a fd per level would empty the daemon's fd table for every other sandbox."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._back: list[tuple[int, int]] = []  # (st_dev, st_ino) of each level above

    @classmethod
    def pair(cls, src_fd: int, dst_fd: int) -> tuple[Cursor, Cursor]:
        """Cursors at copies of ``src_fd`` and ``dst_fd`` (the first closed if the
        second cannot be made): a walk of one tree beside another."""
        src = cls(os.dup(src_fd))
        try:
            return src, cls(os.dup(dst_fd))
        except BaseException:
            src.close()
            raise

    def down(self, sub: int) -> None:
        """Move to the subdirectory open at ``sub``, which the cursor owns from now on."""
        try:
            st = os.fstat(self.fd)
        except BaseException:
            os.close(sub)
            raise
        self._back.append((st.st_dev, st.st_ino))
        os.close(self.fd)
        self.fd = sub

    def up(self) -> None:
        """Back to the directory the last ``down`` came from."""
        parent = os.open("..", DIR_FLAGS, dir_fd=self.fd)
        try:
            st = os.fstat(parent)
            if (st.st_dev, st.st_ino) != self._back[-1]:
                raise OSError(errno.ESTALE, "a directory moved while it was walked")
        except BaseException:
            os.close(parent)
            raise
        os.close(self.fd)
        self.fd = parent
        self._back.pop()

    def close(self) -> None:
        os.close(self.fd)


def descend(src: Cursor, dst: Cursor, name: str, *, dev: int | None = None,
            make: bool = False) -> None:
    """Both cursors down into their directory ``name`` (made in ``dst`` first with
    ``make``); the source's must be on device ``dev`` if given (EXDEV: a mount)."""
    sub = os.open(name, DIR_FLAGS, dir_fd=src.fd)  # ELOOP if swapped for a symlink
    try:
        if dev is not None and os.fstat(sub).st_dev != dev:
            raise OSError(errno.EXDEV, "refusing to walk across a mount", name)
        if make:
            os.mkdir(name, 0o700, dir_fd=dst.fd)
        dsub = os.open(name, DIR_FLAGS, dir_fd=dst.fd)
    except BaseException:
        os.close(sub)
        raise
    src.down(sub)
    dst.down(dsub)


def walk(top_fd: int) -> Iterator[tuple[int, str, os.stat_result]]:
    """Every entry below the directory open at ``top_fd``, depth first, as (fd of its
    directory, valid until the next step; name; lstat). Directories on another device
    are given but not entered; one fd however deep (``Cursor``)."""
    dev = os.fstat(top_fd).st_dev
    at = Cursor(os.dup(top_fd))
    try:
        frames = [listing(at.fd)]  # each: a directory's entries still to give
        while frames:
            if not frames[-1]:
                frames.pop()
                if frames:
                    at.up()
                continue
            name, st = frames[-1].pop()
            yield at.fd, name, st
            if stat.S_ISDIR(st.st_mode) and st.st_dev == dev:
                at.down(os.open(name, DIR_FLAGS, dir_fd=at.fd))
                frames.append(listing(at.fd))
    finally:
        at.close()


def every_xattr(name: str) -> bool:
    """Copy every extended attribute (a snapshot is the same layer)."""
    return True


def copy_tree(src_fd: int, dst_fd: int, keep_xattr: Callable[[str], bool] = every_xattr
              ) -> None:
    """Copy the directory open at ``src_fd`` into the empty directory open at ``dst_fd``
    (its own metadata too), copying the extended attributes ``keep_xattr`` accepts.

    Iterative and fd-relative (two fds however deep the tree, no path longer than
    PATH_MAX, memory for one name per level), and directory metadata is applied after
    the directory's entries, so its times and a read-only mode stick. A file linked more
    than once is copied once and linked again; one too deep to be named for that is
    refused (ENAMETOOLONG) rather than copied once per link.
    """
    dev = os.fstat(src_fd).st_dev
    # (dev, ino) of a multiply linked file -> its first copy relative to dst_fd (None:
    # too deep to name)
    links: dict[tuple[int, int], str | None] = {}
    src, dst = Cursor.pair(src_fd, dst_fd)
    try:
        # Each frame: a directory's entries still to copy, its name, and the length of
        # its path relative to dst_fd in bytes.
        frames = [(listing(src.fd), "", 0)]
        while frames:
            todo, _, length = frames[-1]
            if not todo:
                dir_metadata(src.fd, dst.fd, keep_xattr)
                frames.pop()
                if frames:
                    src.up()
                    dst.up()
                continue
            name, st = todo.pop()
            if stat.S_ISDIR(st.st_mode):
                descend(src, dst, name, dev=dev, make=True)
                frames.append((listing(src.fd), name, length + len(os.fsencode(name)) + 1))
                continue
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in links:  # another name of a file already copied
                first = links[key]
                if first is None:
                    raise OSError(errno.ENAMETOOLONG, "a file linked more than once lies "
                                  "too deep to be linked again", name)
                os.link(first, name, src_dir_fd=dst_fd, dst_dir_fd=dst.fd,
                        follow_symlinks=False)
                continue
            copy_entry(src.fd, dst.fd, name, st, keep_xattr)
            if st.st_nlink > 1:
                deep = length + len(os.fsencode(name)) >= PATH_MAX - 1
                links[key] = None if deep else "/".join([*(f[1] for f in frames[1:]), name])
    finally:
        src.close()
        dst.close()


def listing(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """The entries of an open directory, each ``fstatat``'ed without following."""
    found = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            found.append((entry.name, entry.stat(follow_symlinks=False)))
    return found


def copy_entry(sfd: int, dfd: int, name: str, st: os.stat_result,
               keep_xattr: Callable[[str], bool] = every_xattr) -> None:
    """Copy the non-directory entry ``name`` (``st``: its lstat) of directory ``sfd``
    into ``dfd``, where nothing has that name: a file's data, a symlink as a symlink, a
    whiteout, FIFO or socket made anew; a device node is left out."""
    mode = st.st_mode
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
    _xattrs(f"/proc/self/fd/{sfd}/{name}", f"/proc/self/fd/{dfd}/{name}", keep_xattr)
    os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dfd, follow_symlinks=False)


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
            clone_or_copy(src, dst, os.fstat(src).st_size)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def clone_or_copy(src: int, dst: int, size: int) -> None:
    """``src``'s ``size`` bytes into the empty file ``dst``: a reflink where the
    filesystem can (O(1)), else a copy of its data that keeps its holes."""
    try:
        fcntl.ioctl(dst, _FICLONE, src)
    except OSError as exc:
        if exc.errno not in _NO_CLONE:
            raise
        _copy_data(src, dst, size)


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


def _xattrs(src: int | str, dst: int | str, keep: Callable[[str], bool]) -> None:
    """Copy the extended attributes ``keep`` accepts (overlay's ``trusted.*`` ones above
    all).

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
    for attr in filter(keep, names):
        try:
            value = os.getxattr(src, attr, follow_symlinks=follow)
        except OSError as exc:
            if exc.errno == errno.ENODATA:
                continue  # removed since the listing
            raise
        os.setxattr(dst, attr, value, follow_symlinks=follow)


def dir_metadata(sfd: int, dfd: int, keep_xattr: Callable[[str], bool] = every_xattr
                 ) -> None:
    """Give directory ``dfd`` the owner, mode, extended attributes and times of ``sfd``."""
    st = os.fstat(sfd)
    os.fchown(dfd, st.st_uid, st.st_gid)
    os.fchmod(dfd, stat.S_IMODE(st.st_mode))
    _xattrs(sfd, dfd, keep_xattr)
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
    top = os.path.normpath(os.fspath(path))
    try:
        st = os.lstat(top)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(top)
        return
    set_immutable(top, False)
    # The parent is the caller's path, followed as before (an image build removes
    # usr/share/doc/<pkg>/... where <pkg> may be a symlink); below it nothing is.
    parent = os.open(os.path.dirname(top) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        remove_entry(parent, os.path.basename(top), on_other_device)
    finally:
        os.close(parent)


def remove_entry(parent: int, name: str,
                 on_other_device: Callable[[str], None] = _refuse_other_filesystem) -> None:
    """Delete ``name`` of the directory open at ``parent``, and everything below it if it
    is a directory (as ``remove_tree``; a missing name is not an error).

    Iterative and fd-relative (one fd however deep, no path longer than PATH_MAX)."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent)
        return
    # Each frame: a directory's name and its subdirectories still to remove (None: not
    # listed yet); the cursor is at the last frame's. A directory goes once they have.
    at = Cursor(_open_to_empty(parent, name))
    frames: list[tuple[str, list[str] | None]] = [(name, None)]
    try:
        while frames:
            dname, subdirs = frames[-1]
            if subdirs is None:
                subdirs = _empty(at.fd, st.st_dev, on_other_device)
                frames[-1] = (dname, subdirs)
            if subdirs:
                sub = subdirs.pop()
                at.down(_open_to_empty(at.fd, sub))
                frames.append((sub, None))
                continue
            frames.pop()
            if frames:
                at.up()
                os.rmdir(dname, dir_fd=at.fd)
    finally:
        at.close()
    os.rmdir(name, dir_fd=parent)


def _open_to_empty(parent: int, name: str) -> int:
    """Directory ``name`` of ``parent`` opened (not followed), with u+rwx if it lacked
    them: its entries are about to be removed."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    except PermissionError:  # no read permission (a caller without CAP_DAC_OVERRIDE)
        pinned = os.open(name, os.O_PATH | DIR_FLAGS, dir_fd=parent)
        try:
            os.chmod(f"/proc/self/fd/{pinned}", 0o700)  # that very directory
        finally:
            os.close(pinned)
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if mode & stat.S_IRWXU != stat.S_IRWXU:
        os.fchmod(fd, mode | stat.S_IRWXU)
    return fd


def _empty(fd: int, dev: int, on_other_device: Callable[[str], None]) -> list[str]:
    """Unlink what the directory ``fd`` holds but directories; hand those on device
    other than ``dev`` to ``on_other_device``; the names of the others."""
    subdirs = []
    with os.scandir(fd) as entries:
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.name, dir_fd=fd)
            elif entry.stat(follow_symlinks=False).st_dev != dev:
                on_other_device(f"/proc/self/fd/{fd}/{entry.name}")
            else:
                subdirs.append(entry.name)
    return subdirs
