"""A workspace's delta, and committing it into the host directory all-or-nothing.

A workspace is an overlay whose lowest layer is the live host directory and
whose upper layers (top first) live in branchbox's store. ``changes`` reads
only those upper layers, so its cost is what they hold, never the host tree.
``commit`` resolves that delta against the host (one ``lstat`` per path the
delta names, plus a walk of each host subtree it deletes), refuses on
conflicts, and hands the resulting steps to :mod:`journal`, which makes them
crash-atomic.

The crash-atomicity argument, step by step (S is the staging directory, on
the same mount as the host directory so that every move is a ``rename``):

1. Plan and conflict check only read. A crash here changes nothing.
2. Stage: every new file, symlink and directory is written into S with its
   final owner, mode and content. The host is not touched, so a crash leaves
   only S, without a journal: ``recover`` deletes it and the host is the old
   version.
3. Journal: the steps go to ``S/journal.json.tmp``; then one ``syncfs`` of
   S's filesystem puts every staged entry and the full journal on disk before
   the next step (one flush for the whole commit: an fsync per staged file
   kept a 23,000-file commit 20 s from its commit point).
   ``rename(journal.json.tmp, journal.json)`` is atomic: after
   a crash ``journal.json`` is absent (old version, nothing in the host was
   touched yet) or complete with everything it names. This rename is the
   commit point; S is fsynced again to make it durable.
4. Apply: each step is one ``rename`` or ``chmod`` and can tell whether it
   already happened, so the whole list can be re-run from the top after a
   crash (roll forward) without undoing anything:

   - *remove P* moves P into S only if P still has the inode number the plan
     recorded. Every entry the commit puts in place was created in S while
     the old entries were alive, and live inodes of one filesystem never
     share a number, so a re-run never takes a new entry for an old one.
   - *place P* renames ``S/oN`` onto P only if ``S/oN`` still exists; the
     rename is atomic, so the entry is in exactly one of the two places.
   - *chmod P* is idempotent by itself.

   Removes all run before places (deletes before creates), parents are
   placed before their children, and the host's filesystem is synced
   (``syncfs``) before step 5, so the new version is durable while the journal
   still exists.
5. Cleanup: removed entries (parked in S), then the journal, then S. A crash
   before the journal is gone rolls forward again and finds every step done;
   a crash after it leaves S without a journal, which ``recover`` deletes.
   Either way the host is entirely the new version.

The sandbox is hostile, and the daemon is host root. What keeps a commit
from handing it the host:

- *Nothing follows a symlink.* The layers are read and the host directory
  and S are written only through directory fds, every path resolved with
  :func:`branchbox.storage.beneath.open_beneath` (no symlink in any
  component, never above the starting directory, never into another mount),
  and file content is copied from the fd opened that way. The engine hands
  in a read-only snapshot of the sandbox's layer (or the sandbox frozen), so
  what is read is one instant; the no-follow resolution is what makes even a
  tree that changes under the reader unable to point it at a host file.
- *Only regular files, directories and symlinks are created.* A FIFO,
  socket or device node in the delta is refused (left as the host has it)
  and reported in ``CommitResult.refused``; setuid and setgid bits are
  stripped from what is created (reported in ``CommitResult.stripped``);
  an existing host directory keeps setid bits it already had, never gains
  one. Extended attributes (file capabilities, ACLs) are not copied.
- *The sandbox never chooses a host owner.* An entry that replaces an
  existing host entry takes that entry's owner; a new one takes the owner
  of the workspace directory. The ids the sandbox gave its files are
  ignored.

Fault injection: with ``BRANCHBOX_COMMIT_FAULT=<point>`` in the environment
the process SIGKILLs itself at that point (see ``FAULT_POINTS`` and
``apply_fault_points``), so tests kill the commit path exactly there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from branchbox.storage import journal
from branchbox.storage.beneath import (
    getxattr_beneath,
    lstat_beneath,
    open_beneath,
    readlink_beneath,
)
from branchbox.storage.journal import FAULT_ENV, FAULT_POINTS, Staged, Step, recover
from branchbox.storage.overlay import OPAQUE, is_whiteout

__all__ = [
    "FAULT_ENV",
    "FAULT_POINTS",
    "Changes",
    "CommitResult",
    "Op",
    "WorkspaceConflict",
    "apply_fault_points",
    "changes",
    "commit",
    "recover",
]

SETID = stat.S_ISUID | stat.S_ISGID
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class WorkspaceConflict(RuntimeError):
    """Paths the commit would touch were changed in the host after the sandbox started."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        shown = ", ".join(paths[:20]) + (f" and {len(paths) - 20} more" if len(paths) > 20 else "")
        super().__init__(
            f"{len(paths)} path(s) in the workspace changed on the host since the sandbox "
            f"started; commit would overwrite them: {shown}"
        )


