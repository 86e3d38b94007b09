"""Each family runs in a host id range of its own (issue 9, part 2: shared per-user budgets).

Per-user kernel budgets are counted per host uid. Before, every sandbox of every
family was host uid 1,000,000, so one family holding a thousand pipes shrank every
other family's new pipe buffers to 8 KiB. Now a family gets a slot of its own
(engine.idranges), its fork children share it, and the image (stored in slot 0)
and workspaces appear in it through id-mapped mounts. Real engines, both
backends; the last tests drive the allocator itself on a real SQLite file and
real lock files.
"""

from __future__ import annotations

import ast
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from branchbox.engine.config import EngineConfig
from branchbox.engine.idranges import IdRanges
from branchbox.engine.records import Records
from branchbox.engine.sandboxes import Engine
from branchbox.sdk._portal import portal
from branchbox.storage.idmap import SLOTS, UID_BASE, UID_COUNT, clashing_slots, slot_base

F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)


def host_ids(harness, sb, path: str) -> tuple[int, int]:
    st = harness.host_path(sb, path).lstat()
    return st.st_uid, st.st_gid


def family_base(harness, sb) -> int:
    return harness.engine.get(sb.id).body.layers.ids.base


def inside_ids(sb, path: str) -> str:
    r = sb.exec(f"stat -c '%u %g' {path}")
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


def test_two_families_get_disjoint_host_ranges(harness, make) -> None:
    a, b = make(), make()
    for sb in (a, b):
        sb.exec("echo x > /root/mine.txt")
        assert inside_ids(sb, "/root/mine.txt") == "0 0"
    (ua, ga), (ub, gb) = (host_ids(harness, sb, "/root/mine.txt") for sb in (a, b))
    assert (ua, ga) == (family_base(harness, a),) * 2
    assert (ub, gb) == (family_base(harness, b),) * 2
    assert abs(ua - ub) >= UID_COUNT  # whole ranges apart, not just different roots
    for uid in (ua, ub):  # never the images' storage range, never past the last slot
        assert UID_BASE + UID_COUNT <= uid < UID_BASE + SLOTS * UID_COUNT
        assert (uid - UID_BASE) % UID_COUNT == 0


def test_image_files_are_root_inside_and_copy_up_lands_in_the_family_range(harness,
                                                                         sandbox) -> None:
    assert sandbox.exec("id -u; id -g").stdout.split() == ["0", "0"]
    listing = sandbox.exec("ls -lnL /usr/bin/python3").stdout.split()
    assert listing[2:4] == ["0", "0"], listing
    assert inside_ids(sandbox, "/etc/passwd") == "0 0"
    assert inside_ids(sandbox, "/usr/bin/python3") == "0 0"
    assert sandbox.exec("touch /etc/passwd && echo ok").stdout.strip() == "ok"
    # chmod copies an image file up into the sandbox's layer, where it must take the
    # family's ids (the lower is id-mapped), not the images' storage range
    assert sandbox.exec("chmod 600 /etc/hostname && echo ok").stdout.strip() == "ok"
    assert inside_ids(sandbox, "/etc/hostname") == "0 0"
    base = family_base(harness, sandbox)
    assert base >= UID_BASE + UID_COUNT
    assert host_ids(harness, sandbox, "/etc/hostname") == (base, base)
    assert host_ids(harness, sandbox, "/etc/passwd") == (base, base)
    # a system user's file keeps its id inside (shifted, not squashed onto root)
    sandbox.exec("install -d -o 33 -g 33 /root/www && touch /root/www/f && chown 33:33 /root/www/f")
    assert inside_ids(sandbox, "/root/www/f") == "33 33"
    assert host_ids(harness, sandbox, "/root/www/f") == (base + 33, base + 33)


