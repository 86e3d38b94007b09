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

The lowest unshared layers of the two are often nearly the same: a fork's parent
keeps writing to its volume while its children stand on a snapshot of it, and two
forks of one parent stand on two snapshots of it. On btrfs such a pair is not
walked: the kernel's send stream (:mod:`branchbox.storage.send_stream`) names what
differs between them, in time proportional to that (a child of a parent holding
200,000 files was past the diff's budget; now it costs what either changed). The
stream names a changed inode by one of its names: a change to a file with other
names (hard links) makes that pair walked after all.

Bounded, because the layers are written by hostile code: a sandbox can make a
file of 1 EiB apparent size with ``truncate``, a million files, or a FIFO. So

- contents are compared by extent, never by apparent size: holes cost nothing
  (``SEEK_DATA``/``SEEK_HOLE``), and ranges that both files map onto the same
  physical extent of one filesystem (a btrfs snapshot or reflink, FIEMAP) are
  equal without being read; the same inode is equal without a look;
- a diff has a :class:`Budget` of bytes read and of wall time, checked between
  chunks and directory entries; a file that could not be *proven* equal within
  it is reported as modified and also listed under ``"unverified"``. We report
  rather than fail because one oversized file must not deny the diff of every
  other path (a hostile branch could otherwise make itself un-diffable), and
  "modified" is the conservative answer: diff never calls unread bytes equal.
  Listing the paths tree itself has no such fallback: past the deadline the diff
  fails with :class:`DiffTooLarge` (narrow ``paths``);
- FIFOs, sockets and devices are compared by type and device number, never
  opened (opening a FIFO blocks);
- it runs on its own small executor (:func:`diff_bounded`), never the default
  thread pool that lifecycle operations (close, fork's snapshot) use, and is
  cancelled when its caller goes away.

Never outside a layer, because the daemon reads as host root while the sandbox
may be rewriting its live upper layer: every layer directory is opened once,
and every stat, listing, xattr, readlink and open below it resolves from that
fd with :mod:`branchbox.storage.beneath` (``openat2`` without following any
symlink, magic link or mount, never above the layer). A directory swapped for a
symlink to a host path between two steps makes that step fail (ELOOP/ENOTDIR),
and the path is reported modified and unverified; it never reaches a host file,
so the diff's answer cannot tell a sandbox anything about one. Contents are
read only from fds of regular files opened that way (see
:func:`branchbox.storage.beneath.open_regular`: a FIFO or device is never
opened).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import stat
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from branchbox.storage import beneath, btrfs, send_stream
from branchbox.storage.ioctl import ioctl
from branchbox.storage.overlay import OPAQUE, is_whiteout

log = logging.getLogger("branchbox.storage")

# Per diff: bytes of file content read (both sides together) and seconds of wall time,
# counted from the request (time spent queued for a worker counts). Read at each diff,
# so a test or an operator can change them.
READ_BUDGET = 512 << 20
TIME_BUDGET = 10.0
# Diffs in flight at once (running or queued); one more is refused as busy.
MAX_PENDING = 32
_WORKERS = 2
_CHUNK = 1 << 20
_ZEROS = bytes(_CHUNK)


class DiffTooLarge(Exception):
    """The trees to compare could not even be listed within the time budget."""


class DiffCancelled(Exception):
    """The caller went away (or the daemon is stopping): stop at the next check."""


class DiffBusy(Exception):
    """Too many diffs in flight."""


class Budget:
    """What one diff may still spend: bytes to read, and a deadline; and a cancel flag.

    Checked between chunks of at most 1 MiB and between directory entries, so a diff
    stops within one chunk's time of running out or being cancelled.
    """

    def __init__(self, read_bytes: int | None = None, seconds: float | None = None) -> None:
        self.bytes_left = READ_BUDGET if read_bytes is None else read_bytes
        self.deadline = time.monotonic() + (TIME_BUDGET if seconds is None else seconds)
        self.cancelled = threading.Event()
        self.unverified: list[str] = []

    def check(self) -> None:
        if self.cancelled.is_set():
            raise DiffCancelled()

    def expired(self) -> bool:
        self.check()
        return time.monotonic() > self.deadline

    def take(self, n: int) -> bool:
        """Account for reading ``n`` more bytes; False once the budget cannot cover them."""
        if self.expired() or n > self.bytes_left:
            return False
        self.bytes_left -= n
        return True


class _OverBudget(Exception):
    """Internal: this file's comparison ran out of budget."""


# A layer as the diff reads it: a directory fd opened once; every path below it is
# resolved from the fd (see branchbox.storage.beneath), never as a string.
_Found = tuple[int, str, os.stat_result]  # (layer fd, path below it, lstat)
# What goes wrong when a live layer changes under a step: a component that was a
# directory is now a symlink (ELOOP), a file (ENOTDIR), or a mount (EXDEV).
_RACED = (errno.ELOOP, errno.ENOTDIR, errno.EXDEV)


def _lstat(layer: int, rel: str) -> os.stat_result | None:
    """lstat below ``layer``, None if absent; a component that is no directory raises."""
    return beneath.lstat_beneath(layer, rel)


def _is_opaque(layer: int, rel: str) -> bool:
    return beneath.getxattr_beneath(layer, rel, OPAQUE) == b"y"


def resolve(layers: list[int], rel: str) -> _Found | None:
    """Where sandbox path ``rel`` ("a/b", no leading /) is found in ``layers`` (fds, top
    first) by overlay rules, with its lstat; None if absent or hidden."""
    parts = rel.split("/")
    for layer in layers:
        hidden_below = False
        for depth in range(1, len(parts)):
            ancestor = "/".join(parts[:depth])
            st = _lstat(layer, ancestor)
            if st is None:
                break
            if not stat.S_ISDIR(st.st_mode):
                return None  # a whiteout or a file replaces a directory on our path
            if _is_opaque(layer, ancestor):
                hidden_below = True
        st = _lstat(layer, rel)
        if st is None:
            if hidden_below:
                return None
            continue
        return None if is_whiteout(st) else (layer, rel, st)
    return None


def _walk(layer: int, top: str, budget: Budget) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry below directory ``top`` of ``layer`` as (path relative to top, lstat);
    top itself excluded. A directory that is gone or no longer one is skipped."""
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            entries = beneath.list_beneath(layer, _join(top, rel))
        except OSError as exc:
            if exc.errno == errno.ENOENT or exc.errno in _RACED:
                continue
            raise
        for name, st in entries:
            _listing_in_time(budget)
            sub = _join(rel, name)
            yield sub, st
            if stat.S_ISDIR(st.st_mode):
                stack.append(sub)


def _listing_in_time(budget: Budget) -> None:
    """Listing what exists has no fallback past the deadline (unlike comparing)."""
    if budget.expired():
        raise DiffTooLarge(f"listing the layers took longer than the diff's "
                           f"{TIME_BUDGET:g} s budget")


def _join(prefix: str, sub: str) -> str:
    if not prefix:
        return sub
    return f"{prefix}/{sub}" if sub else prefix


def _view_files(layers: list[int], prefix: str, budget: Budget) -> set[str]:
    """All non-directory paths visible under ``prefix`` in the merged view of ``layers``."""
    found: set[str] = set()
    for layer in layers:
        for sub, st in _walk(layer, prefix, budget):
            if not stat.S_ISDIR(st.st_mode):
                found.add(_join(prefix, sub))
    visible = set()
    for path in found:  # resolving each is part of the listing (300,000 took 30 s)
        _listing_in_time(budget)
        try:
            r = resolve(layers, path)
        except OSError as exc:
            if exc.errno not in _RACED:
                raise
            visible.add(path)  # changing under us: a candidate, compared (or not) later
            continue
        if r and not stat.S_ISDIR(r[2].st_mode):
            visible.add(path)
    return visible


def _replaces(layer: int, prefix: str) -> bool:
    """Whether ``layer`` hides what lies below it at ``prefix``: a whiteout, a file or an
    opaque directory at the prefix or at one of its ancestors."""
    parts = [p for p in prefix.split("/") if p]
    for depth in range(1, len(parts) + 1):
        path = "/".join(parts[:depth])
        try:
            st = _lstat(layer, path)
        except OSError as exc:
            if exc.errno not in _RACED:
                raise
            return True  # changing under us: assume the worst (list the lower paths)
        if st is None:
            return False
        if not stat.S_ISDIR(st.st_mode) or _is_opaque(layer, path):
            return True
    return False


def _candidates(unshared: list[int], others: list[list[int]], prefix: str,
                budget: Budget) -> set[str]:
    """Paths under ``prefix`` that an unshared layer may have changed."""
    found: set[str] = set()
    for layer in unshared:
        if _replaces(layer, prefix):  # e.g. `rm -rf /tmp`: the prefix itself went
            for stack in others:
                found |= _view_files(stack, prefix, budget)
        for sub, st in _walk(layer, prefix, budget):
            rel = _join(prefix, sub)
            if stat.S_ISDIR(st.st_mode):
                if _is_opaque(layer, rel):
                    found.add(rel)  # it may replace a file of the same name
                    for stack in others:
                        found |= _view_files(stack, rel, budget)
            else:
                found.add(rel)
                for stack in others:  # a whiteout or file may hide a whole directory
                    found |= _view_files(stack, rel, budget)
    return found


def _sent_changes(mine: Path, other: Path, budget: Budget) -> dict[str, bool] | None:
    """The paths that differ between layers ``mine`` and ``other`` (each the ``upper``
    of a btrfs subvolume), each with whether what lies below it may differ too; None
    unless btrfs knows the two as snapshots of one volume and says what differs, and
    no changed file has another name (then they are walked instead). A live volume is
    snapshotted read-only for it (O(1)), and that snapshot deleted after. Past the
    deadline, DiffTooLarge as for a walk; the kernel's send ends at its next write."""
    volumes = [mine.parent, other.parent]
    if mine.name != "upper" or other.name != "upper":
        return None
    try:
        a, b = (btrfs.subvolume_info(volume) for volume in volumes)
    except OSError:
        return None  # not btrfs, or not a subvolume's root
    if not (a.uuid == b.parent_uuid or b.uuid == a.parent_uuid
            or (a.parent_uuid == b.parent_uuid and any(a.parent_uuid))):
        return None
    made: list[Path] = []
    try:
        readonly = []
        for volume, info in zip(volumes, (a, b), strict=True):
            if not info.readonly:
                made.append(volume.parent / f"d-{secrets.token_hex(8)}")
                btrfs.snapshot(volume, made[-1], readonly=True)
                volume, info = made[-1], btrfs.subvolume_info(made[-1])
            readonly.append((volume, info))
        found: dict[str, bool] = {}
        for change in send_stream.changes(readonly[0][0], readonly[1][1].treeid,
                                          lambda: _listing_in_time(budget)):
            if change.path.startswith(b"upper/"):  # not overlay's work/, a temporary name
                rel = os.fsdecode(change.path[len(b"upper/"):])
                found[rel] = found.get(rel, False) or change.whole
        if _linked_elsewhere([volume / "upper" for volume, _ in readonly], found, budget):
            return None
        return found
    except (OSError, send_stream.StreamError) as exc:
        log.warning("diff: btrfs send of %s against %s: %s; walking them", *volumes, exc)
        return None
    finally:
        for snapshot in made:
            with contextlib.suppress(OSError):
                btrfs.delete_subvolume(snapshot)


def _linked_elsewhere(uppers: list[Path], found: dict[str, bool], budget: Budget) -> bool:
    """Whether a file changed in place (its data, mode or times: named by the stream
    under one of its names only) has more than one name in either layer."""
    fds = [os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
           for upper in uppers]
    try:
        for rel, whole in found.items():
            if whole:
                continue  # moved, made or removed: looked at in full, every name of it
            _listing_in_time(budget)
            for fd in fds:
                try:
                    st = _lstat(fd, rel)
                except OSError as exc:
                    if exc.errno not in _RACED:
                        raise
                    continue
                if st is not None and not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
                    return True
        return False
    finally:
        for fd in fds:
            os.close(fd)


def _changed_under(sent: dict[str, bool], stacks: list[list[int]], prefix: str,
                   budget: Budget) -> set[str]:
    """Candidates under ``prefix`` from what ``_sent_changes`` found: each path, and
    every file below one whose subtree may differ (in either stack's view)."""
    found: set[str] = set()
    for path, whole in sent.items():
        _listing_in_time(budget)
        if not prefix or path == prefix or path.startswith(prefix + "/"):
            found.add(path)
            below = path if whole else None
        else:  # a directory on the prefix's own path moved or went: all of it
            below = prefix if whole and prefix.startswith(path + "/") else None
        if below is not None:
            for stack in stacks:
                found |= _view_files(stack, below, budget)
    return found


# ------------------------------------------------------------------ file contents

_FS_IOC_FIEMAP = 0xC020660B  # _IOWR('f', 11, struct fiemap)
_FIEMAP_FLAG_SYNC = 0x1
_FIEMAP_EXTENT_LAST = 0x1
# Extents whose physical offset does not name the bytes: not yet allocated (delalloc,
# unknown), compressed or encrypted (the offset is the whole encoded extent's), inline
# or tail-packed (no block of their own).
_FIEMAP_UNSAFE = 0x2 | 0x4 | 0x8 | 0x80 | 0x100 | 0x200 | 0x400
_FIEMAP_HEADER = struct.Struct("=QQIIII")
_FIEMAP_EXTENT = struct.Struct("=QQQ16xI12x")
_FIEMAP_BATCH = 256

# One run of a file's address space: (start, end, physical start or None). A hole has
# physical -1; data of unknown (or unprovable) placement has None.
_Run = tuple[int, int, int | None]
_HOLE = -1


def _fiemap_runs(fd: int, size: int, budget: Budget) -> Iterator[_Run]:
    """The file's extents and the holes between them, by FIEMAP, in batches.

    FIEMAP_FLAG_SYNC first writes the file's dirty pages out, so a range rewritten in
    the page cache but not yet on disk is not reported at its old, shared extent.
    """
    pos, flags = 0, _FIEMAP_FLAG_SYNC
    while pos < size:
        budget.check()
        buf = bytearray(_FIEMAP_HEADER.size + _FIEMAP_EXTENT.size * _FIEMAP_BATCH)
        _FIEMAP_HEADER.pack_into(buf, 0, pos, size - pos, flags, 0, _FIEMAP_BATCH, 0)
        ioctl(fd, _FS_IOC_FIEMAP, buf)  # without the GIL: the sync may take a while
        flags = 0
        mapped = _FIEMAP_HEADER.unpack_from(buf, 0)[3]
        if mapped == 0:
            break
        last = False
        for i in range(mapped):
            logical, physical, length, eflags = _FIEMAP_EXTENT.unpack_from(
                buf, _FIEMAP_HEADER.size + i * _FIEMAP_EXTENT.size)
            end = min(logical + length, size)
            if end <= pos:
                continue
            if logical > pos:
                yield pos, logical, _HOLE
            start = max(logical, pos)
            safe = not eflags & _FIEMAP_UNSAFE
            yield start, end, physical + (start - logical) if safe else None
            pos = end
            last = bool(eflags & _FIEMAP_EXTENT_LAST)
        if last:
            break
    if pos < size:
        yield pos, size, _HOLE


def _seek_runs(fd: int, size: int, budget: Budget) -> Iterator[_Run]:
    """Data and holes by SEEK_DATA/SEEK_HOLE (any filesystem; one run if unsupported)."""
    pos = 0
    while pos < size:
        budget.check()
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole from here on
                data = size
            elif exc.errno == errno.EINVAL:  # no SEEK_DATA here: all data
                yield pos, size, None
                return
            else:
                raise
        data = min(data, size)
        if data > pos:
            yield pos, data, _HOLE
        if data >= size:
            return
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), size)
        yield data, hole, None
        pos = hole


