"""Workspace commit: the delta of hand-built overlay layers, and its crash-atomic commit.

Real files, real whiteouts and opaque xattrs, real SIGKILLs. The expected
result of a commit is what the kernel's own overlayfs shows when the same
layers are mounted over the host dir (read-only), so "by overlay rules" is
checked against the kernel, not against a second copy of our reading.

These tests need root (mknod, trusted.* xattrs, chown, mount); without it
they fail with that message.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from branchbox.agent import sysc
from branchbox.storage.workspace_commit import (
    FAULT_ENV,
    FAULT_POINTS,
    WorkspaceConflict,
    apply_fault_points,
    changes,
    commit,
    recover,
)

SHIFT = 1_000_000
# Points at which the journal is not yet in place: the commit must vanish.
BEFORE_COMMIT_POINT = {"stage-created", "staged", "journal-written"}

CHILD = """
import json, sys
from pathlib import Path
from branchbox.storage.workspace_commit import commit, recover
args = json.loads(sys.argv[1])
if args["recover"]:
    recover(Path(args["host"]))
else:
    commit([Path(p) for p in args["layers"]], Path(args["host"]), since=args["since"])
"""


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("workspace commit tests need root (mknod, trusted.* xattrs, chown, mount)")


def put(path: Path, data: str, mode: int = 0o644, owner: int = SHIFT) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data)
    os.chown(path, owner, owner)
    path.chmod(mode)


def mkdir(path: Path, mode: int = 0o755, owner: int = SHIFT, opaque: bool = False) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, owner, owner)
    path.chmod(mode)
    if opaque:
        os.setxattr(path, "trusted.overlay.opaque", b"y")


def whiteout(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o600, 0)


def link(path: Path, target: str, owner: int = SHIFT) -> None:
    path.symlink_to(target)
    os.lchown(path, owner, owner)


def build_host(host: Path) -> None:
    """A small repository: files, nested dirs, symlinks, an executable, an empty dir."""
    put(host / "README.md", "hello\n", owner=0)
    put(host / "run.sh", "#!/bin/sh\nexit 0\n", 0o755, owner=0)
    put(host / "notes.txt", "notes\n", owner=0)
    put(host / "src/main.py", "print('main')\n", owner=0)
    put(host / "src/util.py", "def util(): ...\n", owner=1000)
    put(host / "src/pkg/__init__.py", "", owner=0)
    put(host / "src/pkg/core.py", "CORE = 1\n", owner=0)
    put(host / "docs/guide.md", "# guide\n", owner=0)
    put(host / "docs/img/logo.png", "PNG", owner=0)
    put(host / "build/out.o", "obj", owner=0)
    put(host / "build/sub/x.o", "x", owner=0)
    put(host / "data.txt", "1,2,3\n", owner=0)
    put(host / "cfg/a.ini", "a=1\n", owner=0)
    put(host / "cfg/b.ini", "b=2\n", owner=0)
    put(host / "perms/keep.txt", "keep\n", owner=0)
    mkdir(host / "perms", 0o755, owner=0)
    mkdir(host / "emptydir", 0o755, owner=0)
    link(host / "link", "README.md", owner=0)
    link(host / "old_link", "src", owner=0)


def build_layers(lower: Path, top: Path) -> None:
    """A frozen layer from a fork (``lower``) under the sandbox's writable layer (``top``)."""
    mkdir(lower, 0o755)
    mkdir(lower / "src")
    put(lower / "src/util.py", "def util(): return 2\n", owner=1000)  # copy-up keeps host ids
    put(lower / "src/new.py", "v1\n")
    mkdir(lower / "docs")
    whiteout(lower / "docs/img")
    put(lower / "docs/guide.md", "# guide v2\n")
    mkdir(lower / "newdir", 0o750)
    put(lower / "tmp.txt", "scratch\n")

    mkdir(top, 0o755)
    mkdir(top / "src")
    put(top / "src/new.py", "v2, longer\n")
    whiteout(top / "src/pkg")  # a removed directory
    whiteout(top / "tmp.txt")  # created by the fork's parent, deleted here: no change
    put(top / "build", "build is a file now\n")  # a directory replaced by a file
    mkdir(top / "data.txt", opaque=True)  # a file replaced by a directory
    put(top / "data.txt/part1", "1,2\n")
    link(top / "link", "run.sh")  # a retargeted symlink
    whiteout(top / "old_link")
    mkdir(top / "cfg", opaque=True)  # a directory emptied and refilled
    put(top / "cfg/c.ini", "c=3\n")
    mkdir(top / "perms", 0o700)  # a mode change only
    put(top / "notes.txt", "notes\n", 0o600)
    put(top / "tool", "#!/bin/sh\necho hi\n", 0o755, owner=SHIFT + 7)
    mkdir(top / "empty2")
    link(top / "sym_new", "src/main.py")
    mkdir(top / "newdir", 0o750)
    put(top / "newdir/inner.txt", "inner\n")
    mkdir(top / "docs")
    put(top / "docs/extra.md", "extra\n")


