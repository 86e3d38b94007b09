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
   final owner, mode and content, and each file is fsynced. The host is not
   touched, so a crash leaves only S, without a journal: ``recover`` deletes
   it and the host is the old version.
3. Journal: the steps go to ``S/journal.json.tmp``, which is fsynced; then S
   is fsynced, so every staged entry and the full journal are on disk before
   the next step. ``rename(journal.json.tmp, journal.json)`` is atomic: after
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
   placed before their children, and every touched host directory is
   fsynced before step 5, so the new version is durable while the journal
   still exists.
5. Cleanup: removed entries (parked in S), then the journal, then S. A crash
   before the journal is gone rolls forward again and finds every step done;
   a crash after it leaves S without a journal, which ``recover`` deletes.
   Either way the host is entirely the new version.

Fault injection: with ``BRANCHBOX_COMMIT_FAULT=<point>`` in the environment
the process SIGKILLs itself at that point (see ``FAULT_POINTS`` and
``apply_fault_points``), so tests kill the commit path exactly there.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from branchbox.storage import journal
from branchbox.storage.journal import FAULT_ENV, FAULT_POINTS, Step, recover
from branchbox.storage.overlay import is_opaque, is_whiteout

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
    upper layer that provides a creation (None for deletes); ``mode`` its
    permission bits. A "dir" op merges with a host directory already there;
    a directory that *replaces* the host's entry comes as "delete" + "dir".
    A "file" or "symlink" replaces whatever the host has at ``path``.
    """

    kind: str
    path: str
    source: str | None = None
    mode: int = 0


@dataclass(frozen=True)
class Changes:
    """Ordered operations: every deletion first, then creations, parents before children."""

    ops: tuple[Op, ...]

    @property
    def deletions(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.kind == "delete")

    @property
    def creations(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.kind != "delete")


class CommitResult(NamedTuple):
    """What a commit changed in the host: relative paths, and bytes of file content written."""

    changed: list[str]
    bytes: int


def _listing(directory: str) -> dict[str, os.stat_result]:
    with os.scandir(directory) as entries:
        return {e.name: e.stat(follow_symlinks=False) for e in entries}


def changes(layers: list[Path]) -> Changes:
    """The delta upper ``layers`` (top first) make over the host dir below them, by overlay rules.

    A directory is listed by merging the layers that still contribute to it:
    its topmost entry decides, a whiteout or non-directory below stops the
    stack, and so does an opaque directory after itself. If nothing stops
    it, the host's directory shows through (a merging "dir" op); otherwise
    the host's entry is hidden and is deleted before the "dir" is created.
    """
    tops = [os.fspath(layer) for layer in layers]
    if any(is_opaque(top) for top in tops):
        raise ValueError("an opaque layer root would hide the whole host directory")
    deletions: list[Op] = []
    creations: list[Op] = []
    # (directory relative path, contributing layer roots top first, host entry hidden)
    pending: list[tuple[str, list[str], bool]] = [("", tops, False)]
    while pending:
        rel, stack, hidden = pending.pop()
        listings = [_listing(f"{top}/{rel}" if rel else top) for top in stack]
        for name in sorted({name for listing in listings for name in listing}):
            path = f"{rel}/{name}" if rel else name
            depth = next(i for i, listing in enumerate(listings) if name in listing)
            st, source = listings[depth][name], f"{stack[depth]}/{path}"
            if is_whiteout(st):
                if not hidden:
                    deletions.append(Op("delete", path))
            elif stat.S_ISDIR(st.st_mode):
                below, hides = [stack[depth]], is_opaque(source)
                for top, listing in zip(stack[depth + 1 :], listings[depth + 1 :], strict=True):
                    if hides:
                        break
                    lower = listing.get(name)
                    if lower is None:
                        continue
                    if not stat.S_ISDIR(lower.st_mode):
                        hides = True  # a lower whiteout or non-directory ends the merge
                        break
                    below.append(top)
                    hides = is_opaque(f"{top}/{path}")
                if hides and not hidden:
                    deletions.append(Op("delete", path))
                creations.append(Op("dir", path, source, stat.S_IMODE(st.st_mode)))
                pending.append((path, below, hidden or hides))
            elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                kind = "file" if stat.S_ISREG(st.st_mode) else "symlink"
                creations.append(Op(kind, path, source, stat.S_IMODE(st.st_mode)))
            else:
                raise ValueError(f"{source}: cannot commit a device, fifo or socket")
    deletions.sort(key=lambda op: op.path.split("/"))
    creations.sort(key=lambda op: op.path.split("/"))
    return Changes(tuple(deletions + creations))


class _Plan(NamedTuple):
    steps: list[Step]  # removes, then places, then chmods
    staged: dict[str, Op]  # staging name -> op providing it
    conflicts: list[str]


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _changed_below(root: str, rel: str, since: float) -> list[str]:
    """Entries under host directory ``root`` (``rel`` to the workspace) changed after ``since``."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            if os.lstat(full).st_ctime > since:
                found.append(f"{rel}/{os.path.relpath(full, root)}")
    return found


