"""The host id range sandboxes run as, and shifting a tree's ownership into it.

Sandbox code runs as root inside a user namespace whose ids 0..65535 map onto
host ids ``UID_BASE``..``UID_BASE + UID_COUNT - 1``. Image files are chowned
into that range once, when the image is built, so they show up owned by
root (and the right system users) inside every sandbox without an idmapped
mount or a per-sandbox copy.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

UID_BASE = 1_000_000
UID_COUNT = 65536

_SETID_BITS = stat.S_ISUID | stat.S_ISGID


def shift_tree(root: Path, base: int) -> None:
    """Add ``base`` to the uid and gid of ``root`` and of everything below it.

    Symlinks are chowned themselves, never followed; hardlinked files are
    shifted once. chown clears setuid/setgid on executables, so those mode
    bits are put back. Ids must be below ``UID_COUNT`` (what the user
    namespace can map): anything else raises ValueError, which also catches
    a tree that was shifted already. The walk stays on ``root``'s filesystem
    (a mount inside raises OSError EXDEV). On error the tree is left partly
    shifted; callers shift a scratch copy.
    """
    top = os.fspath(root)
    top_st = os.lstat(top)
    seen: set[int] = set()
    _shift(top, top_st, base, seen)
    pending = [top]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if st.st_dev != top_st.st_dev:
                    raise OSError(errno.EXDEV, "mount point inside the tree", entry.path)
                _shift(entry.path, st, base, seen)
                if stat.S_ISDIR(st.st_mode):
                    pending.append(entry.path)


def _shift(path: str, st: os.stat_result, base: int, seen: set[int]) -> None:
    """Shift one entry, given its lstat from before the change."""
    if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
        if st.st_ino in seen:
            return
        seen.add(st.st_ino)
    if not (0 <= st.st_uid < UID_COUNT and 0 <= st.st_gid < UID_COUNT):
        raise ValueError(
            f"{path}: uid/gid {st.st_uid}/{st.st_gid} is outside 0..{UID_COUNT - 1} "
            "(already shifted?)"
        )
    os.chown(path, st.st_uid + base, st.st_gid + base, follow_symlinks=False)
    if st.st_mode & _SETID_BITS and not stat.S_ISLNK(st.st_mode):
        os.chmod(path, stat.S_IMODE(st.st_mode))