def test_fork_children_share_their_familys_range(harness, make) -> None:
    parent = make()
    parent.exec("echo p > /root/p.txt")
    base = family_base(harness, parent)
    assert base >= UID_BASE + UID_COUNT
    children = parent.fork(2)
    try:
        for i, child in enumerate(children):
            assert family_base(harness, child) == base
            child.exec(f"echo {i} > /root/c{i}.txt")
            assert host_ids(harness, child, f"/root/c{i}.txt") == (base, base)
            assert inside_ids(child, f"/root/c{i}.txt") == "0 0"
            assert inside_ids(child, "/root/p.txt") == "0 0"  # the parent's, frozen
            assert inside_ids(child, "/usr/bin/python3") == "0 0"
            assert child.exec("id -u").stdout.strip() == "0"
        # a grandchild too, and merging it back keeps the family's ids
        (grand,) = children[0].fork(1)
        grand.exec("echo g > /root/g.txt")
        assert host_ids(harness, grand, "/root/g.txt") == (base, base)
        parent.merge_into(grand)
        assert parent.files.read("/root/g.txt") == b"g\n"
        assert inside_ids(parent, "/root/g.txt") == "0 0"
        assert host_ids(harness, parent, "/root/g.txt") == (base, base)
        assert family_base(harness, parent) == base
    finally:
        for child in children:
            child.close()


PIPE_CODE = """
import fcntl, os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 2 * {n} + 256), hard))
held = [os.pipe() for _ in range({n})]
(fcntl.fcntl(held[0][0], {get}), fcntl.fcntl(held[-1][0], {get}))
"""


def test_a_family_holding_many_pipes_leaves_other_families_full_buffers(harness,
                                                                        make) -> None:
    soft = int(Path("/proc/sys/fs/pipe-user-pages-soft").read_text())
    if soft == 0:
        pytest.skip("pipe-user-pages-soft is off on this host: no per-user pipe budget")
    full = 65536  # a new pipe's default buffer (16 pages) while its user is under budget
    n = soft // (full // 4096) + 80  # past the soft budget: ~1100 pipes by default
    hog, other = make(), make()
    sizes = hog.run_code(PIPE_CODE.format(n=n, get=F_GETPIPE_SZ)).text
    first, last = ast.literal_eval(sizes)
    assert first == full
    assert last < full  # the hog's own budget is spent: its new pipes are shrunk
    # another family's new pipe still gets the full default buffer
    r = other.run_code(f"import fcntl, os; r, w = os.pipe(); fcntl.fcntl(r, {F_GETPIPE_SZ})")
    assert int(r.text) == full
    # ...and so does a command of it (a process the REPL does not own)
    r = other.exec("python3 -c 'import fcntl, os; print(fcntl.fcntl(os.pipe()[0], "
                   f"{F_GETPIPE_SZ}))'")
    assert int(r.stdout) == full
    hog.run_code("for r, w in held: os.close(r); os.close(w)\ndel held")


def test_workspace_host_owners_appear_in_the_familys_range(harness, make) -> None:
    host = Path(tempfile.mkdtemp(prefix="bb-uids-ws-"))
    try:
        (host / "theirs.txt").write_text("host\n")
        os.chown(host / "theirs.txt", 1000, 1000)
        a, b = make(workspace=str(host)), make(workspace=str(host))
        for sb in (a, b):
            base = family_base(harness, sb)
            assert inside_ids(sb, f"{host}/theirs.txt") == "1000 1000"
            assert inside_ids(sb, str(host)) == "0 0"
            sb.exec(f"echo mine > {host}/mine.txt")
            assert inside_ids(sb, f"{host}/mine.txt") == "0 0"
            upper = harness.engine.get(sb.id).body.layers.volume / "ws" / "upper"
            st = (upper / "mine.txt").lstat()
            assert (st.st_uid, st.st_gid) == (base, base)
        assert family_base(harness, a) != family_base(harness, b)
        done = a.commit()
        assert "mine.txt" in done["changed"]
        st = (host / "mine.txt").lstat()
        assert (st.st_uid, st.st_gid) == (0, 0)  # the workspace directory's owner
    finally:
        shutil.rmtree(host, ignore_errors=True)


def test_a_slot_is_free_again_only_when_its_family_and_layers_are_gone(harness,
                                                                       make) -> None:
    engine = harness.engine
    parent = make()
    slot = engine.get(parent.id).body.layers.ids.slot
    (child,) = parent.fork(1)  # stacked on a frozen layer of the parent's files
    parent.close()
    # The parent is gone, but its frozen layer (files of the range) lives under the child.
    assert slot in engine.ids.taken
    assert engine.records.slots().get(slot) == parent.id
    others = [make() for _ in range(3)]
    assert slot not in {engine.get(o.id).body.layers.ids.slot for o in others}
    # No warm sandbox is being started (it could take the slot as soon as it is free).
    portal.run(engine.settle())
    child.close()
    assert slot not in engine.ids.taken
    assert slot not in engine.records.slots()
    # It is handed out again: lowest free first, so allocating until it comes back
    # meets only lower slots on the way (on the engine's loop, as a spawn would).
    async def allocate_until_reused() -> list[int]:
        probes = []
        try:
            while not probes or probes[-1].slot != slot:
                probes.append(engine.ids.allocate("sbx_probe"))
            return [p.slot for p in probes]
        finally:
            for probe in probes:
                probe.drop()

    got = portal.run(allocate_until_reused())
    assert got[-1] == slot and all(s < slot for s in got[:-1])
    assert slot not in engine.ids.taken