def _plan(delta: Changes, host: str, since: float) -> _Plan:
    """Resolve ``delta`` against the host as it is now: what to remove, place and chmod.

    Ops are visited parent first, and a path whose parent is gone (or will
    be) is known absent without a look, so no ``lstat`` ever goes through a
    host symlink that the delta replaces.
    """
    host_dev = os.lstat(host).st_dev
    removes: list[Step] = []
    places: list[Step] = []
    chmods: list[Step] = []
    staged: dict[str, Op] = {}
    conflicts: list[str] = []
    gone: set[str] = set()  # paths absent from the host once the removes are done
    for op in sorted(delta.ops, key=lambda op: (op.path.split("/"), op.kind != "delete")):
        target = f"{host}/{op.path}"
        absent = op.path in gone or os.path.dirname(op.path) in gone
        st = None if absent else _lstat(target)
        if st is not None:
            if st.st_dev != host_dev:
                raise OSError(f"{target} is on another filesystem than {host}; cannot commit")
            if op.kind == "dir" and stat.S_ISDIR(st.st_mode):
                if stat.S_IMODE(st.st_mode) != op.mode:
                    conflicts += [op.path] if st.st_ctime > since else []
                    chmods.append(Step("chmod", op.path, op.mode))
                continue  # an existing directory merges: its entries are ops of their own
            conflicts += [op.path] if st.st_ctime > since else []
            # A file or symlink is renamed over a non-directory atomically; anything else goes.
            if op.kind != "file" and op.kind != "symlink" or stat.S_ISDIR(st.st_mode):
                if stat.S_ISDIR(st.st_mode):
                    conflicts += _changed_below(target, op.path, since)
                removes.append(Step("remove", op.path, st.st_ino))
        if op.kind == "delete" or op.kind == "dir":
            gone.add(op.path)  # a directory is placed empty: its entries are ops of their own
        if op.kind != "delete":
            name = f"o{len(staged)}"
            staged[name] = op
            places.append(Step("place", op.path, name))
    return _Plan(removes + places + chmods, staged, conflicts)


def apply_fault_points(layers: list[Path], host_dir: Path) -> tuple[str, ...]:
    """The "apply:<i>" fault points a commit of ``layers`` into ``host_dir`` passes, in order."""
    plan = _plan(changes(layers), os.path.abspath(host_dir), float("inf"))
    return tuple(f"apply:{i}" for i in range(1, len(plan.steps) + 1))


def commit(
    layers: list[Path],
    host_dir: Path,
    *,
    since: float,
    uid_shift: int = 1_000_000,
    staging_parent: Path | None = None,
) -> CommitResult:
    """Make ``host_dir`` show what the overlay of ``layers`` over it shows, all or nothing.

    ``since`` is when the sandbox started (``time.time()``): a path the
    commit would touch whose ``st_ctime`` is later was changed from outside,
    and the commit raises :class:`WorkspaceConflict` without touching
    anything. Owners are shifted back from the sandbox's id range (ids at or
    above ``uid_shift`` lose it; lower ids were copied up from the host and
    are kept). The layers must not change during the call. If the process
    dies, or an error is raised after the commit point, the next
    :func:`recover` finishes the job.
    """
    journal.check_fault_env()
    host = os.path.abspath(host_dir)
    plan = _plan(changes(layers), host, since)
    if plan.conflicts:
        raise WorkspaceConflict(sorted(set(plan.conflicts)))
    if not plan.steps:
        return CommitResult([], 0)
    written = journal.run(host, plan.steps, plan.staged, uid_shift, staging_parent)
    return CommitResult(list(dict.fromkeys(step.path for step in plan.steps)), written)