def _same_fs(fd_a: int, fd_b: int) -> bool:
    """Both files on one mount, so FIEMAP's physical offsets are in one address space.

    st_dev cannot tell: every btrfs subvolume (each snapshot) has its own."""
    def mount_id(fd: int) -> str | None:
        try:
            with open(f"/proc/self/fdinfo/{fd}") as info:
                for line in info:
                    if line.startswith("mnt_id:"):
                        return line.split()[1]
        except OSError:
            pass
        return None

    a = mount_id(fd_a)
    return a is not None and a == mount_id(fd_b)


def _runs(fd: int, size: int, budget: Budget, fiemap: bool) -> Iterator[_Run]:
    if fiemap:
        try:
            first = _fiemap_runs(fd, size, budget)
            head = next(first, None)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL):
                raise
        else:
            if head is not None:
                yield head
                yield from first
            return
    yield from _seek_runs(fd, size, budget)


def _compare_range(fd_a: int, fd_b: int, start: int, end: int, a_hole: bool, b_hole: bool,
                   budget: Budget) -> bool:
    """Read [start, end) of both (a hole side is known zeros, not read) and compare."""
    pos = start
    while pos < end:
        n = min(_CHUNK, end - pos)
        if not budget.take(n * (int(not a_hole) + int(not b_hole))):
            raise _OverBudget()
        ca = _ZEROS[:n] if a_hole else os.pread(fd_a, n, pos)
        cb = _ZEROS[:n] if b_hole else os.pread(fd_b, n, pos)
        if ca != cb:
            return False
        if len(ca) < n:  # truncated under us: compare what is there, and stop
            return True
        pos += n
    return True


