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
FICLONE = 0x40049409  # _IOW(0x94, 9, int): share the source's extents (btrfs, XFS)


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


def _unshift(xid: int, shift: int) -> int:
    """Ids the sandbox wrote are shifted by ``shift``; lower ones are host ids from copy-up."""
    return xid - shift if xid >= shift else xid


def _copy(src: int, dst: int, size: int) -> None:
    """Reflink when the filesystem can (O(1)), else an in-kernel copy."""
    try:
        fcntl.ioctl(dst, FICLONE, src)
        return
    except OSError:
        pass
    offset = 0
    while offset < size:
        sent = os.sendfile(dst, src, offset, size - offset)
        if sent == 0:
            break
        offset += sent


def _stage(op: Op, dst: str, shift: int) -> int:
    """Recreate ``op``'s source at ``dst`` with host ownership; return the file bytes copied."""
    assert op.source is not None
    st = os.lstat(op.source)
    uid, gid = _unshift(st.st_uid, shift), _unshift(st.st_gid, shift)
    if op.kind == "symlink":
        os.symlink(os.readlink(op.source), dst)
        os.lchown(dst, uid, gid)
        return 0
    if op.kind == "dir":
        os.mkdir(dst, 0o700)
        os.chown(dst, uid, gid)
        os.chmod(dst, stat.S_IMODE(st.st_mode))  # after chown, which clears setgid
        return 0
    src = os.open(op.source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _copy(src, fd, st.st_size)
            os.fchown(fd, uid, gid)
            os.fchmod(fd, stat.S_IMODE(st.st_mode))  # after chown, which clears setuid
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))  # make & co. go by mtime
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        os.close(src)
    return st.st_size


def _write_journal(stage: str, stage_fd: int, host: str, steps: list[Step]) -> None:
    """Make the journal durable under its final name; the rename is the commit point."""
    tmp = f"{stage}/{_JOURNAL_TMP}"
    with open(tmp, "w") as out:
        json.dump({"version": 1, "host": host, "steps": steps}, out)
        out.flush()
        os.fsync(out.fileno())
    os.fsync(stage_fd)  # staged entries and the journal's content before the name
    _crash_at("journal-written")
    os.rename(tmp, f"{stage}/{JOURNAL}")
    _crash_at("journal-renamed")
    os.fsync(stage_fd)
    _crash_at("journal-synced")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _finish(stage: str, host: str, steps: list[Step]) -> None:
    """Apply ``steps`` (again, if a crash interrupted them), make it durable, remove ``stage``.

    Safe to run any number of times after the journal is in place: a remove
    only takes the inode it planned for, a place only moves what is still
    staged, a chmod sets the same mode.
    """
    touched: dict[str, None] = {}
    for i, (action, path, arg) in enumerate(steps, 1):
        target = f"{host}/{path}"
        if action == "remove":
            try:
                inode = os.lstat(target).st_ino
            except FileNotFoundError:
                inode = None
            if inode == arg:
                os.rename(target, f"{stage}/t{i}")  # parked; deleted once all is durable
            touched[os.path.dirname(target)] = None
        elif action == "place":
            staged = f"{stage}/{arg}"
            if os.path.lexists(staged):
                os.replace(staged, target)
            touched[os.path.dirname(target)] = None
        else:
            os.chmod(target, int(arg))  # planned on a real directory
            touched[target] = None
        _crash_at(f"apply:{i}")
    for directory in touched:
        _fsync_dir(directory)
    _crash_at("applied")
    for name in os.listdir(stage):
        if name != JOURNAL:
            _remove(f"{stage}/{name}")
    _crash_at("trash-removed")
    os.unlink(f"{stage}/{JOURNAL}")
    _crash_at("journal-removed")
    os.rmdir(stage)


def run(
    host: str,
    steps: list[Step],
    staged: dict[str, Op],
    uid_shift: int,
    staging_parent: Path | None,
) -> int:
    """Stage, journal and apply ``steps`` on ``host``; return the file bytes written.

    The staging dir is flock'ed for the whole commit so that a concurrent
    ``recover`` leaves it alone. Before the commit point any error removes
    it (the host was not touched); after, it stays for ``recover``.
    """
    parent = os.fspath(staging_parent) if staging_parent is not None else os.path.dirname(host)
    stage = os.path.join(parent, _staging_prefix(host) + os.urandom(8).hex())
    os.mkdir(stage, 0o700)
    stage_fd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    committed = False
    try:
        fcntl.flock(stage_fd, fcntl.LOCK_EX)
        host_fd = os.open(host, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if _mount_id(host_fd) != _mount_id(stage_fd):
                raise OSError(
                    errno.EXDEV,
                    f"staging dir is not on the mount of {host}: moves would not be renames "
                    "(pass staging_parent= on the same mount)",
                    stage,
                )
        finally:
            os.close(host_fd)
        _crash_at("stage-created")
        written = sum(_stage(op, f"{stage}/{name}", uid_shift) for name, op in staged.items())
        _crash_at("staged")
        _write_journal(stage, stage_fd, host, steps)
        committed = True
        _finish(stage, host, steps)
        return written
    except BaseException:
        if not committed:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    finally:
        os.close(stage_fd)


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
    for name in sorted(os.listdir(parent)):
        if not pattern.fullmatch(name):
            continue
        stage = os.path.join(parent, name)
        stage_fd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(stage_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            try:
                with open(f"{stage}/{JOURNAL}") as record:
                    steps = [Step(*step) for step in json.load(record)["steps"]]
            except FileNotFoundError:
                shutil.rmtree(stage)
                outcome = "rolled-back" if outcome == "clean" else outcome
                continue
            _finish(stage, host, steps)
            outcome = "rolled-forward"
        finally:
            os.close(stage_fd)
    return outcome
