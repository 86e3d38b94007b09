"""Reading back what a sandbox may have planted on the host, without following it."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def regular_files(root: Path) -> dict[str, bytes]:
    """Content of every regular file below ``root``; symlinks are never followed."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f:
                    found[os.path.relpath(path, root)] = f.read()
    return found