def manifest(root: Path) -> dict[str, tuple[object, ...]]:
    """Every entry below ``root``: type, mode, content or link target."""
    found: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("symlink", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                found[rel] = ("file", stat.S_IMODE(st.st_mode), Path(path).read_bytes())
    return found


def kernel_view(layers: list[Path], host: Path, where: Path) -> dict[str, tuple[object, ...]]:
    """The manifest of the kernel's overlay of ``layers`` over ``host``."""
    where.mkdir()
    lowerdir = ":".join(str(p) for p in [*layers, host])
    sysc.mount("overlay", str(where), "overlay", sysc.MS_RDONLY, f"lowerdir={lowerdir}")
    try:
        return manifest(where)
    finally:
        sysc.umount2(str(where))


class Scenario(NamedTuple):
    host: Path
    layers: list[Path]
    since: float
    old: dict[str, tuple[object, ...]]
    new: dict[str, tuple[object, ...]]


def make_scenario(tmp_path: Path) -> Scenario:
    require_root()
    tmp_path.mkdir(exist_ok=True)
    host, lower, top = tmp_path / "host", tmp_path / "lower", tmp_path / "top"
    build_host(host)
    build_layers(lower, top)
    since = time.time()
    new = kernel_view([top, lower], host, tmp_path / "view")
    return Scenario(host, [top, lower], since, manifest(host), new)


@pytest.fixture
def scenario(tmp_path: Path) -> Scenario:
    return make_scenario(tmp_path)


def leftovers(host: Path) -> list[str]:
    """Staging dirs or journals a commit into ``host`` could have left."""
    found = [p.name for p in host.parent.iterdir() if ".branchbox-commit-" in p.name]
    return found + [str(p) for p in host.rglob("journal.json*")]


def in_child(sc: Scenario, fault: str | None, *, recovering: bool = False) -> int:
    """Run commit (or recover) in a fresh python, dying at ``fault``; return its status."""
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault is not None:
        env[FAULT_ENV] = fault
    args = {
        "layers": [str(p) for p in sc.layers],
        "host": str(sc.host),
        "since": sc.since,
        "recover": recovering,
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr
    return proc.returncode


def test_changes_orders_deletions_first_and_parents_first(scenario: Scenario) -> None:
    delta = changes(scenario.layers)
    kinds = [op.kind for op in delta.ops]
    assert kinds == sorted(kinds, key=lambda kind: kind != "delete")
    assert {op.path for op in delta.deletions} == {
        "docs/img",
        "src/pkg",
        "tmp.txt",
        "old_link",
        "data.txt",
        "cfg",
    }
    seen: set[str] = set()
    for op in delta.creations:
        parent = os.path.dirname(op.path)
        assert not parent or parent in seen, f"{op.path} comes before its parent"
        seen.add(op.path)
    by_path = {op.path: op for op in delta.creations}
    assert by_path["tool"].kind == "file" and by_path["tool"].mode == 0o755
    assert by_path["link"].kind == "symlink" and by_path["perms"].mode == 0o700
    assert by_path["src/new.py"].source == str(scenario.layers[0] / "src/new.py")
    assert by_path["src/util.py"].source == str(scenario.layers[1] / "src/util.py")
    assert "tmp.txt" not in by_path and "cfg/a.ini" not in by_path


def test_commit_produces_the_kernels_merged_view(scenario: Scenario) -> None:
    result = commit(scenario.layers, scenario.host, since=scenario.since)
    assert manifest(scenario.host) == scenario.new
    assert manifest(scenario.host) != scenario.old
    assert {
        "build",
        "data.txt",
        "data.txt/part1",
        "cfg",
        "perms",
        "tool",
        "docs/img",
        "src/pkg",
        "old_link",
    } <= set(result.changed)
    assert "tmp.txt" not in result.changed and "run.sh" not in result.changed
    assert result.bytes == sum(
        len(entry[2])
        for path, entry in scenario.new.items()
        if path in result.changed and entry[0] == "file"
    )
    # The sandbox never picks a host owner: new entries take the workspace dir's,
    # replacements the replaced entry's.
    assert (scenario.host / "tool").stat().st_uid == 0  # new; the sandbox said SHIFT + 7
    assert (scenario.host / "cfg/c.ini").stat().st_uid == 0
    assert (scenario.host / "src/util.py").stat().st_uid == 1000  # replaced: the host's owner
    assert (result.stripped, result.refused) == ([], [])
    assert leftovers(scenario.host) == []
    assert recover(scenario.host) == "clean"


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_sigkill_at_each_named_point_recovers_to_old_or_new(scenario: Scenario, point: str) -> None:
    assert in_child(scenario, point) == -signal.SIGKILL
    outcome = recover(scenario.host)
    if point in BEFORE_COMMIT_POINT:
        assert (outcome, manifest(scenario.host)) == ("rolled-back", scenario.old)
    else:
        expected = "rolled-back" if point == "journal-removed" else "rolled-forward"
        assert (outcome, manifest(scenario.host)) == (expected, scenario.new)
    assert leftovers(scenario.host) == []


def test_sigkill_after_every_applied_step_rolls_forward(tmp_path: Path) -> None:
    probe = make_scenario(tmp_path / "probe")
    points = apply_fault_points(probe.layers, probe.host)
    assert len(points) >= 20
    for i, point in enumerate(points):
        sc = make_scenario(tmp_path / str(i))
        assert in_child(sc, point) == -signal.SIGKILL, point
        assert (recover(sc.host), manifest(sc.host)) == ("rolled-forward", sc.new), point
        assert leftovers(sc.host) == [], point


def test_recovery_killed_midway_is_recovered_again(scenario: Scenario) -> None:
    assert in_child(scenario, "journal-synced") == -signal.SIGKILL
    assert in_child(scenario, "apply:3", recovering=True) == -signal.SIGKILL
    assert recover(scenario.host) == "rolled-forward"
    assert manifest(scenario.host) == scenario.new
    assert leftovers(scenario.host) == []


def test_host_change_after_start_is_a_conflict_and_nothing_is_touched(scenario: Scenario) -> None:
    time.sleep(0.05)  # past the coarse clock tick that stamps ctime
    (scenario.host / "src/util.py").write_text("edited on the host\n")
    (scenario.host / "docs/img/new.png").write_text("added on the host")
    before = manifest(scenario.host)
    with pytest.raises(WorkspaceConflict) as caught:
        commit(scenario.layers, scenario.host, since=scenario.since)
    assert "src/util.py" in caught.value.paths and "docs/img/new.png" in caught.value.paths
    assert "src/util.py" in str(caught.value)
    assert isinstance(caught.value, RuntimeError)
    assert manifest(scenario.host) == before
    assert leftovers(scenario.host) == []


def test_host_change_outside_the_delta_is_kept(scenario: Scenario) -> None:
    time.sleep(0.05)
    (scenario.host / "run.sh").write_text("#!/bin/sh\nexit 1\n")
    commit(scenario.layers, scenario.host, since=scenario.since)
    assert (scenario.host / "run.sh").read_text() == "#!/bin/sh\nexit 1\n"
    assert (scenario.host / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (scenario.host / "tool").read_text() == "#!/bin/sh\necho hi\n"


def test_nothing_to_commit_touches_nothing(scenario: Scenario, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    mkdir(empty)
    result = commit([empty], scenario.host, since=scenario.since)
    assert (result.changed, result.bytes) == ([], 0)
    assert manifest(scenario.host) == scenario.old
    assert leftovers(scenario.host) == []


def test_staging_on_another_filesystem_is_refused(scenario: Scenario) -> None:
    shm = Path("/dev/shm")
    with pytest.raises(OSError) as caught:
        commit(scenario.layers, scenario.host, since=scenario.since, staging_parent=shm)
    assert caught.value.errno == errno.EXDEV
    assert manifest(scenario.host) == scenario.old
    assert not [p for p in shm.iterdir() if ".branchbox-commit-" in p.name]


def test_misspelt_fault_point_is_refused(
    scenario: Scenario, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_ENV, "journal-writen")
    with pytest.raises(ValueError, match="journal-writen"):
        commit(scenario.layers, scenario.host, since=scenario.since)
    assert manifest(scenario.host) == scenario.old


def test_recover_with_nothing_left_is_clean(scenario: Scenario) -> None:
    assert recover(scenario.host) == "clean"
    assert manifest(scenario.host) == scenario.old
