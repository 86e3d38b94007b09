"""Diff two sandboxes from their overlay layers, in time proportional to what changed.

A sandbox's root is a stack of layer directories (top first); two relatives
share the bottom of their stacks (the frozen layer of their common fork, the
image). Only the layers that are *not* shared can hold a difference, so only
those are walked; each path found there is then resolved through both
stacks with overlayfs' rules:

- a whiteout (character device 0:0) hides the path in every lower layer;
- an opaque directory (xattr trusted.overlay.opaque = "y") hides the lower
  layers' entries below it;
- a non-directory hides everything below its path in lower layers.

A whiteout or opaque directory in an unshared layer can hide a whole subtree
of a shared layer, so that subtree is listed too: it is what was removed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

from branchbox.storage.overlay import is_opaque, is_whiteout


def resolve(layers: list[Path], rel: str) -> tuple[str, os.stat_result] | None:
    """The host path and lstat of sandbox path ``rel`` ("a/b", no leading /), or None."""
    parts = rel.split("/")
    for layer in layers:
        base = str(layer)
        hidden_below = False
        for depth in range(1, len(parts)):
            ancestor = base + "/" + "/".join(parts[:depth])
            try:
                st = os.lstat(ancestor)
            except FileNotFoundError:
                break
            if not stat.S_ISDIR(st.st_mode):
                return None  # a whiteout or a file replaces a directory on our path
            if is_opaque(ancestor):
                hidden_below = True
        path = base + "/" + rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if hidden_below:
                return None
            continue
        return None if is_whiteout(st) else (path, st)
    return None


def _walk(root: str) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry below ``root`` as (path relative to root, lstat); root itself excluded."""
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            entries = list(os.scandir(root + "/" + rel if rel else root))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            sub = f"{rel}/{entry.name}" if rel else entry.name
            st = entry.stat(follow_symlinks=False)
            yield sub, st
            if stat.S_ISDIR(st.st_mode):
                stack.append(sub)


def _join(prefix: str, sub: str) -> str:
    return f"{prefix}/{sub}" if prefix else sub


def _view_files(layers: list[Path], prefix: str) -> set[str]:
    """All non-directory paths visible under ``prefix`` in the merged view of ``layers``."""
    found: set[str] = set()
    for layer in layers:
        top = f"{layer}/{prefix}"
        for sub, st in _walk(top):
            if not stat.S_ISDIR(st.st_mode):
                found.add(_join(prefix, sub))
    return {p for p in found if (r := resolve(layers, p)) and not stat.S_ISDIR(r[1].st_mode)}


def _replaces(layer: Path, prefix: str) -> bool:
    """Whether ``layer`` hides what lies below it at ``prefix``: a whiteout, a file or an
    opaque directory at the prefix or at one of its ancestors."""
    parts = [p for p in prefix.split("/") if p]
    for depth in range(1, len(parts) + 1):
        path = f"{layer}/{'/'.join(parts[:depth])}"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode) or is_opaque(path):
            return True
    return False


def _candidates(unshared: list[Path], others: list[list[Path]], prefix: str) -> set[str]:
    """Paths under ``prefix`` that an unshared layer may have changed."""
    found: set[str] = set()
    for layer in unshared:
        if _replaces(layer, prefix):  # e.g. `rm -rf /tmp`: the prefix itself went
            for stack in others:
                found |= _view_files(stack, prefix)
        top = f"{layer}/{prefix}"
        for sub, st in _walk(top):
            rel = _join(prefix, sub)
            if stat.S_ISDIR(st.st_mode):
                if is_opaque(f"{top}/{sub}"):
                    found.add(rel)  # it may replace a file of the same name
                    for stack in others:
                        found |= _view_files(stack, rel)
            else:
                found.add(rel)
                for stack in others:  # a whiteout or file may hide a whole directory
                    found |= _view_files(stack, rel)
    return found


def _same_content(a: tuple[str, os.stat_result], b: tuple[str, os.stat_result]) -> bool:
    (pa, sa), (pb, sb) = a, b
    if pa == pb:
        return True
    if stat.S_IFMT(sa.st_mode) != stat.S_IFMT(sb.st_mode):
        return False
    if stat.S_ISLNK(sa.st_mode):
        return os.readlink(pa) == os.readlink(pb)
    if sa.st_size != sb.st_size or stat.S_IMODE(sa.st_mode) != stat.S_IMODE(sb.st_mode):
        return False
    with open(pa, "rb") as fa, open(pb, "rb") as fb:
        while True:
            ca, cb = fa.read(1 << 20), fb.read(1 << 20)
            if ca != cb:
                return False
            if not ca:
                return True


def diff_layers(mine: list[Path], other: list[Path], paths: list[str]) -> dict[str, list[str]]:
    """Files added (in ``other`` only), removed (in ``mine`` only), modified, under ``paths``."""
    shared = 0
    while shared < min(len(mine), len(other)) and mine[-1 - shared] == other[-1 - shared]:
        shared += 1
    unshared = mine[: len(mine) - shared] + other[: len(other) - shared]
    candidates: set[str] = set()
    for prefix in paths:
        rel = prefix.strip("/")
        candidates |= _candidates(unshared, [mine, other], rel)
    result: dict[str, list[str]] = {"added": [], "removed": [], "modified": []}
    for rel in sorted(candidates):
        a, b = resolve(mine, rel), resolve(other, rel)
        a = None if a and stat.S_ISDIR(a[1].st_mode) else a
        b = None if b and stat.S_ISDIR(b[1].st_mode) else b
        if a is None and b is not None:
            result["added"].append("/" + rel)
        elif a is not None and b is None:
            result["removed"].append("/" + rel)
        elif a is not None and b is not None and not _same_content(a, b):
            result["modified"].append("/" + rel)
    return result