def _same_data(fd_a: int, fd_b: int, size: int, budget: Budget) -> bool:
    """Equal contents of two regular files of ``size`` bytes, read only where needed.

    Sweeps both files' runs together: hole against hole is equal for free, the same
    physical extent on both sides is equal for free, anything else is read.
    """
    fiemap = _same_fs(fd_a, fd_b)
    runs_a, runs_b = _runs(fd_a, size, budget, fiemap), _runs(fd_b, size, budget, fiemap)
    ra, rb = next(runs_a, None), next(runs_b, None)
    pos = 0
    while pos < size and ra is not None and rb is not None:
        end = min(ra[1], rb[1])
        pa, pb = ra[2], rb[2]
        if pa == _HOLE and pb == _HOLE:
            pass
        elif pa is not None and pb is not None and pa != _HOLE and pb != _HOLE \
                and pa + (pos - ra[0]) == pb + (pos - rb[0]):
            pass  # one physical extent under both: the same bytes
        elif not _compare_range(fd_a, fd_b, pos, end, pa == _HOLE, pb == _HOLE, budget):
            return False
        pos = end
        if ra[1] <= pos:
            ra = next(runs_a, None)
        if rb[1] <= pos:
            rb = next(runs_b, None)
    return pos >= size  # a map that ended early (truncated under us) proves nothing


