"""Opening paths inside a directory a sandbox could have written, without ever leaving it.

The daemon runs as host root. Every tree it reads or writes on a sandbox's
behalf (an upper layer, a workspace directory holding symlinks that earlier
commits put there) may contain symlinks chosen by hostile code, and a path
string is resolved afresh by the kernel at every call: a symlink swapped into
any component between a check and a use redirects the daemon anywhere on the
host. So paths here are always resolved relative to a directory fd, follow no
symlink in any component (not even the last), and never cross into another
mount or above the starting directory: ``openat2`` with
``RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS |
RESOLVE_NO_XDEV``, or, where the kernel lacks it, a walk that opens one
component at a time with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import errno
import os
import stat

from branchbox.agent import sysc

RESOLVE = (
    sysc.RESOLVE_NO_SYMLINKS
    | sysc.RESOLVE_BENEATH
    | sysc.RESOLVE_NO_MAGICLINKS
    | sysc.RESOLVE_NO_XDEV
)
_have_openat2 = True


def open_beneath(dirfd: int, path: str, flags: int) -> int:
    """An fd for ``path`` (relative; "" or "." is ``dirfd`` itself) below ``dirfd``.

    Raises ``OSError`` with ELOOP if any component is a symlink (with
    ``O_PATH`` the last one may be: the fd then names the link itself),
    EXDEV if resolution would leave ``dirfd``'s tree or mount. ``O_CLOEXEC``
    and ``O_NOFOLLOW`` are always added.
    """
    global _have_openat2
    flags |= os.O_CLOEXEC | os.O_NOFOLLOW
    path = path or "."
    if _have_openat2:
        try:
            return sysc.openat2(dirfd, path, flags, 0, RESOLVE)
        except OSError as exc:
            if exc.errno != errno.ENOSYS:
                raise
            _have_openat2 = False
    return _walk(dirfd, path, flags)


def _walk(dirfd: int, path: str, flags: int) -> int:
    """The fallback: one ``openat(O_NOFOLLOW)`` per component, refusing ``..`` and mounts."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if path.startswith("/") or ".." in parts:
        raise OSError(errno.EXDEV, "path leaves its directory", path)
    dev = os.fstat(dirfd).st_dev
    current = os.dup(dirfd)
    try:
        for part in parts[:-1]:
            step = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                           dir_fd=current)
            os.close(current)
            current = step
            if os.fstat(current).st_dev != dev:
                raise OSError(errno.EXDEV, "path crosses a mount", path)
        if not parts:
            found = os.open(".", flags, dir_fd=current)
        else:
            found = os.open(parts[-1], flags, dir_fd=current)
        if os.fstat(found).st_dev != dev:
            os.close(found)
            raise OSError(errno.EXDEV, "path crosses a mount", path)
        return found
    finally:
        os.close(current)


def parent_beneath(dirfd: int, path: str) -> tuple[int, str]:
    """An ``O_PATH`` fd of ``path``'s parent directory below ``dirfd``, and the last name.

    For the *at calls (``os.stat(name, dir_fd=..., follow_symlinks=False)``,
    ``os.rename(..., src_dir_fd=...)``, ``os.readlink(name, dir_fd=...)``)
    that act on the entry itself, never on what a symlink there points to.
    """
    parent, name = os.path.split(path)
    if not name or name in (".", ".."):
        raise OSError(errno.EINVAL, "not an entry name", path)
    return open_beneath(dirfd, parent, os.O_PATH | os.O_DIRECTORY), name


def lstat_beneath(dirfd: int, path: str) -> os.stat_result | None:
    """``lstat`` of ``path`` below ``dirfd`` (None if absent), no component followed."""
    try:
        parent, name = parent_beneath(dirfd, path)
    except FileNotFoundError:
        return None
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(parent)


def open_regular(dirfd: int, path: str) -> tuple[int, os.stat_result] | None:
    """A read-only fd of the regular file ``path`` below ``dirfd`` and its ``fstat``, or
    None if no regular file is there (absent, a symlink, a FIFO, a device, a directory).

    Nothing but a regular file is ever opened for reading: the entry is first looked
    up with ``O_PATH`` (which opens nothing: a FIFO does not block, a device driver is
    not called), checked with ``fstat`` on that fd, and only then re-opened through
    ``/proc/self/fd`` — the same inode, whatever the tree holds by then. Any
    component being a symlink is ELOOP (raised), not followed.
    """
    try:
        pinned = open_beneath(dirfd, path, os.O_PATH)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(pinned)
        if not stat.S_ISREG(st.st_mode):
            return None
        fd = os.open(f"/proc/self/fd/{pinned}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(pinned)
    return fd, st


def readlink_beneath(dirfd: int, path: str) -> str:
    """The target of symlink ``path`` below ``dirfd`` (read, never followed)."""
    parent, name = parent_beneath(dirfd, path)
    try:
        return os.readlink(name, dir_fd=parent)
    finally:
        os.close(parent)


def list_beneath(dirfd: int, path: str) -> list[tuple[str, os.stat_result]]:
    """Names and ``lstat`` of the entries of directory ``path`` below ``dirfd``.

    Listed and stat'ed through the directory's own fd (``fstatat``, no follow), so an
    entry swapped for a symlink is seen as the symlink. Raises like :func:`open_beneath`
    (ENOTDIR or ELOOP when ``path`` is no longer a directory).
    """
    fd = open_beneath(dirfd, path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        found = []
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    found.append((entry.name, entry.stat(follow_symlinks=False)))
                except FileNotFoundError:
                    continue  # removed since the listing
        return found
    finally:
        os.close(fd)


def getxattr_beneath(dirfd: int, path: str, name: str) -> bytes | None:
    """Extended attribute ``name`` of the directory ``path`` below ``dirfd``; None if the
    directory or the attribute is absent, or ``path`` is not (or no longer) a directory.

    Read from the directory's own fd: an ``O_PATH`` fd cannot read xattrs, and a path
    string would follow a symlink swapped into it.
    """
    try:
        fd = open_beneath(dirfd, path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise
    try:
        return os.getxattr(fd, name)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            return None
        raise
    finally:
        os.close(fd)
