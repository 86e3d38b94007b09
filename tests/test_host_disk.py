"""The host disk under the store (issue 16, finding 1).

A small ext4 filesystem, loop-mounted, stands in for the host disk, and the data
directory is placed on it. The store is a sparse btrfs image there: when the host
disk fills up (other users of it, or the store itself), a sandbox's write must fail
with ENOSPC in that sandbox, and the store must stay writable for everyone, never
abort; blocks sandboxes free must go back to the host; and a store that did abort
must be refused with a message saying what to do, not adopted.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from waiting import eventually

from branchbox import Sandbox
from branchbox.engine.config import EngineConfig
from branchbox.engine.sandboxes import Engine
from branchbox.sdk._portal import portal
from branchbox.server.app import create_app
from branchbox.storage import host_disk, loopback
from branchbox.storage.backend import choose_backend
from branchbox.storage.store_health import StoreUnhealthy

MiB = 1 << 20


@contextmanager
def small_host_disk(mib: int) -> Iterator[Path]:
    """An empty ext4 filesystem of ``mib`` MiB, mounted; unmounted and removed afterwards."""
    mkfs = shutil.which("mkfs.ext4")
    if mkfs is None:
        pytest.fail("mkfs.ext4 is missing (apt-get install e2fsprogs)")
    base = Path(tempfile.mkdtemp(prefix="branchbox-test-hostdisk-"))
    base.chmod(0o755)
    image, mnt = base / "disk.img", base / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(mib * MiB)
    subprocess.run([mkfs, "-q", "-F", "-m", "0", str(image)], check=True)
    device = loopback.mount_image(image, mnt, "ext4")
    try:
        mnt.chmod(0o755)
        yield mnt
    finally:
        for inner in loopback.mounts_under(mnt, loopback.current_mounts()):
            if inner != str(mnt):
                subprocess.run(["umount", "-l", inner], check=False)
        loopback.unmount_image(mnt, device)
        shutil.rmtree(base)


def fill_host(host: Path, leave_mib: int) -> None:
    """Take all but ``leave_mib`` MiB of the host disk's free space (another user of it)."""
    free = host_disk.host_free(host)
    fd = os.open(host / "ballast", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, free - leave_mib * MiB)
    finally:
        os.close(fd)


def write_mib(path: Path, mib: int) -> None:
    """Write ``mib`` MiB to ``path``, each MiB synced to the disk."""
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(MiB))
            f.flush()
            os.fsync(f.fileno())


def test_a_host_disk_that_fills_up_gives_enospc_and_the_store_stays_writable() -> None:
    with small_host_disk(1536) as host, choose_backend(host / "data", "btrfs") as store:
        volume = store.root / "v"
        store.backend.create_volume(volume)
        before = store.capacity()
        fill_host(host, leave_mib=300)
        # The store follows the host's free space; what matters is what a writer sees.
        eventually(lambda: store.capacity() < before, within=20)
        with pytest.raises(OSError) as caught:
            write_mib(volume / "big", 1024)
        assert caught.value.errno == errno.ENOSPC, caught.value
        (volume / "big").unlink()
        os.sync()
        write_mib(volume / "small", 16)  # still read-write once the writer freed its space
        assert "ro" not in loopback.superblock_options(host / "data" / "store")


def test_a_sandbox_that_fills_the_host_disk_gets_enospc_and_no_one_else_is_hurt() -> None:
    with small_host_disk(1536) as host:
        data = host / "data"
        engine = Engine(EngineConfig(data_dir=data, storage="btrfs", disk_mb=0, warm_pool=0))
        portal.run(engine.start())
        try:
            app = create_app(engine)

            def sandbox() -> Sandbox:
                return Sandbox(transport=httpx.ASGITransport(app=app))

            with sandbox() as writer, sandbox() as other:
                fill_host(host, leave_mib=300)
                eventually(lambda: engine.store.capacity() < 1 << 30, within=20)
                r = writer.exec("dd if=/dev/zero of=/root/big bs=1M count=1024 conv=fsync 2>&1")
                assert r.exit_code != 0, r.stdout
                assert "No space left on device" in r.stdout, r.stdout
                assert writer.exec("rm /root/big && sync && echo freed").stdout == "freed\n"
                r = other.exec("dd if=/dev/zero of=/root/ok bs=1M count=16 conv=fsync 2>&1")
                assert r.exit_code == 0, r.stdout
                with sandbox() as new:  # create still works
                    assert new.run_code("1 + 1").text == "2"
        finally:
            portal.run(engine.stop())
        assert not loopback.mounts_under(data, loopback.current_mounts())


def test_freed_blocks_go_back_to_the_host() -> None:
    """A store mounted without discard (by an older daemon, or a kernel before 6.2, where
    btrfs does not turn discard=async on by itself) kept every block it ever wrote."""
    with small_host_disk(1536) as host:
        data = host / "data"
        with choose_backend(data, "btrfs"):
            pass  # a store image made as the daemon makes it
        image, mountpoint = data / "store.img", data / "store"
        device = loopback.mount_image(image, mountpoint, "btrfs", "nobarrier,nodiscard")
        try:
            write_mib(mountpoint / "f", 400)
            (mountpoint / "f").unlink()
            os.sync()
            held = host_disk.image_host_bytes(image)
            with choose_backend(data, "btrfs"):  # adopts the mount
                given_back = eventually(
                    lambda: host_disk.image_host_bytes(image) < held - 300 * MiB, within=60)
                after = host_disk.image_host_bytes(image)
        finally:
            if loopback.mount_at(mountpoint, loopback.current_mounts()) is not None:
                loopback.unmount_image(mountpoint, device)
        print(f"store image on the host: {held // MiB} MiB after writing and deleting "
              f"400 MiB, {after // MiB} MiB once adopted")
        assert given_back, f"the image still takes {after // MiB} MiB (was {held // MiB} MiB)"


def test_an_aborted_store_is_refused_with_what_to_do() -> None:
    with small_host_disk(700) as host:
        data = host / "data"
        data.mkdir()
        image, mountpoint = data / "store.img", data / "store"
        # A store as an old daemon made it: larger than the host can back.
        with open(image, "wb") as f:
            f.truncate(4 << 30)
        loopback.format_btrfs(image, "branchbox")
        mountpoint.mkdir()
        device = loopback.mount_image(image, mountpoint, "btrfs", "nobarrier")
        try:
            with pytest.raises(OSError):
                write_mib(mountpoint / "big", 1024)  # the host disk fills under it
            os.sync()
            assert eventually(lambda: "ro" in loopback.superblock_options(mountpoint), 10), \
                "the host disk filling up under the store should have aborted it"
            (image.parent / "unused").touch()  # the host itself is writable again
            with pytest.raises(StoreUnhealthy, match=r"read-only.*rm .*store\.img"):
                choose_backend(data, "btrfs")
        finally:
            if loopback.mount_at(mountpoint, loopback.current_mounts()) is not None:
                loopback.unmount_image(mountpoint, device)


def test_a_store_the_host_can_no_longer_back_is_refused_at_start() -> None:
    with small_host_disk(1024) as host:
        data = host / "data"
        with choose_backend(data, "btrfs"):
            pass  # made while the host had room
        fill_host(host, leave_mib=100)  # then the host filled up while no daemon ran
        with pytest.raises(StoreUnhealthy, match="nearly full"):
            choose_backend(data, "btrfs")
        assert not loopback.mounts_under(data, loopback.current_mounts())
