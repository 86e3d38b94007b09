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

import os
import stat
from pathlib import Path

from branchbox.storage.copyfs import (
    DIR_FLAGS,
    Cursor,
    copy_entry,
    copy_tree,
    descend,
    dir_metadata,
    listing,
    remove_entry,
)
from branchbox.storage.overlay import OPAQUE, is_opaque


def _layer_xattr(name: str) -> bool:
    """Overlay's own attributes but ``opaque`` stay behind: origin and impure refer to
    the layer a file came from."""
    return name == OPAQUE or not name.startswith("trusted.overlay.")


def apply_layer(src_fd: int, dst_fd: int) -> None:
    """Apply the overlay layer directory open at ``src_fd`` onto the layer directory open
    at ``dst_fd``. Iterative and fd-relative: a sandbox's tree deeper than a Python
    stack or than PATH_MAX costs no more fds than a flat one (``copyfs.Cursor``), and
    no symlink is followed."""
    src, dst = Cursor.pair(src_fd, dst_fd)
    try:
        frames = [listing(src.fd)]  # each: a merged directory's entries still to apply
        while frames:
            todo = frames[-1]
            if not todo:
                frames.pop()
                if frames:  # the layers' roots keep the bottom one's metadata
                    dir_metadata(src.fd, dst.fd, _layer_xattr)
                    src.up()
                    dst.up()
                continue
            name, st = todo.pop()
            if not stat.S_ISDIR(st.st_mode):  # replaces whatever the path was
                remove_entry(dst.fd, name)
                copy_entry(src.fd, dst.fd, name, st, _layer_xattr)
            elif is_opaque(f"/proc/self/fd/{src.fd}/{name}") or not _is_dir(dst.fd, name):
                _replace_dir(src.fd, dst.fd, name)
            else:  # merged: its entries apply one by one, then its metadata
                descend(src, dst, name)
                frames.append(listing(src.fd))
    finally:
        src.close()
        dst.close()


def _replace_dir(src_parent: int, dst_parent: int, name: str) -> None:
    """Directory ``name`` of ``dst_parent`` becomes a copy of ``src_parent``'s."""
    remove_entry(dst_parent, name)
    os.mkdir(name, 0o700, dir_fd=dst_parent)
    sub = os.open(name, DIR_FLAGS, dir_fd=src_parent)
    try:
        dsub = os.open(name, DIR_FLAGS, dir_fd=dst_parent)
        try:
            copy_tree(sub, dsub, _layer_xattr)
        finally:
            os.close(dsub)
    finally:
        os.close(sub)


def _is_dir(parent: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def squash(backend, volumes: list[Path], dst: Path) -> None:
    """Make volume ``dst`` equal to the overlay of ``volumes`` (top first; each has upper/,
    and ws/upper when the sandbox has a workspace)."""
    backend.snapshot(volumes[-1], dst, readonly=False)
    try:
        for volume in reversed(volumes[:-1]):
            for layer in ("upper", "ws/upper"):  # the root, and a workspace if there is one
                if (volume / layer).is_dir():
                    src_fd = os.open(volume / layer, DIR_FLAGS)
                    try:
                        dst_fd = os.open(dst / layer, DIR_FLAGS)
                        try:
                            apply_layer(src_fd, dst_fd)
                        finally:
                            os.close(dst_fd)
                    finally:
                        os.close(src_fd)
    except BaseException:
        backend.delete(dst)
        raise