@pytest.mark.parametrize("backend", ["copy"])
def test_restart_frees_slots_only_after_the_store_is_clean(backend: str) -> None:
    data = Path(tempfile.mkdtemp(prefix="branchbox-test-uids-"))
    config = EngineConfig(data_dir=data, storage=backend, warm_pool=0)
    engine = Engine(config)
    portal.run(engine.start())
    try:
        sb = portal.run(engine.create())
        slot = sb.body.layers.ids.slot
        # and the image's template its own (engine.templates)
        [template] = [s for s, family in engine.records.slots().items()
                      if family == "template:default"]
        assert engine.records.slots() == {slot: sb.record.family, template: "template:default"}
    finally:
        portal.run(engine.stop())
    # A clean stop lets go of every slot.
    records = Records(data / "sandboxes.db")
    assert records.slots() == {}
    # What a daemon that died would leave: a slot recorded for a family whose files are
    # still in a layer of the store.
    leftover = engine.layers.root / "w-leftover"
    (leftover / "upper").mkdir(parents=True)
    os.chown(leftover / "upper", slot_base(slot), slot_base(slot))
    records.take_slot(slot, "sbx_" + "0" * 32)
    records.close()
    engine = Engine(config)
    portal.run(engine.start())
    try:
        assert not leftover.exists()  # the store was cleaned first...
        assert engine.records.slots() == {}  # ...then the slot freed
        sb = portal.run(engine.create())
        assert sb.body.layers.ids.slot >= 1
    finally:
        portal.run(engine.stop())
        shutil.rmtree(data, ignore_errors=True)


def test_recorded_slots_stay_taken_until_recovered(tmp_path: Path) -> None:
    """The allocator itself, on a real database and real lock files: a slot recorded by an
    earlier daemon is never handed out before recover(); one whose family survived stays
    taken after it; a slot another daemon holds (its lock) is skipped."""
    records = Records(tmp_path / "a.db")
    records.take_slot(1, "sbx_dead")
    records.take_slot(2, "sbx_alive")
    ranges = IdRanges(records, lock_dir=tmp_path / "locks", claims=[])
    first = ranges.allocate("sbx_new")
    assert first.slot == 3
    ranges.recover({"sbx_alive"})
    assert records.slots() == {2: "sbx_alive", 3: "sbx_new"}
    again = ranges.allocate("sbx_newer")
    assert again.slot == 1
    # another daemon (another data directory) on the same host: its own database, the
    # same lock directory; it never gets a slot this one holds
    other_records = Records(tmp_path / "b.db")
    other = IdRanges(other_records, lock_dir=tmp_path / "locks", claims=[])
    theirs = other.allocate("sbx_theirs")
    assert theirs.slot == 4  # 1 and 3 (held here) and 2 (held after recover) are skipped
    first.drop()
    assert 3 not in records.slots()
    assert other.allocate("sbx_more").slot == 3
    for r in (ranges, other):
        r.close()
    records.close()
    other_records.close()


def test_slots_clashing_with_host_ids_are_skipped(tmp_path: Path) -> None:
    # a subordinate range of /etc/subuid straddling slots 2 and 3, and a user in slot 5
    claims = [(slot_base(2) + 100, UID_COUNT), (slot_base(5) + 7, 1)]
    assert clashing_slots(claims) == {2, 3, 5}
    assert clashing_slots([(100000, 65536), (0, 60000)]) == set()
    records = Records(tmp_path / "c.db")
    ranges = IdRanges(records, lock_dir=tmp_path / "locks", claims=claims)
    got = [ranges.allocate(f"sbx_{i}").slot for i in range(3)]
    assert got == [1, 4, 6]
    assert slot_base(SLOTS - 1) + UID_COUNT - 1 < 2**31 - 1
    ranges.close()
    records.close()
