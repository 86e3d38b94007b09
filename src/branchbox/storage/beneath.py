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
