"""Per-sandbox disk limits (issue 9, part 4): one sandbox cannot fill the store for the others.

Against the real engine on both backends. The btrfs store bounds every writable
volume with a btrfs simple quota: writing past ``disk_mb`` fails with EDQUOT in
that sandbox only, fork children inherit the limit, and a child can write up to
its own limit whatever it shares with its parent. The copy backend has no
kernel mechanism for it and says so: ``disk_mb`` is refused with a 400.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from branchbox import InvalidRequest, ResourceLimit
from branchbox.sdk._portal import portal
from branchbox.storage import backend as storage_backend
from branchbox.storage.backend import BackendUnavailable, QuotaUnsupported, choose_backend

FULL = ("Disk quota exceeded", "No space left on device")


def dd(sb, path: str, mib: int):
    """Write ``mib`` MiB to ``path`` in the sandbox and flush it: the write must reach the
    filesystem (not just the page cache) for the outcome to mean anything."""
    return sb.exec(f"dd if=/dev/zero of={path} bs=1M count={mib} conv=fsync 2>&1")


def refused_on_copy(harness, **kwargs) -> bool:
    """On the copy backend, asking for a disk limit is a clear 400; True if it was."""
    if harness.backend != "copy":
        return False
    with pytest.raises(InvalidRequest, match="copy storage backend cannot enforce disk_mb"):
        harness.sandbox(**kwargs)
    return True


def test_a_full_sandbox_does_not_stop_the_others(make, harness) -> None:
    if refused_on_copy(harness, disk_mb=64):
        return
    small = make(disk_mb=64)
    other = make()
    r = dd(small, "/root/big", 200)
    assert r.exit_code != 0, r.stdout
    assert any(text in r.stdout for text in FULL), r.stdout
    ok = dd(other, "/root/ten", 10)
    assert ok.exit_code == 0, ok.stdout
    # The full sandbox recovers once it frees its own space.
    assert small.exec("rm /root/big && echo gone").stdout == "gone\n"
    assert dd(small, "/root/again", 10).exit_code == 0
    assert harness.engine.info(small.id)["disk_mb"] == 64


def test_the_default_limit_applies_and_is_reported(make, harness) -> None:
    sb = make()
    expected = None if harness.backend == "copy" else harness.engine.config.disk_mb
    assert harness.engine.info(sb.id)["disk_mb"] == expected


def test_metrics_count_what_the_sandbox_wrote_against_its_limit(make, harness) -> None:
    """``Engine.metrics`` (E2B's ``get_metrics``): the bytes the sandbox's own volume holds,
    from its quota group, and its limit; a fork child shares its parent's bytes without
    being charged them. The copy store counts nothing per volume: None of None."""
    sb = make(disk_mb=None if harness.backend == "copy" else 256)
    assert dd(sb, "/root/forty", 40).exit_code == 0
    sample = portal.run(harness.engine.metrics(sb.id))
    if harness.backend == "copy":
        assert (sample.disk_bytes, sample.disk_limit_bytes) == (None, None)
        return
    assert 40 << 20 <= sample.disk_bytes < 48 << 20 and sample.disk_limit_bytes == 256 << 20
    [child] = sb.fork(1)
    try:
        assert portal.run(harness.engine.metrics(child.id)).disk_bytes < 1 << 20
    finally:
        child.close()


def test_fork_children_inherit_the_limit_and_write_up_to_their_own(make, harness) -> None:
    if refused_on_copy(harness, disk_mb=64):
        return
    parent = make(disk_mb=64)
    assert dd(parent, "/root/forty", 40).exit_code == 0
    [child] = parent.fork(1)
    try:
        assert harness.engine.info(child.id)["disk_mb"] == 64
        # 40 MiB shared with the parent: the child still has its own 64 MiB.
        r = dd(child, "/root/sixty", 60)
        assert r.exit_code == 0, r.stdout
        assert child.exec("wc -c < /root/forty").stdout.strip() == str(40 << 20)
        r = dd(child, "/root/more", 100)
        assert r.exit_code != 0 and any(text in r.stdout for text in FULL), r.stdout
        # A grandchild inherits it too.
        [grandchild] = child.fork(1)
        try:
            assert harness.engine.info(grandchild.id)["disk_mb"] == 64
            r = dd(grandchild, "/root/huge", 200)
            assert r.exit_code != 0 and any(text in r.stdout for text in FULL), r.stdout
        finally:
            grandchild.close()
        # Forking does not hide bytes from the parent's limit: the 40 MiB it wrote stay
        # charged to it while its children's layers hold them, deleted or not.
        r = parent.exec("rm /root/forty && " + dd_cmd("/root/refill", 40))
        assert r.exit_code != 0 and any(text in r.stdout for text in FULL), r.stdout
    finally:
        child.close()


def dd_cmd(path: str, mib: int) -> str:
    return f"dd if=/dev/zero of={path} bs=1M count={mib} conv=fsync 2>&1"


@pytest.mark.parametrize("bad", [0, -1, 15, 10**12, "64", 64.5, True])
def test_bad_disk_mb_is_invalid_request(harness, bad) -> None:
    with pytest.raises(InvalidRequest, match="disk_mb"):
        harness.sandbox(disk_mb=bad)


def test_bad_disk_mb_is_a_400_with_a_json_error(harness) -> None:
    async def post(body: dict) -> httpx.Response:
        async with httpx.AsyncClient(transport=harness.transport(), base_url="http://x") as c:
            return await c.post("/v1/sandboxes", json=body)

    for body in ({"disk_mb": 0}, {"disk_mb": -5}, {"disk_mb": 1 << 40}, {"disk_mb": "1"}):
        r = portal.run(post(body))
        assert r.status_code == 400, (body, r.text)
        assert "disk_mb" in r.json()["error"]


def test_podflare_rootfs_gb_is_a_limit_where_the_store_has_quotas(harness) -> None:
    async def create() -> dict:
        async with httpx.AsyncClient(transport=harness.transport(), base_url="http://x") as c:
            r = await c.post("/v1/sandboxes", json={"template": "default", "rootfs_gb": 1})
            assert r.status_code == 201, r.text
            info = r.json()
            await c.delete(f"/v1/sandboxes/{info['id']}")
            return info

    info = portal.run(create())
    assert info["disk_mb"] == (None if harness.backend == "copy" else 1024)


# ------------------------------------------------------------------ storage level


def test_btrfs_store_limits_each_volume(tmp_path: Path) -> None:
    with choose_backend(tmp_path, "btrfs", image_size=1 << 30) as store:
        assert store.quota == "btrfs simple quotas"
        small, big = store.root / "small", store.root / "big"
        store.backend.create_volume(small)
        store.backend.create_volume(big)
        store.set_limit(small, 8 << 20)
        with pytest.raises(OSError) as caught, open(small / "f", "wb") as f:
            for _ in range(32):
                f.write(b"\0" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
        assert caught.value.errno in (122, 28)  # EDQUOT, ENOSPC
        with open(big / "f", "wb") as f:
            f.write(b"\0" * (32 << 20))
            os.fsync(f.fileno())
        store.set_limit(small, None)  # lifted: it can grow again
        with open(small / "g", "wb") as f:
            f.write(b"\0" * (16 << 20))
            os.fsync(f.fileno())


def test_copy_store_refuses_limits_with_the_reason(tmp_path: Path) -> None:
    with choose_backend(tmp_path, "copy") as store:
        assert store.quota is None
        with pytest.raises(QuotaUnsupported, match="copy storage backend"):
            store.set_limit(store.root, 1 << 20)


def test_new_image_is_bounded_by_the_hosts_free_space(tmp_path: Path) -> None:
    """A small filesystem stands in for a host disk with little free space."""
    host = tmp_path / "host"
    host.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(host)], check=True)
    try:
        size = storage_backend.bounded_image_size(host, storage_backend.DEFAULT_IMAGE_SIZE)
        assert 256 << 20 <= size <= int(0.9 * (512 << 20))
        subprocess.run(["mount", "-o", "remount,size=128m", str(host)], check=True)
        with pytest.raises(BackendUnavailable, match="MiB free"):
            storage_backend.bounded_image_size(host, storage_backend.DEFAULT_IMAGE_SIZE)
    finally:
        subprocess.run(["umount", str(host)], check=True)


def test_a_family_cannot_outgrow_its_disk_by_closing_parents(make, harness) -> None:
    """Simple quotas charge an extent to the volume that wrote it for as long as anything
    references it: a closed parent's files, which its child stacks on (the frozen layer
    of the fork), stayed charged to the deleted volume, counted against no live limit.
    Fork, close the parent, write again: disk_mb=100 reached 516 MiB in six rounds. The
    family now keeps the deleted volume on its account and a fork is refused (429,
    FamilyOverLimit) while it holds more than its live sandboxes may; deleting files
    lets it fork again."""
    if refused_on_copy(harness, disk_mb=100):
        return
    parent = make(disk_mb=100)
    assert dd(parent, "/root/a", 70).exit_code == 0
    (child,) = parent.fork(1)
    try:
        parent.close()  # its 70 MiB live on in the child's lower layer, charged to nobody
        assert dd(child, "/root/b", 70).exit_code == 0  # within the child's own limit
        with pytest.raises(ResourceLimit, match="MiB of disk"):
            child.fork(1)
        assert child.exec("rm /root/b && sync").exit_code == 0
        (grandchild,) = child.fork(1)  # 70 MiB held: within the child's 100 again
        assert grandchild.exec("wc -c < /root/a").stdout.strip() == str(70 << 20)
        grandchild.close()
    finally:
        child.close()


def test_a_family_cannot_outgrow_its_disk_by_restoring(make, harness) -> None:
    """A restore replaces the body: its volume's files, which the checkpoint's frozen
    layer holds, stayed charged to the deleted volume and the new one started empty, so
    each checkpoint-restore round could add a limit's worth. Now the next checkpoint is
    refused while the family holds more than its limit."""
    if refused_on_copy(harness, disk_mb=100):
        return
    sb = make(disk_mb=100)
    assert dd(sb, "/root/a", 70).exit_code == 0
    cp = sb.checkpoint()
    sb.restore(cp)
    assert dd(sb, "/root/b", 70).exit_code == 0  # the new body's own volume is empty
    with pytest.raises(ResourceLimit, match="MiB of disk"):
        sb.checkpoint()
    assert sb.exec("rm /root/b && sync").exit_code == 0
    assert sb.checkpoint().id


def test_a_fork_merge_loop_rewriting_a_file_goes_on_one_growing_stops(make, harness) -> None:
    """Each round's old version of a rewritten file stays in the layer that round's fork
    froze, charged to the family: a loop rewriting 30 MiB in a 100 MiB sandbox was
    refused for good by its fourth round. Over its limits, a family still forks over one
    squashed layer of what its children see, if that fits; a loop that keeps adding
    files (what merging lets a family grow by) is refused once they do not."""
    if refused_on_copy(harness, disk_mb=100):
        return
    sb = make(disk_mb=100)
    for _ in range(8):
        assert sb.exec("rm -f /root/state && " + dd_cmd("/root/state", 30)).exit_code == 0
        (child,) = sb.fork(1)
        sb.merge_into(child)
    assert sb.exec("wc -c < /root/state").stdout.strip() == str(30 << 20)
    with pytest.raises(ResourceLimit, match="would see"):
        for round_ in range(4):
            assert dd(sb, f"/root/more{round_}", 40).exit_code == 0
            (child,) = sb.fork(1)
            sb.merge_into(child)
