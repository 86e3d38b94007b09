"""Snapshots (engine.snapshots): a sandbox's instant kept beyond the sandbox, for new
sandboxes to start from; E2B's face of them is in test_e2b_compat."""

from __future__ import annotations

import os
import time

import pytest

from branchbox import Conflict, InvalidRequest, Sandbox, SandboxNotFound
from branchbox.engine import errors
from branchbox.sdk._portal import portal


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_snapshot_keeps_its_family_until_the_last_member_goes(harness, make) -> None:
    """The family (its launcher, namespaces and id slot) lives while its snapshot or a
    sandbox started from it does; sandboxes started from a snapshot are roots of that
    family, apart from each other, and outlive the snapshot's deletion."""
    engine = harness.engine
    sb = make()
    sb.run_code("import os; x = [1]; os.environ['FOO'] = 'snap'; os.chdir('/tmp')")
    sb.files.write("/root/f.txt", b"one")
    cp = portal.run(engine.snapshot(sb.id, "test-family-snap"))
    sb.run_code("x.append(2)")
    launcher = engine.get(sb.id).family.family.pid
    sb.close()
    assert not _gone(launcher, 0.5), "the snapshot's family ended with its sandbox"
    assert [s.snapshot for s in engine.snapshots()] == ["test-family-snap"]

    made = [portal.run(engine.start_from_snapshot("test-family-snap", env={"N": str(i)}))
            for i in range(2)]
    a, b = (Sandbox.connect(m.id, transport=harness.transport()) for m in made)
    try:
        a.run_code("x.append('a')")
        a.files.write("/root/f.txt", b"a's")
        state = "(x, os.environ['FOO'], os.environ['N'], os.getcwd())"
        assert a.run_code(state).text == "([1, 'a'], 'snap', '0', '/tmp')"
        assert b.run_code(state).text == "([1], 'snap', '1', '/tmp')"
        assert b.files.read("/root/f.txt") == b"one"
        assert a.info()["parent_id"] is None and a.info()["family"] == cp.record.family
        assert a.ip != b.ip
        portal.run(engine.delete_snapshot("test-family-snap"))
        assert engine.snapshots() == [] and not _gone(launcher, 0.5)
        with pytest.raises(errors.SandboxNotFound):
            portal.run(engine.start_from_snapshot("test-family-snap"))
        assert a.run_code("len(x)").text == "2"
        a.close()
        assert not _gone(launcher, 0.5)
    finally:
        b.close()
        a.close()
    assert _gone(launcher), "the family outlived its last member"


def test_a_snapshot_of_a_branch_outlives_its_merge(harness, make) -> None:
    engine = harness.engine
    parent = make()
    parent.run_code("x = 'parent'")
    child = parent.fork(1)[0]
    child.run_code("x = 'branch'")
    portal.run(engine.snapshot(child.id, "test-merged-snap"))
    parent.merge_into(child)  # the branch's id ends
    try:
        started = portal.run(engine.start_from_snapshot("test-merged-snap"))
        with Sandbox.connect(started.id, transport=harness.transport()) as sb:
            assert sb.run_code("x").text == "'branch'"
    finally:
        portal.run(engine.delete_snapshot("test-merged-snap"))


def test_names_limits_and_refusals(harness, make, workspace) -> None:
    """Snapshot names are image names, apart from every image's; a snapshot under a
    snapshot's name replaces it; past the server's number a new name is refused; a
    sandbox with a workspace is refused (what started from it would commit there)."""
    engine = harness.engine
    sb = make()
    with pytest.raises(errors.InvalidRequest):
        portal.run(engine.snapshot(sb.id, "Not A Name"))
    with pytest.raises(errors.Conflict, match="reserved"):
        portal.run(engine.snapshot(sb.id, "default"))
    with pytest.raises(errors.InvalidRequest, match="Podflare"):  # spaces are made, not named
        portal.run(engine.snapshot(sb.id, "space-mine"))
    sb.save_image("test-snap-image")
    try:
        with pytest.raises(errors.Conflict, match="exists"):
            portal.run(engine.snapshot(sb.id, "test-snap-image"))
    finally:
        portal.run(engine.remove_image("test-snap-image"))
    first = portal.run(engine.snapshot(sb.id, "test-names-snap"))
    with pytest.raises(Conflict, match="snapshot"):
        sb.save_image("test-names-snap")
    sb.run_code("y = 2")
    second = portal.run(engine.snapshot(sb.id, "test-names-snap"))
    assert [s.id for s in engine.snapshots()] == [second.id]
    assert first.id not in {cp.id for cp in engine._checkpoints.values()}
    assert sb.checkpoints() == []  # a snapshot is no checkpoint of its sandbox
    config = engine.config
    limit, config.max_snapshots = config.max_snapshots, 1
    try:
        with pytest.raises(errors.ResourceLimit, match="BRANCHBOX_MAX_SNAPSHOTS"):
            portal.run(engine.snapshot(sb.id, "test-names-other"))
        portal.run(engine.snapshot(sb.id, "test-names-snap"))  # a replacement still goes
    finally:
        config.max_snapshots = limit
        portal.run(engine.delete_snapshot("test-names-snap"))
    with pytest.raises(errors.SandboxNotFound):
        portal.run(engine.delete_snapshot("test-names-snap"))
    branch = make(workspace=str(workspace))
    with pytest.raises(errors.Conflict, match="workspace"):
        portal.run(engine.snapshot(branch.id))