class Op(NamedTuple):
    """One step of a delta: ``kind`` is "delete", "file", "symlink" or "dir".

    ``path`` is relative to the workspace root; ``source`` is the entry in the
    upper layer that provides a creation (None for deletes), for messages
    only: it is read as ``path`` below layer number ``layer``'s fd, never by
    this string; ``mode`` its permission bits as the sandbox set them. A
    "dir" op merges with a host directory already there; a directory that
    *replaces* the host's entry comes as "delete" + "dir". A "file" or
    "symlink" replaces whatever the host has at ``path``.
    """

    kind: str
    path: str
    source: str | None = None
    mode: int = 0
    layer: int = 0


class Refused(NamedTuple):
    """An entry of the delta that commit will not create on the host, and what it is."""

    path: str
    kind: str  # "fifo", "socket", "char device", "block device" or "unknown"


class Stripped(NamedTuple):
    """An entry committed without permission bits the sandbox gave it (setuid/setgid)."""

    path: str
    bits: int  # the bits removed, e.g. stat.S_ISUID


@dataclass(frozen=True)
class Changes:
    """Ordered operations: every deletion first, then creations, parents before children.

    ``refused`` lists special files (FIFOs, sockets, devices) the delta holds;
    they are not among ``ops``, and the host keeps what it has at their paths.
    """

    ops: tuple[Op, ...]
    refused: tuple[Refused, ...] = ()

    @property
    def deletions(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.kind == "delete")

    @property
    def creations(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.kind != "delete")


class LinkOut(NamedTuple):
    """A symlink committed whose target leaves the workspace (absolute, or up past its
    root): harmless to the daemon, which follows none, but a host tool writing through
    it later writes where it points."""

    path: str
    target: str


class CommitResult(NamedTuple):
    """What a commit changed in the host: relative paths, and bytes of file content written.

    ``stripped``: entries created without setuid/setgid bits the sandbox set;
    ``refused``: special files that were not created (both also reported
    when nothing else changed); ``links_out``: symlinks created that point out of
    the workspace.
    """

    changed: list[str]
    bytes: int
    stripped: list[Stripped] = []
    refused: list[Refused] = []
    links_out: list[LinkOut] = []


def _links_out(host_fd: int, delta: Changes) -> list[LinkOut]:
    """The symlinks the commit created that point out of the workspace, as committed
    (through the tree they are in). After the commit point nothing may fail: a link the
    host changed meanwhile is left out."""
    found = []
    for op in delta.creations:
        if op.kind == "symlink":
            with contextlib.suppress(OSError):
                if leaves(host_fd, op.path, target := readlink_beneath(host_fd, op.path)):
                    found.append(LinkOut(op.path, target))
    return found


LINK_HOPS = 40
"""Symlinks one resolution follows before the kernel gives up (ELOOP), as it does."""


def leaves(host_fd: int, path: str, target: str) -> bool:
    """Whether a symlink at ``path`` (relative to the workspace, open as ``host_fd``) to
    ``target`` points out of the workspace, resolved as the kernel would from there
    through the committed tree: an absolute target, a ``..`` past the root, or a link
    inside that does (links are read, never followed by the daemon; past LINK_HOPS of
    them it counts as leaving). A link through another one (``a/x -> p/..`` with
    ``a/p -> ..``) leaves if where it ends does."""
    where = path.split("/")[:-1]  # the directories from the root to the link
    pending = deque(target.split("/"))
    hops = 0
    if target.startswith("/"):
        return True
    while pending:
        part = pending.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            if not where:
                return True
            where.pop()
            continue
        here = "/".join([*where, part])
        try:
            st = lstat_beneath(host_fd, here)
        except OSError:  # a component that is a file or dangles: the kernel stops there
            st = None
        if st is None or not stat.S_ISLNK(st.st_mode):
            where.append(part)
            continue
        hops += 1
        link = readlink_beneath(host_fd, here)
        if hops > LINK_HOPS or link.startswith("/"):
            return True
        pending.extendleft(reversed(link.split("/")))
    return False


def _special_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        return "char device"
    if stat.S_ISBLK(mode):
        return "block device"
    return "unknown"