def _same_content(a: _Found, b: _Found, budget: Budget) -> bool:
    """Whether two resolved entries hold the same file, as far as can be proven.

    Raises _OverBudget when the budget ran out before an answer, OSError when an entry
    changed into something unreadable under us."""
    (la, pa, sa), (lb, pb, sb) = a, b
    if (la, pa) == (lb, pb) or (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino):
        return True  # one file: the same layer, or the same inode
    if stat.S_IFMT(sa.st_mode) != stat.S_IFMT(sb.st_mode):
        return False
    if stat.S_IMODE(sa.st_mode) != stat.S_IMODE(sb.st_mode):
        return False
    if stat.S_ISLNK(sa.st_mode):
        return beneath.readlink_beneath(la, pa) == beneath.readlink_beneath(lb, pb)
    if stat.S_ISCHR(sa.st_mode) or stat.S_ISBLK(sa.st_mode):
        return sa.st_rdev == sb.st_rdev
    if not stat.S_ISREG(sa.st_mode):
        return True  # FIFOs and sockets have no content; never open one
    if sa.st_size != sb.st_size:
        return False
    # The layer is live: what is there now may no longer be a regular file (None), or
    # no longer the size we saw; then it is not proven equal.
    opened_a = beneath.open_regular(la, pa)
    if opened_a is None:
        return False
    fd_a, fa = opened_a
    try:
        opened_b = beneath.open_regular(lb, pb)
        if opened_b is None:
            return False
        fd_b, fb = opened_b
        try:
            if fa.st_size != fb.st_size:
                return False
            return _same_data(fd_a, fd_b, fa.st_size, budget)
        finally:
            os.close(fd_b)
    finally:
        os.close(fd_a)


