"""Staging, journal, idempotent apply and recovery for workspace commits.

:mod:`branchbox.storage.workspace_commit` decides *what* a commit does and
explains why the sequence here is crash-atomic; this module carries it out:
stage entries into a private directory next to the host directory, write the
journal (its rename is the commit point), apply steps that each know whether
they already happened, clean up. ``recover`` finishes or discards whatever a
dead process left behind.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import stat
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from branchbox.agent import sysc
from branchbox.storage.beneath import open_beneath, parent_beneath
from branchbox.storage.copyfs import clone_or_copy

if TYPE_CHECKING:
    from branchbox.storage.workspace_commit import Op

FAULT_ENV = "BRANCHBOX_COMMIT_FAULT"
# In the order a commit passes them; "apply:<i>" points come between
# "journal-synced" and "applied", one after each applied step.
FAULT_POINTS = (
    "stage-created",
    "staged",
    "journal-written",
    "journal-renamed",
    "journal-synced",
    "applied",
    "trash-removed",
    "journal-removed",
)
JOURNAL = "journal.json"
_JOURNAL_TMP = JOURNAL + ".tmp"


class Step(NamedTuple):
    """One journaled action on ``path`` (relative to the host dir).

    ``action`` is "remove" (``arg``: the inode number the entry had when
    planned), "place" (``arg``: the staged entry's name) or "chmod"
    (``arg``: the mode).
    """

    action: str
    path: str
    arg: int | str


def check_fault_env() -> None:
    """Refuse a misspelt fault point, which would otherwise make a crash test pass vacuously."""
    point = os.environ.get(FAULT_ENV)
    if point and point not in FAULT_POINTS and not re.fullmatch(r"apply:[1-9][0-9]*", point):
        raise ValueError(f"{FAULT_ENV}={point!r} is not a fault point")


def _crash_at(point: str) -> None:
    """Die as abruptly as a power cut would (no cleanup, no finally) if told to die here."""
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def _staging_prefix(host: str) -> str:
    """Staging dirs are named for their host dir, with a digest of its full path.

    The digest keeps ``recover`` from taking another directory's staging for
    its own when two host dirs of the same name share a staging parent.
    """
    digest = hashlib.sha256(os.fsencode(host)).hexdigest()[:8]
    return f".{os.path.basename(host)}.branchbox-commit-{digest}-"


def _mount_id(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as info:
        for line in info:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.ENOTSUP, "no mnt_id in /proc/self/fdinfo")


class Staged(NamedTuple):
    """What to create in the staging dir for ``op``: its host owner and mode, decided by
    the plan (never taken from the sandbox's entry)."""

    op: Op
    uid: int
    gid: int
    mode: int


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_regular(root: int, path: str) -> tuple[int, os.stat_result]:
    """A read fd of regular file ``path`` below layer fd ``root``, and its stat.

    Looked at first through an ``O_PATH`` fd, so a FIFO or device put there
    is never opened (opening one can block or act); the read fd must then be
    the very inode looked at.
    """
    probe = open_beneath(root, path, os.O_PATH)
    try:
        seen = os.fstat(probe)
    finally:
        os.close(probe)
    if not stat.S_ISREG(seen.st_mode):
        raise OSError(errno.EINVAL, "no longer a regular file in the layer", path)
    fd = open_beneath(root, path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino):
        os.close(fd)
        raise OSError(errno.EINVAL, "replaced while being opened in the layer", path)
    return fd, st


def _readlink(root: int, path: str) -> str:
    """The target of symlink ``path`` below ``root``, read from its parent's fd."""
    parent, name = parent_beneath(root, path)
    try:
        if not stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            raise OSError(errno.EINVAL, "no longer a symlink in the layer", path)
        return os.readlink(name, dir_fd=parent)
    finally:
        os.close(parent)


def _stage(item: Staged, name: str, stage_fd: int, layers: list[int]) -> int:
    """Create ``item`` as ``name`` in the staging dir with its host owner and mode.

    The source is read below its layer's fd without following any symlink;
    only a regular file's content is copied. Returns the bytes copied.
    """
    op = item.op
    root = layers[op.layer]
    if op.kind == "symlink":
        os.symlink(_readlink(root, op.path), name, dir_fd=stage_fd)
        os.chown(name, item.uid, item.gid, dir_fd=stage_fd, follow_symlinks=False)
        return 0
    if op.kind == "dir":
        os.mkdir(name, 0o700, dir_fd=stage_fd)
        fd = os.open(name, _DIR, dir_fd=stage_fd)
        try:
            os.fchown(fd, item.uid, item.gid)
            os.fchmod(fd, item.mode)  # after chown; the plan has stripped setid bits
        finally:
            os.close(fd)
        return 0
    src, st = _open_regular(root, op.path)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=stage_fd)
        try:
            # Holes stay holes: a sandbox's 1 TiB sparse file (0 blocks under its disk
            # limit) was written out in full onto the host's disk.
            clone_or_copy(src, fd, st.st_size)
            os.fchown(fd, item.uid, item.gid)
            os.fchmod(fd, item.mode)  # after chown; the plan has stripped setid bits
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))  # make & co. go by mtime
        finally:
            os.close(fd)
    finally:
        os.close(src)
    return st.st_size


