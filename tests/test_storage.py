"""Storage layer: snapshot backends, the loop-mounted btrfs store, id shifting, images.

These tests need root (mount, loop devices, chown, trusted.* xattrs), a loop
driver and btrfs-progs. A missing prerequisite fails the test with what is
missing; nothing is skipped. Every mount and loop device a test makes is
released by a fixture finalizer, also when the test fails.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import eventually

from branchbox.agent import sysc
from branchbox.storage import btrfs, copyfs, images, loopback, send_stream
from branchbox.storage import deleter as deleter_module
from branchbox.storage import ioctl as storage_ioctl
from branchbox.storage.backend import (
    BackendUnavailable,
    Store,
    StoreBusy,
    choose_backend,
)
from branchbox.storage.copyfs import remove_tree
from branchbox.storage.deleter import Deleter
from branchbox.storage.idmap import UID_BASE, UID_COUNT, shift_tree

SMALL_IMAGE = 1 << 30


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("storage tests need root (mount, loop devices, chown, trusted.* xattrs)")


def require_loop_btrfs() -> None:
    require_root()
    if not os.path.exists(loopback.LOOP_CONTROL):
        pytest.fail("missing /dev/loop-control: load the loop driver (modprobe loop)")
    if shutil.which("mkfs.btrfs") is None:
        pytest.fail("missing mkfs.btrfs: apt-get install btrfs-progs")


def mounted(path: Path) -> bool:
    return loopback.mount_at(path, loopback.current_mounts()) is not None


def loop_devices_of(image: Path) -> str:
    """Lines of `losetup -a` backed by ``image``."""
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout
    return "\n".join(line for line in out.splitlines() if f"({image})" in line)


@pytest.fixture(scope="module")
def btrfs_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    require_loop_btrfs()
    store = choose_backend(tmp_path_factory.mktemp("btrfs-data"), "btrfs", image_size=SMALL_IMAGE)
    yield store
    store.close()


@pytest.fixture(scope="module")
def copy_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    require_root()
    store = choose_backend(tmp_path_factory.mktemp("copy-data"), "copy")
    yield store
    store.close()


@pytest.fixture(params=["btrfs", "copy"])
def store(request: pytest.FixtureRequest) -> Store:
    chosen: Store = request.getfixturevalue(f"{request.param}_store")
    return chosen


def fresh(store: Store) -> Path:
    """A path for a new volume in ``store``."""
    return store.root / uuid.uuid4().hex


# -- both backends -----------------------------------------------------------------------


def test_backend_names(btrfs_store: Store, copy_store: Store) -> None:
    assert btrfs_store.backend.name == "btrfs"
    assert copy_store.backend.name == "copy"


def test_create_volume_is_empty_and_writable(store: Store) -> None:
    vol = fresh(store)
    store.backend.create_volume(vol)
    assert list(vol.iterdir()) == []
    (vol / "file").write_text("data")
    assert (vol / "file").read_text() == "data"
    store.backend.delete(vol)
    assert not vol.exists()


def test_writable_snapshot_is_independent_both_ways(store: Store) -> None:
    src, snap = fresh(store), fresh(store)
    store.backend.create_volume(src)
    (src / "shared").write_text("before")
    store.backend.snapshot(src, snap, readonly=False)

    (src / "shared").write_text("src changed")
    (src / "only-src").write_text("x")
    assert (snap / "shared").read_text() == "before"
    assert not (snap / "only-src").exists()

    (snap / "shared").write_text("snap changed")
    (snap / "only-snap").write_text("y")
    assert (src / "shared").read_text() == "src changed"
    assert not (src / "only-snap").exists()

    store.backend.delete(snap)
    store.backend.delete(src)


def test_readonly_snapshot_refuses_writes_and_keeps_its_instant(store: Store) -> None:
    src, snap = fresh(store), fresh(store)
    store.backend.create_volume(src)
    (src / "file").write_text("frozen")
    store.backend.snapshot(src, snap, readonly=True)

    with pytest.raises(OSError) as info:
        (snap / "new").write_text("x")
    assert info.value.errno in (errno.EROFS, errno.EPERM)
    (src / "file").write_text("moved on")
    assert (snap / "file").read_text() == "frozen"

    # A read-only snapshot is a fine source for a writable one.
    child = fresh(store)
    store.backend.snapshot(snap, child, readonly=False)
    (child / "new").write_text("ok")

    for vol in (child, snap, src):
        store.backend.delete(vol)
        assert not vol.exists()


def test_btrfs_readonly_snapshot_protects_files_deep_inside(btrfs_store: Store) -> None:
    src, snap = fresh(btrfs_store), fresh(btrfs_store)
    btrfs_store.backend.create_volume(src)
    (src / "dir").mkdir()
    (src / "dir" / "file").write_text("frozen")
    btrfs_store.backend.snapshot(src, snap, readonly=True)
    with pytest.raises(OSError) as info:
        (snap / "dir" / "file").write_text("changed")
    assert info.value.errno == errno.EROFS
    btrfs_store.backend.delete(snap)
    btrfs_store.backend.delete(src)


@pytest.mark.parametrize("readonly", [False, True])
def test_snapshot_keeps_what_overlayfs_needs(store: Store, readonly: bool) -> None:
    src, snap = fresh(store), fresh(store)
    store.backend.create_volume(src)
    os.mknod(src / "whiteout", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    (src / "opaque").mkdir()
    os.setxattr(src / "opaque", "trusted.overlay.opaque", b"y")
    (src / "file").write_text("content")
    os.setxattr(src / "file", "user.note", b"kept")
    os.chown(src / "file", UID_BASE + 5, UID_BASE + 6)
    os.chmod(src / "file", 0o4751)
    os.link(src / "file", src / "hardlink")
    os.symlink("file", src / "link")

    store.backend.snapshot(src, snap, readonly=readonly)

    wh = os.lstat(snap / "whiteout")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == os.makedev(0, 0)
    assert os.getxattr(snap / "opaque", "trusted.overlay.opaque") == b"y"
    st = os.lstat(snap / "file")
    assert (st.st_uid, st.st_gid) == (UID_BASE + 5, UID_BASE + 6)
    assert stat.S_IMODE(st.st_mode) == 0o4751
    assert os.getxattr(snap / "file", "user.note") == b"kept"
    assert os.lstat(snap / "hardlink").st_ino == st.st_ino
    assert os.readlink(snap / "link") == "file"

    store.backend.delete(snap)
    store.backend.delete(src)


DEEP_TREE = """
import os, resource, sys
from pathlib import Path
from branchbox.storage.backend import BtrfsBackend, CopyBackend
from branchbox.storage.squash import squash

