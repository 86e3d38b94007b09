"""How overlayfs marks deletions in a layer directory, for the code that reads layers
directly (diff, squash, workspace commit) instead of through a mount."""

from __future__ import annotations

import os
import stat

OPAQUE = "trusted.overlay.opaque"  # "y" on a directory: lower layers' entries are hidden


def is_whiteout(st: os.stat_result) -> bool:
    """A 0:0 character device: the path is deleted in every lower layer."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def is_opaque(path: str) -> bool:
    """An opaque directory: it replaces, rather than merges with, lower layers' one."""
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False