def _write_journal(stage_fd: int, host: str, steps: list[Step]) -> None:
    """Make the journal durable under its final name; the rename is the commit point.

    Everything staged and the journal's content are made durable by one ``syncfs``
    of the staging filesystem before the rename, not by an fsync per file (which
    cost ~20 s for 23,000 files: each fsync is a journal commit and a disk flush).
    """
    fd = os.open(_JOURNAL_TMP, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600, dir_fd=stage_fd)
    with os.fdopen(fd, "w") as out:
        json.dump({"version": 1, "host": host, "steps": steps}, out)
    sysc.syncfs(stage_fd)  # staged entries and the journal's content before the name
    _crash_at("journal-written")
    os.rename(_JOURNAL_TMP, JOURNAL, src_dir_fd=stage_fd, dst_dir_fd=stage_fd)
    _crash_at("journal-renamed")
    os.fsync(stage_fd)
    _crash_at("journal-synced")


def _lexists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _finish(stage_fd: int, host_fd: int, steps: list[Step]) -> None:
    """Apply ``steps`` (again, if a crash interrupted them), make it durable, empty the stage.

    Safe to run any number of times after the journal is in place: a remove
    only takes the inode it planned for, a place only moves what is still
    staged, a chmod sets the same mode. The applied steps are made durable by one
    ``syncfs`` of the host directory's filesystem (the staging directory's too: they
    share a mount), not an fsync per touched directory. Every host path is resolved below
    ``host_fd`` without following a symlink: the host dir may hold symlinks
    a sandbox committed, and none of them may lead a rename or chmod out.
    The caller removes the (then empty) staging dir itself.
    """
    for i, (action, path, arg) in enumerate(steps, 1):
        if action == "remove":
            try:
                parent, name = parent_beneath(host_fd, path)
            except FileNotFoundError:
                parent = -1
            if parent >= 0:
                try:
                    try:
                        inode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_ino
                    except FileNotFoundError:
                        inode = None
                    if inode == arg:  # parked; deleted once all is durable
                        os.rename(name, f"t{i}", src_dir_fd=parent, dst_dir_fd=stage_fd)
                finally:
                    os.close(parent)
        elif action == "place":
            if _lexists_at(stage_fd, str(arg)):
                parent, name = parent_beneath(host_fd, path)
                try:
                    os.replace(str(arg), name, src_dir_fd=stage_fd, dst_dir_fd=parent)
                finally:
                    os.close(parent)
        else:
            fd = open_beneath(host_fd, path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fchmod(fd, int(arg))  # planned on a real directory
            finally:
                os.close(fd)
        _crash_at(f"apply:{i}")
    sysc.syncfs(host_fd)
    _crash_at("applied")
    for name in os.listdir(stage_fd):
        if name != JOURNAL:
            _remove_at(stage_fd, name)
    _crash_at("trash-removed")
    os.unlink(JOURNAL, dir_fd=stage_fd)
    _crash_at("journal-removed")


def _remove_at(dir_fd: int, name: str) -> None:
    if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


def run(
    host: str,
    host_fd: int,
    steps: list[Step],
    staged: dict[str, Staged],
    layers: list[int],
    staging_parent: Path | None,
) -> int:
    """Stage, journal and apply ``steps`` on ``host`` (open as ``host_fd``); return bytes written.

    ``layers`` are the fds of the layer directories the staged ops name. The
    staging dir is flock'ed for the whole commit so that a concurrent
    ``recover`` leaves it alone. Before the commit point any error removes
    it (the host was not touched); after, it stays for ``recover``.
    """
    parent = os.fspath(staging_parent) if staging_parent is not None else os.path.dirname(host)
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        name = _staging_prefix(host) + os.urandom(8).hex()
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        stage_fd = os.open(name, _DIR, dir_fd=parent_fd)
        committed = False
        try:
            fcntl.flock(stage_fd, fcntl.LOCK_EX)
            if _mount_id(host_fd) != _mount_id(stage_fd):
                raise OSError(
                    errno.EXDEV,
                    f"staging dir is not on the mount of {host}: moves would not be renames "
                    "(pass staging_parent= on the same mount)",
                    os.path.join(parent, name),
                )
            _crash_at("stage-created")
            written = sum(_stage(item, sname, stage_fd, layers) for sname, item in staged.items())
            _crash_at("staged")
            _write_journal(stage_fd, host, steps)
            committed = True
            _finish(stage_fd, host_fd, steps)
            os.rmdir(name, dir_fd=parent_fd)
            return written
        except BaseException:
            if not committed:
                shutil.rmtree(name, dir_fd=parent_fd, ignore_errors=True)
            raise
        finally:
            os.close(stage_fd)
    finally:
        os.close(parent_fd)


def recover(host_dir: Path, *, staging_parent: Path | None = None) -> str:
    """Finish or discard every commit into ``host_dir`` that a dead process left behind.

    A staging dir with a journal is rolled forward ("rolled-forward"), one
    without is deleted ("rolled-back"); with none, "clean". Afterwards the
    host dir is entirely the old or the new version and no staging dir of
    a dead commit remains; one whose commit is still running (it holds the
    flock) is left alone. Pass the ``staging_parent`` the commit was given.
    """
    host = os.path.abspath(host_dir)
    parent = os.fspath(staging_parent) if staging_parent is not None else os.path.dirname(host)
    pattern = re.compile(re.escape(_staging_prefix(host)) + "[0-9a-f]{16}")
    outcome = "clean"
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in sorted(os.listdir(parent_fd)):
            if not pattern.fullmatch(name):
                continue
            stage_fd = os.open(name, _DIR, dir_fd=parent_fd)
            try:
                try:
                    fcntl.flock(stage_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                try:
                    record = os.open(JOURNAL, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                     dir_fd=stage_fd)
                except FileNotFoundError:
                    shutil.rmtree(name, dir_fd=parent_fd)
                    outcome = "rolled-back" if outcome == "clean" else outcome
                    continue
                with os.fdopen(record) as journal:
                    steps = [Step(*step) for step in json.load(journal)["steps"]]
                host_fd = os.open(host, _DIR)
                try:
                    _finish(stage_fd, host_fd, steps)
                finally:
                    os.close(host_fd)
                os.rmdir(name, dir_fd=parent_fd)
                outcome = "rolled-forward"
            finally:
                os.close(stage_fd)
    finally:
        os.close(parent_fd)
    return outcome