kind, root, depth = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
backend = BtrfsBackend() if kind == "btrfs" else CopyBackend()
# A walk holding a fd (or a Python frame) per level fails below; ours holds a few.
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 48,) * 2)

def grow(volume, name):
    fd = os.open(volume / "upper", os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(os.open(name, os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    os.close(fd)

def leaves(volume):
    fd, found = os.open(volume / "upper", os.O_DIRECTORY), []
    while True:
        names = sorted(os.listdir(fd))
        found += [n for n in names if n != "d"]
        if "d" not in names:
            os.close(fd)
            return found
        sub = os.open("d", os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub

bottom, top, copy, squashed = (root / n for n in ("bottom", "top", "copy", "squashed"))
for volume in (bottom, top):
    backend.create_volume(volume)
    (volume / "upper").mkdir()
grow(bottom, "old")
grow(top, "new")  # the same directories: merged level by level
backend.snapshot(top, copy, readonly=True)
squash(backend, [top, bottom], squashed)
print(leaves(copy), leaves(squashed))
for volume in (bottom, top, copy, squashed):
    backend.delete(volume)
print(sorted(os.listdir(root)))
"""


def test_trees_deeper_than_a_stack_and_path_max_are_copied_squashed_and_deleted(
        store: Store) -> None:
    """A sandbox makes a tree of any depth in its layer in a moment (relative mkdir and
    chdir): 3,000 levels pass Python's recursion limit and PATH_MAX. Snapshots, the
    squash of a fork chain and deletes go through with a handful of fds (a walk with one
    per level would empty the daemon's fd table for every other sandbox; the squash
    failed with RecursionError, every later fork of that sandbox with it)."""
    root = fresh(store)
    root.mkdir()
    try:
        run = subprocess.run([sys.executable, "-c", DEEP_TREE, store.backend.name,
                              str(root), "3000"], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.splitlines() == ["['new'] ['new', 'old']", "[]"], run.stdout
    finally:
        store.backend.delete(root)


def test_copy_links_linked_files_again_and_refuses_those_too_deep_to_name(
        tmp_path: Path) -> None:
    """A file linked twice is copied once and linked again; below PATH_MAX of path it
    cannot be linked by name, and copying it once per link would let a sandbox turn one
    large file into thousands: the copy is refused (ENAMETOOLONG) instead."""
    for depth, refused in ((3, False), (3000, True)):
        src, dst = tmp_path / f"src{depth}", tmp_path / f"dst{depth}"
        src.mkdir()
        dst.mkdir()
        fd = os.open(src, os.O_DIRECTORY)
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            sub = os.open("d", os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        with open(os.open("one", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd), "wb") as f:
            f.write(b"x" * 4096)
        os.link("one", "two", src_dir_fd=fd, dst_dir_fd=fd)
        os.close(fd)
        src_fd, dst_fd = os.open(src, os.O_DIRECTORY), os.open(dst, os.O_DIRECTORY)
        try:
            if refused:
                with pytest.raises(OSError) as exc:
                    copyfs.copy_tree(src_fd, dst_fd)
                assert exc.value.errno == errno.ENAMETOOLONG
            else:
                copyfs.copy_tree(src_fd, dst_fd)
                one, two = (dst.joinpath(*["d"] * depth, n).stat() for n in ("one", "two"))
                assert (one.st_ino, one.st_nlink) == (two.st_ino, 2)
        finally:
            os.close(src_fd)
            os.close(dst_fd)
        remove_tree(src)
        remove_tree(dst)


def test_delete_missing_path_is_not_an_error(store: Store) -> None:
    store.backend.delete(fresh(store))


def test_delete_removes_directories_without_permissions(store: Store) -> None:
    vol = fresh(store)
    store.backend.create_volume(vol)
    locked = vol / "a" / "b"
    locked.mkdir(parents=True)
    (locked / "file").write_text("x")
    os.chmod(locked, 0)
    os.chmod(vol / "a", 0o500)
    store.backend.delete(vol)
    assert not vol.exists()


def test_copy_delete_runs_as_unprivileged_owner(copy_store: Store) -> None:
    """Without CAP_DAC_OVERRIDE, unwritable directories must be opened up before emptying."""
    parent = fresh(copy_store)
    parent.mkdir()
    vol = parent / "vol"
    copy_store.backend.create_volume(vol)
    (vol / "ro").mkdir()
    (vol / "ro" / "file").write_text("x")
    os.chmod(vol / "ro", 0o500)
    for path in (parent, vol, vol / "ro", vol / "ro" / "file"):
        os.chown(path, 65534, 65534)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(parent)  # pytest's temporary directories are 0700, not traversable
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            copy_store.backend.delete(Path("vol"))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not vol.exists()
    copy_store.backend.delete(parent)


def test_the_deleter_deletes_in_its_own_thread_in_order(store: Store) -> None:
    """Freed volumes go to one background thread, in the order given; ``close`` waits
    for them, a missing one is no error, and once closed a put deletes at once."""
    done: list[tuple[str, Path]] = []

    def delete(path: Path) -> None:
        store.backend.delete(path)
        done.append((threading.current_thread().name, path))

    deleter = Deleter(delete)
    volumes = [fresh(store) for _ in range(4)]
    for vol in volumes:
        store.backend.create_volume(vol)
        for i in range(200):
            (vol / f"f{i}").write_text("x")
    for vol in [*volumes[:3], fresh(store)]:  # the last one was never made
        deleter.put(vol)
    deleter.close()
    assert [path for _, path in done[:3]] == volumes[:3]
    assert {name for name, _ in done} == {"bb-delete"}
    deleter.put(volumes[3])
    assert done[-1] == (threading.current_thread().name, volumes[3])
    assert not any(vol.exists() for vol in volumes)


def test_the_deleter_goes_on_past_a_failure_and_close_finishes_the_queue(
        copy_store: Store, caplog: pytest.LogCaptureFixture) -> None:
    """One volume that cannot be deleted is logged (the next start sweeps it); those
    after it are deleted, and ``close`` deletes what is queued before it returns."""
    stuck, after = fresh(copy_store), fresh(copy_store)

    def delete(path: Path) -> None:
        if path == stuck:
            raise OSError(errno.EIO, "broken (injected)", str(path))
        copy_store.backend.delete(path)

    copy_store.backend.create_volume(stuck)
    copy_store.backend.create_volume(after)
    deleter = Deleter(delete)
    deleter.put(stuck)
    deleter.put(after)
    deleter.close()
    assert not after.exists() and stuck.exists()
    assert "broken (injected)" in caplog.text
    copy_store.backend.delete(stuck)


def test_a_subvolume_being_sent_is_deleted_once_the_send_ends(
        btrfs_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """btrfs refuses (EPERM) to destroy a subvolume a send is reading (a diff of it);
    the deleter tries it again later instead of leaving it for the next start."""
    monkeypatch.setattr(deleter_module, "RETRY_AFTER", (1.0,) * 5)
    live, before, after = fresh(btrfs_store), fresh(btrfs_store), fresh(btrfs_store)
    btrfs.create_subvolume(live)
    for i in range(5000):
        (live / f"f{i}").touch()
    btrfs.snapshot(live, before, readonly=True)
    for i in range(5000):
        os.chmod(live / f"f{i}", 0o600)
    btrfs.snapshot(live, after, readonly=True)
    refused: list[int] = []

    def delete(path: Path) -> None:
        try:
            btrfs_store.backend.delete(path)
        except OSError as exc:
            refused.append(exc.errno)
            raise

    deleter = Deleter(delete)
    changes = send_stream.changes(after, btrfs.subvolume_info(before).treeid, lambda: None)
    try:
        assert next(changes).path  # the kernel's send is under way (its pipe is full)
        deleter.put(after)
        assert eventually(lambda: bool(refused), within=10)
        assert refused == [errno.EPERM] and after.exists()
    finally:
        changes.close()  # the send ends at its next write
    assert eventually(lambda: not after.exists(), within=10)
    deleter.close()
    for vol in (live, before):
        btrfs_store.backend.delete(vol)


def test_the_send_stream_names_what_changed_and_stops_when_told(btrfs_store: Store) -> None:
    """What a send stream (without data) says changed between two snapshots of one
    volume, each path with whether its subtree is in question; a check that raises
    stops it at once, the kernel's send ending with it (no thread left)."""
    live, before, after = fresh(btrfs_store), fresh(btrfs_store), fresh(btrfs_store)
    btrfs.create_subvolume(live)
    (live / "dir" / "sub").mkdir(parents=True)
    for name in ("same", "edited", "gone", "dir/sub/x"):
        (live / name).write_text("x")
    btrfs.snapshot(live, before, readonly=True)
    (live / "edited").write_text("y")
    (live / "gone").unlink()
    (live / "dir").rename(live / "moved")
    (live / os.fsdecode(b"new\xff")).write_text("n")
    btrfs.snapshot(live, after, readonly=True)
    parent = btrfs.subvolume_info(before).treeid
    found: dict[bytes, bool] = {}
    for change in send_stream.changes(after, parent, lambda: None):
        found[change.path] = found.get(change.path, False) or change.whole
    assert found[b"edited"] is False and found[b"gone"] is True
    assert found[b"dir"] is True and found[b"moved"] is True and found[b"new\xff"] is True
    assert b"same" not in found and b"moved/sub/x" not in found  # a move is one rename

    class Stop(Exception):
        pass

    def stop() -> None:
        raise Stop

    with pytest.raises(Stop):
        list(send_stream.changes(after, parent, stop))
    assert not any(t.name == "bb-send" for t in threading.enumerate())
    for vol in (live, before, after):
        btrfs_store.backend.delete(vol)


# -- btrfs specifics ---------------------------------------------------------------------


def test_btrfs_delete_readonly_volume_with_nested_subvolumes(btrfs_store: Store) -> None:
    vol = fresh(btrfs_store)
    btrfs.create_subvolume(vol)
    (vol / "dir").mkdir()
    btrfs.create_subvolume(vol / "dir" / "inner")
    btrfs.create_subvolume(vol / "dir" / "inner" / "innermost")
    (vol / "dir" / "inner" / "innermost" / "file").write_text("x")
    btrfs.set_readonly(vol / "dir" / "inner", True)
    btrfs.set_readonly(vol, True)
    assert btrfs.nested_subvolumes(vol) == [str(vol / "dir" / "inner")]
    btrfs_store.backend.delete(vol)
    assert not vol.exists()


def test_btrfs_delete_plain_directory_holding_subvolumes(btrfs_store: Store) -> None:
    plain = fresh(btrfs_store)
    plain.mkdir()
    btrfs.create_subvolume(plain / "sub")
    (plain / "file").write_text("x")
    btrfs_store.backend.delete(plain)
    assert not plain.exists()


def test_btrfs_snapshot_refuses_a_plain_directory(btrfs_store: Store) -> None:
    """The kernel would snapshot the enclosing subvolume instead; the wrapper must refuse."""
    vol = fresh(btrfs_store)
    btrfs.create_subvolume(vol)
    (vol / "dir").mkdir()
    with pytest.raises(OSError) as info:
        btrfs.snapshot(vol / "dir", fresh(btrfs_store), readonly=False)
    assert info.value.errno == errno.EINVAL
    btrfs_store.backend.delete(vol)


def test_btrfs_calls_let_other_threads_run(btrfs_store: Store,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot commits a btrfs transaction (milliseconds, more under load). Its ioctl
    runs without the GIL, so the daemon's event loop and other threads go on meanwhile:
    Python's fcntl.ioctl holds the GIL for a buffer over 1024 bytes, as btrfs's 4 KiB
    argument structs are, so a snapshot stopped the whole daemon."""
    progress = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal progress
        while not stop.is_set():
            progress += 1

    during: list[int] = []
    real = storage_ioctl._libc.ioctl

    def watched(*args):
        before = progress
        try:
            return real(*args)
        finally:
            during.append(progress - before)

    monkeypatch.setattr(storage_ioctl._libc, "ioctl", watched)
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        src = fresh(btrfs_store)
        btrfs.create_subvolume(src)
        for _ in range(10):
            snap = fresh(btrfs_store)
            btrfs.snapshot(src, snap, readonly=True)
            btrfs.delete_subvolume(snap)
        btrfs.delete_subvolume(src)
    finally:
        stop.set()
        spinner.join()
    assert len(during) >= 21  # create, 10 snapshots, 10 deletes (and a flag change)
    assert max(during) > 0, "no other thread ran while btrfs worked: the GIL was held"


def test_btrfs_errors_carry_errno_and_path(btrfs_store: Store, tmp_path: Path) -> None:
    vol = fresh(btrfs_store)
    btrfs.create_subvolume(vol)
    with pytest.raises(FileExistsError):
        btrfs.create_subvolume(vol)
    with pytest.raises(FileNotFoundError):
        btrfs.create_subvolume(fresh(btrfs_store) / "child")
    with pytest.raises(OSError, match="not on a btrfs filesystem") as info:
        btrfs.create_subvolume(tmp_path / "x")
    assert info.value.filename == str(tmp_path / "x")
    btrfs_store.backend.delete(vol)


def test_is_btrfs(btrfs_store: Store) -> None:
    assert btrfs.is_btrfs(btrfs_store.root)
    assert not btrfs.is_btrfs("/proc")


# -- choose_backend ----------------------------------------------------------------------


def test_unknown_kind_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="auto, btrfs, copy"):
        choose_backend(tmp_path, "bogus")


def test_copy_kind_uses_plain_directories(tmp_path: Path) -> None:
    with choose_backend(tmp_path, "copy") as store:
        assert store.backend.name == "copy"
        assert store.root == tmp_path / "volumes"
        assert store.root.is_dir()


def test_auto_on_ext4_loop_mounts_an_image_and_close_releases_it(tmp_path: Path) -> None:
    require_loop_btrfs()
    if btrfs.is_btrfs(tmp_path):
        pytest.fail(f"{tmp_path} is on btrfs; this test needs a non-btrfs temporary directory")
    image, mountpoint = tmp_path / "store.img", tmp_path / "store"
    store = choose_backend(tmp_path, image_size=SMALL_IMAGE)
    try:
        assert store.backend.name == "btrfs"
        assert store.root == mountpoint / "volumes"
        assert btrfs.is_btrfs(store.root)
        assert os.stat(image).st_blocks * 512 < SMALL_IMAGE // 4, "image should be sparse"
        assert loop_devices_of(image)
        store.backend.create_volume(store.root / "kept")
    finally:
        store.close()
    assert not mounted(mountpoint)
    assert loop_devices_of(image) == ""
    store.close()  # idempotent

    with choose_backend(tmp_path, image_size=SMALL_IMAGE) as again:
        assert (again.root / "kept").is_dir(), "the existing image must be reused"
    assert not mounted(mountpoint)
    assert loop_devices_of(image) == ""


def test_a_second_store_on_the_same_image_is_refused(tmp_path: Path) -> None:
    require_loop_btrfs()
    with choose_backend(tmp_path, "btrfs", image_size=SMALL_IMAGE), pytest.raises(StoreBusy):
        choose_backend(tmp_path, "btrfs", image_size=SMALL_IMAGE)
    assert not mounted(tmp_path / "store")


def test_a_mount_left_by_a_dead_process_is_adopted_and_released(tmp_path: Path) -> None:
    require_loop_btrfs()
    with choose_backend(tmp_path, "btrfs", image_size=SMALL_IMAGE):
        pass
    image, mountpoint = tmp_path / "store.img", tmp_path / "store"
    loopback.mount_image(image, mountpoint, "btrfs")  # as if a daemon had crashed
    try:
        with choose_backend(tmp_path, image_size=SMALL_IMAGE) as store:
            assert store.backend.name == "btrfs"
            assert len(loopback.mounts_under(mountpoint, loopback.current_mounts())) == 1
    finally:
        if mounted(mountpoint):
            sysc.umount2(str(mountpoint))
    assert not mounted(mountpoint)
    assert loop_devices_of(image) == ""


def test_a_foreign_mount_at_the_store_is_never_adopted(tmp_path: Path) -> None:
    require_loop_btrfs()
    mountpoint = tmp_path / "store"
    mountpoint.mkdir()
    sysc.mount("tmpfs", str(mountpoint), "tmpfs")
    try:
        with pytest.raises(BackendUnavailable, match="already mounted from tmpfs"):
            choose_backend(tmp_path, "btrfs", image_size=SMALL_IMAGE)
        assert mounted(mountpoint)
    finally:
        sysc.umount2(str(mountpoint))


def test_auto_on_btrfs_uses_subvolumes_in_place(btrfs_store: Store) -> None:
    data_dir = fresh(btrfs_store)
    before = loopback.current_mounts()
    with choose_backend(data_dir) as store:
        assert store.backend.name == "btrfs"
        assert store.root == data_dir / "volumes"
        assert loopback.current_mounts() == before
    remove_tree(data_dir)


def test_without_mkfs_auto_falls_back_to_copy_and_btrfs_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    require_root()
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    data_dir = tmp_path / "data"

    with pytest.raises(BackendUnavailable, match="mkfs.btrfs"):
        choose_backend(data_dir, "btrfs", image_size=SMALL_IMAGE)
    with choose_backend(data_dir, image_size=SMALL_IMAGE) as store:
        assert store.backend.name == "copy"
        assert store.root == data_dir / "volumes"
    assert "mkfs.btrfs" in caplog.text and "copy backend" in caplog.text
    assert not (data_dir / "store.img").exists(), "a failed set-up must not leave its image"


def test_parse_mountinfo_unescapes_paths() -> None:
    text = (
        "36 35 98:0 / /mnt/with\\040space rw,noatime master:1 - btrfs /dev/loop3 rw\n"
        "37 35 98:0 / /mnt/with\\040space rw - tmpfs tmpfs rw\n"
    )
    mounts = loopback.parse_mountinfo(text)
    assert mounts[0] == loopback.Mount("/mnt/with space", "/dev/loop3", "btrfs")
    assert loopback.mount_at(Path("/mnt/with space"), mounts) == mounts[1]


# -- shift_tree --------------------------------------------------------------------------


def test_shift_tree_shifts_everything_once_without_following_symlinks(tmp_path: Path) -> None:
    require_root()
    root = tmp_path / "rootfs"
    (root / "usr" / "bin").mkdir(parents=True)
    suid = root / "usr" / "bin" / "su"
    suid.write_text("#!/bin/sh\n")
    os.chmod(suid, 0o4755)
    sgid = root / "usr" / "bin" / "wall"
    sgid.write_text("#!/bin/sh\n")
    os.chown(sgid, 0, 5)
    os.chmod(sgid, 0o2755)
    os.link(suid, root / "usr" / "bin" / "su-link")
    home = root / "home" / "user"
    home.mkdir(parents=True)
    os.chown(home, 1000, 1000)
    outside = tmp_path / "outside"
    outside.write_text("not part of the tree")
    os.symlink(outside, root / "escape")

    shift_tree(root, UID_BASE)

    def ids(path: Path) -> tuple[int, int]:
        st = os.lstat(path)
        return st.st_uid, st.st_gid

    assert ids(root) == (UID_BASE, UID_BASE)
    assert ids(suid) == (UID_BASE, UID_BASE)
    assert stat.S_IMODE(os.lstat(suid).st_mode) == 0o4755
    assert ids(sgid) == (UID_BASE, UID_BASE + 5)
    assert stat.S_IMODE(os.lstat(sgid).st_mode) == 0o2755
    assert ids(home) == (UID_BASE + 1000, UID_BASE + 1000)
    assert ids(root / "escape") == (UID_BASE, UID_BASE)
    assert ids(outside) == (0, 0), "the symlink's target must not be touched"


def test_shift_tree_refuses_ids_outside_the_mappable_range(tmp_path: Path) -> None:
    require_root()
    (tmp_path / "f").write_text("x")
    os.chown(tmp_path / "f", UID_COUNT, 0)
    with pytest.raises(ValueError, match="already shifted"):
        shift_tree(tmp_path, UID_BASE)


# -- images ------------------------------------------------------------------------------


def test_unknown_image_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(images.ImageNotFound, match="default"):
        images.ensure_image("no-such-image", cache_dir=tmp_path, progress=False)
    assert isinstance(images.ImageNotFound("x"), LookupError)


def test_failed_build_reports_output_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    require_root()
    if shutil.which("debootstrap") is None:
        pytest.fail("missing debootstrap: apt-get install debootstrap")
    broken = images.ImageSpec(suite="bookworm", packages=(), mirror="file:///nonexistent")
    monkeypatch.setitem(images.KNOWN_IMAGES, "broken", broken)
    stale = tmp_path / "broken" / "build-crashed" / "rootfs"
    stale.mkdir(parents=True)
    (stale / "half").write_text("from a crashed build")
    (tmp_path / "broken" / "rootfs").mkdir()  # renamed into place, but no manifest yet

    with pytest.raises(images.ImageBuildError, match="Failed getting release file"):
        images.ensure_image("broken", cache_dir=tmp_path, progress=False)

    assert sorted(p.name for p in (tmp_path / "broken").iterdir()) == [".lock"]
    assert capfd.readouterr() == ("", "")


def test_a_built_image_is_used_without_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rootfs = tmp_path / "default" / "rootfs"
    rootfs.mkdir(parents=True)
    version = images.KNOWN_IMAGES["default"].version
    (tmp_path / "default" / "manifest.json").write_text(f'{{"version": {version}}}')
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # no debootstrap to run
    assert images.ensure_image("default", cache_dir=tmp_path, progress=False) == rootfs