def diff_layers(mine: list[Path], other: list[Path], paths: list[str],
                budget: Budget | None = None) -> dict[str, list[str]]:
    """Files added (in ``other`` only), removed (in ``mine`` only), modified, under ``paths``.

    With a budget (default: :data:`READ_BUDGET` bytes, :data:`TIME_BUDGET` seconds), a
    file whose contents could not be proven equal before it ran out is reported as
    modified *and* listed under ``"unverified"`` (a key present only when not empty).
    Raises DiffTooLarge if the paths could not even be listed in time, DiffCancelled
    once ``budget.cancelled`` is set.
    """
    budget = budget or Budget()
    shared = 0
    while shared < min(len(mine), len(other)) and mine[-1 - shared] == other[-1 - shared]:
        shared += 1
    fds: dict[Path, int] = {}
    try:
        for layer in (*mine, *other):
            if layer not in fds:  # the top of the layer is the daemon's; below it, not
                fds[layer] = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                     | os.O_CLOEXEC)
        return _diff(fds, mine, other, shared, paths, budget)
    finally:
        for fd in fds.values():
            os.close(fd)


def _diff(fds: dict[Path, int], mine_paths: list[Path], other_paths: list[Path], shared: int,
          paths: list[str], budget: Budget) -> dict[str, list[str]]:
    mine, other = [fds[p] for p in mine_paths], [fds[p] for p in other_paths]
    mine_own, other_own = mine[: len(mine) - shared], other[: len(other) - shared]
    sent = None
    if mine_own and other_own:  # the two lowest unshared layers, snapshots of one volume?
        sent = _sent_changes(mine_paths[len(mine_own) - 1], other_paths[len(other_own) - 1],
                             budget)
    walked = mine_own[:-1] + other_own[:-1] if sent is not None else mine_own + other_own
    candidates: set[str] = set()
    for prefix in paths:
        rel = "/".join(part for part in prefix.split("/") if part not in ("", "."))
        candidates |= _candidates(walked, [mine, other], rel, budget)
        if sent is not None:
            candidates |= _changed_under(sent, [mine, other], rel, budget)
    result: dict[str, list[str]] = {"added": [], "removed": [], "modified": []}
    unverified: list[str] = []
    for rel in sorted(candidates):
        budget.check()
        try:
            a, b = resolve(mine, rel), resolve(other, rel)
        except OSError as exc:
            if exc.errno not in _RACED:
                raise
            # A directory on its path became a symlink or a file while we looked: the
            # path is changing, so it is not proven equal; we do not look further.
            result["modified"].append("/" + rel)
            unverified.append("/" + rel)
            continue
        a = None if a and stat.S_ISDIR(a[2].st_mode) else a
        b = None if b and stat.S_ISDIR(b[2].st_mode) else b
        if a is None and b is not None:
            result["added"].append("/" + rel)
        elif a is not None and b is None:
            result["removed"].append("/" + rel)
        elif a is not None and b is not None:
            try:
                same = _same_content(a, b, budget)
            except _OverBudget:
                same = False
                unverified.append("/" + rel)
            except OSError as exc:
                if isinstance(exc, FileNotFoundError):
                    raise  # a layer went away: the caller says so
                same = False  # unreadable (e.g. changed under us): not proven equal
                unverified.append("/" + rel)
            if not same:
                result["modified"].append("/" + rel)
    if unverified:
        result["unverified"] = unverified
    return result


# ------------------------------------------------------------------ where diffs run

# Diffs run here, never on the loop's default executor: that one carries close's and
# fork's blocking steps, and a diff of big files must not make them wait.
_executor = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="bb-diff")
_pending = 0


async def diff_bounded(mine: list[Path], other: list[Path], paths: list[str],
                       budget: Budget | None = None) -> dict[str, list[str]]:
    """:func:`diff_layers` on the diff executor, with ``budget`` or a fresh one whose
    clock starts now (time queued counts); cancelling the caller cancels the diff at its
    next check.

    Raises DiffBusy when :data:`MAX_PENDING` diffs are already in flight.
    """
    global _pending
    if _pending >= MAX_PENDING:
        raise DiffBusy(f"{MAX_PENDING} diffs are already in progress; retry later")
    budget = budget or Budget()
    _pending += 1
    try:
        future = asyncio.get_running_loop().run_in_executor(
            _executor, diff_layers, mine, other, paths, budget)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            budget.cancelled.set()  # the worker stops at its next check
            raise
    finally:
        _pending -= 1