def test_the_sdk_and_rest_faces(harness, make) -> None:
    """``snapshot()``, ``Sandbox(snapshot=...)``, ``list_snapshots``, ``delete_snapshot``;
    what a snapshot fixes cannot be asked for at a create from it."""
    transport = harness.transport
    sb = make()
    sb.run_code("import os; v = 'kept'; os.chdir('/srv')")
    info = sb.snapshot("test-sdk-snap")
    assert (info["name"], info["sandbox_id"], info["image"]) == ("test-sdk-snap", sb.id,
                                                                 "default")
    assert sb.snapshot()["name"].startswith("snapshot-")
    listed = Sandbox.list_snapshots(transport=transport())
    assert [s["name"] for s in listed][0] == "test-sdk-snap" and len(listed) == 2
    with Sandbox(snapshot="test-sdk-snap", env={"ADDED": "1"}, timeout=60,
                 transport=transport()) as started:
        assert started.run_code("(v, os.getcwd(), os.environ['ADDED'])").text == \
            "('kept', '/srv', '1')"
        assert started.info()["parent_id"] is None
    for fixed in ({"memory_mb": 64}, {"cwd": "/tmp"}, {"image": "python"}):
        with pytest.raises(InvalidRequest, match="snapshot's"):
            Sandbox(snapshot="test-sdk-snap", transport=transport(), **fixed)
    with pytest.raises(SandboxNotFound):
        Sandbox(snapshot="no-such-snap", transport=transport())
    for name in (f"../sandboxes/{sb.id}", ".."):  # one path segment: never another route
        with pytest.raises((SandboxNotFound, InvalidRequest)):
            Sandbox.delete_snapshot(name, transport=transport())
    assert sb.run_code("1").text == "1"
    for s in listed:
        Sandbox.delete_snapshot(s["name"], transport=transport())
    assert Sandbox.list_snapshots(transport=transport()) == []
    with pytest.raises(SandboxNotFound):
        Sandbox.delete_snapshot("test-sdk-snap", transport=transport())


def test_what_users_met(harness, make) -> None:
    """Found by using them: a paused sandbox is snapshotted (and stays paused); a start
    without a network policy keeps the snapshot's sandbox's; an empty name is refused;
    a missing snapshot says how to list them; the snapshot's info shows what it maps;
    a create of an image that is none is refused before the warm pool keeps a pool of
    it."""
    transport = harness.transport
    sb = make(internet=True)
    sb.run_code("import numpy; a = numpy.ones(40 << 17)")  # 40 MiB
    sb.pause()
    info = sb.snapshot("test-paused-snap")
    assert sb.info()["state"] == "paused"
    assert info["resources"]["mapped_bytes"] > 40 << 20
    try:
        with Sandbox(snapshot="test-paused-snap", transport=transport()) as started:
            assert started.info()["network"]["internet"] is True
            assert started.run_code("int(a.sum())").text == str(40 << 17)
        with Sandbox(snapshot="test-paused-snap", internet=False,
                     transport=transport()) as started:
            assert started.info()["network"]["internet"] is False
    finally:
        Sandbox.delete_snapshot("test-paused-snap", transport=transport())
    sb.resume()
    with pytest.raises(InvalidRequest):
        sb.snapshot("")
    with pytest.raises(SandboxNotFound, match="list_snapshots"):
        Sandbox(snapshot="test-never-made", transport=transport())
    with pytest.raises(InvalidRequest, match="unknown image"):
        Sandbox("test-no-such-image", transport=transport())
    assert "test-no-such-image" not in harness.engine._warm