@contextmanager
def _opened(paths: list[Path] | list[str]) -> Iterator[list[int]]:
    """Directory fds of ``paths`` (the last component not followed), closed on exit."""
    fds: list[int] = []
    try:
        for path in paths:
            fds.append(os.open(path, _DIR_FLAGS))
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def _listing(root: int, rel: str) -> dict[str, os.stat_result]:
    """Entries of directory ``rel`` below layer fd ``root``, each ``lstat``ed through the fd."""
    fd = open_beneath(root, rel, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with os.scandir(fd) as entries:
            return {e.name: e.stat(follow_symlinks=False) for e in entries}
    finally:
        os.close(fd)


def _is_opaque(root: int, rel: str) -> bool:
    """Whether directory ``rel`` below ``root`` is opaque, read from its own fd."""
    return getxattr_beneath(root, rel, OPAQUE) == b"y"


def changes(layers: list[Path]) -> Changes:
    """The delta upper ``layers`` (top first) make over the host dir below them, by overlay rules.

    A directory is listed by merging the layers that still contribute to it:
    its topmost entry decides, a whiteout or non-directory below stops the
    stack, and so does an opaque directory after itself. If nothing stops
    it, the host's directory shows through (a merging "dir" op); otherwise
    the host's entry is hidden and is deleted before the "dir" is created.
    """
    with _opened(layers) as fds:
        return _changes(fds, [os.fspath(layer) for layer in layers])


def _changes(fds: list[int], names: list[str]) -> Changes:
    """:func:`changes` on layer directory fds; ``names`` only label ``Op.source``."""
    if any(_is_opaque(fd, "") for fd in fds):
        raise ValueError("an opaque layer root would hide the whole host directory")
    deletions: list[Op] = []
    creations: list[Op] = []
    refused: list[Refused] = []
    # (directory relative path, contributing layer numbers top first, host entry hidden)
    pending: list[tuple[str, list[int], bool]] = [("", list(range(len(fds))), False)]
    while pending:
        rel, stack, hidden = pending.pop()
        listings = [_listing(fds[i], rel) for i in stack]
        for name in sorted({name for listing in listings for name in listing}):
            path = f"{rel}/{name}" if rel else name
            depth = next(i for i, listing in enumerate(listings) if name in listing)
            layer = stack[depth]
            st, source = listings[depth][name], f"{names[layer]}/{path}"
            if is_whiteout(st):
                if not hidden:
                    deletions.append(Op("delete", path))
            elif stat.S_ISDIR(st.st_mode):
                below, hides = [layer], _is_opaque(fds[layer], path)
                for lower, listing in zip(stack[depth + 1 :], listings[depth + 1 :], strict=True):
                    if hides:
                        break
                    entry = listing.get(name)
                    if entry is None:
                        continue
                    if not stat.S_ISDIR(entry.st_mode):
                        hides = True  # a lower whiteout or non-directory ends the merge
                        break
                    below.append(lower)
                    hides = _is_opaque(fds[lower], path)
                if hides and not hidden:
                    deletions.append(Op("delete", path))
                creations.append(Op("dir", path, source, stat.S_IMODE(st.st_mode), layer))
                pending.append((path, below, hidden or hides))
            elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                kind = "file" if stat.S_ISREG(st.st_mode) else "symlink"
                creations.append(Op(kind, path, source, stat.S_IMODE(st.st_mode), layer))
            else:
                refused.append(Refused(path, _special_kind(st.st_mode)))
    deletions.sort(key=lambda op: op.path.split("/"))
    creations.sort(key=lambda op: op.path.split("/"))
    refused.sort(key=lambda r: r.path.split("/"))
    return Changes(tuple(deletions + creations), tuple(refused))


class _Plan(NamedTuple):
    steps: list[Step]  # removes, then places, then chmods
    staged: dict[str, Staged]  # staging name -> what to create there
    conflicts: list[str]
    stripped: list[Stripped]


def _changed_below(host: int, rel: str, since: float) -> list[str]:
    """Entries under host directory ``rel`` changed after ``since`` (an fd walk, no symlinks)."""
    found = []
    top = open_beneath(host, rel, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for dirpath, dirnames, filenames, dirfd in os.fwalk(".", dir_fd=top):
            for name in dirnames + filenames:
                if os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_ctime > since:
                    found.append(os.path.normpath(f"{rel}/{dirpath}/{name}"))
    finally:
        os.close(top)
    return found


def _plan(delta: Changes, host: int, since: float) -> _Plan:
    """Resolve ``delta`` against the host (directory fd ``host``) as it is now.

    Says what to remove, place and chmod, with which owner and mode. Ops are
    visited parent first, and a path whose parent is gone (or will be) is
    known absent without a look; every look is an fd-relative ``lstat``
    that follows no symlink, so a host symlink (one an earlier commit put
    there, say) is only ever an entry to replace, never a way through.
    """
    host_st = os.fstat(host)
    owner = (host_st.st_uid, host_st.st_gid)  # what a new entry gets
    removes: list[Step] = []
    places: list[Step] = []
    chmods: list[Step] = []
    staged: dict[str, Staged] = {}
    conflicts: list[str] = []
    stripped: list[Stripped] = []
    gone: set[str] = set()  # paths absent from the host once the removes are done
    replaced: dict[str, tuple[int, int]] = {}  # owner of a host entry a delete takes away
    for op in sorted(delta.ops, key=lambda op: (op.path.split("/"), op.kind != "delete")):
        absent = op.path in gone or os.path.dirname(op.path) in gone
        try:
            st = None if absent else lstat_beneath(host, op.path)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                raise OSError(errno.EXDEV, "below a mount point in the workspace; cannot "
                              "commit", op.path) from None
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            conflicts.append(op.path)  # a parent is no longer a directory on the host
            continue
        mode = op.mode & ~SETID
        if st is not None:
            if st.st_dev != host_st.st_dev:
                raise OSError(errno.EXDEV, "a mount point in the workspace; cannot commit",
                              op.path)
            if op.kind == "dir" and stat.S_ISDIR(st.st_mode):
                mode |= op.mode & st.st_mode & SETID  # keep the host's own setid bits only
                if op.mode & SETID & ~st.st_mode:
                    stripped.append(Stripped(op.path, op.mode & SETID & ~st.st_mode))
                if stat.S_IMODE(st.st_mode) != mode:
                    conflicts += [op.path] if st.st_ctime > since else []
                    chmods.append(Step("chmod", op.path, mode))
                continue  # an existing directory merges: its entries are ops of their own
            conflicts += [op.path] if st.st_ctime > since else []
            replaced[op.path] = (st.st_uid, st.st_gid)
            # A file or symlink is renamed over a non-directory atomically; anything else goes.
            if op.kind != "file" and op.kind != "symlink" or stat.S_ISDIR(st.st_mode):
                if stat.S_ISDIR(st.st_mode):
                    conflicts += _changed_below(host, op.path, since)
                removes.append(Step("remove", op.path, st.st_ino))
        if op.kind == "delete" or op.kind == "dir":
            gone.add(op.path)  # a directory is placed empty: its entries are ops of their own
        if op.kind != "delete":
            if op.kind != "symlink" and op.mode & SETID:
                stripped.append(Stripped(op.path, op.mode & SETID))
            uid, gid = replaced.get(op.path, owner)
            name = f"o{len(staged)}"
            staged[name] = Staged(op, uid, gid, mode)
            places.append(Step("place", op.path, name))
    return _Plan(removes + places + chmods, staged, conflicts, stripped)


def apply_fault_points(layers: list[Path], host_dir: Path) -> tuple[str, ...]:
    """The "apply:<i>" fault points a commit of ``layers`` into ``host_dir`` passes, in order."""
    with _opened(layers) as fds, _opened([os.path.abspath(host_dir)]) as (host,):
        plan = _plan(_changes(fds, [os.fspath(p) for p in layers]), host, float("inf"))
    return tuple(f"apply:{i}" for i in range(1, len(plan.steps) + 1))


def commit(
    layers: list[Path],
    host_dir: Path,
    *,
    since: float,
    staging_parent: Path | None = None,
) -> CommitResult:
    """Make ``host_dir`` show what the overlay of ``layers`` over it shows, all or nothing.

    ``since`` is when the sandbox started (``time.time()``): a path the
    commit would touch whose ``st_ctime`` is later was changed from outside,
    and the commit raises :class:`WorkspaceConflict` without touching
    anything. The layers should not change during the call (pass a
    read-only snapshot): a change can make the commit fail or see a mix of
    instants, but never read or write outside ``layers`` and ``host_dir``.
    If the process dies, or an error is raised after the commit point, the
    next :func:`recover` finishes the job.
    """
    journal.check_fault_env()
    host = os.path.abspath(host_dir)
    with _opened(layers) as fds, _opened([host]) as (host_fd,):
        delta = _changes(fds, [os.fspath(layer) for layer in layers])
        plan = _plan(delta, host_fd, since)
        if plan.conflicts:
            raise WorkspaceConflict(sorted(set(plan.conflicts)))
        refused = list(delta.refused)
        if not plan.steps:
            return CommitResult([], 0, plan.stripped, refused)
        written = journal.run(host, host_fd, plan.steps, plan.staged, fds, staging_parent)
        links_out = _links_out(host_fd, delta)
    changed = list(dict.fromkeys(step.path for step in plan.steps))
    return CommitResult(changed, written, plan.stripped, refused, links_out)
