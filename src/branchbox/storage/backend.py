"""Snapshot backends behind one interface, and picking one for a data directory.

Layers are "volumes": directories the engine creates, snapshots and deletes.
On btrfs a snapshot is O(1) whatever the size; elsewhere it is a full copy.
``choose_backend`` prefers btrfs even on hosts without it, by keeping the
store in a loop-mounted btrfs image file inside the data directory.

A store may also bound each volume's size in the kernel (``Store.quota``): on
a btrfs store the daemon owns, with btrfs simple quotas, so one sandbox that
fills its volume gets EDQUOT while every other sandbox keeps writing.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Protocol

from branchbox.storage import btrfs, host_disk, loopback, store_health
from branchbox.storage.copyfs import CopyBackend, remove_tree

log = logging.getLogger(__name__)

KINDS = ("auto", "btrfs", "copy")
# The most a store image grows to; the file is sparse, and its size follows the host's
# free space (storage.host_disk), so it never promises sandboxes more than the host has.
DEFAULT_IMAGE_SIZE = 64 << 30
SIMPLE_QUOTAS = "btrfs simple quotas"  # Store.quota where an extent's writer pays for it

COPY_NO_QUOTA = (
    "the copy storage backend cannot enforce disk_mb: its volumes are plain directories, "
    "which no kernel quota bounds; run the daemon with the btrfs backend "
    "(BRANCHBOX_STORAGE=btrfs, the default where a btrfs image can be loop-mounted)"
)


class SnapshotBackend(Protocol):
    """What the engine needs from a storage backend; paths are absolute."""

    name: str

    def create_volume(self, path: Path) -> None:
        """Create an empty, writable volume at ``path`` (the parent must exist)."""
        ...

    def snapshot(self, src: Path, dst: Path, *, readonly: bool) -> None:
        """Make ``dst`` a copy-on-write snapshot of volume ``src``."""
        ...

    def delete(self, path: Path) -> None:
        """Remove volume ``path`` whatever its state; a missing path is not an error."""
        ...


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run on this host; the message says what is missing."""


class StoreBusy(RuntimeError):
    """Another Store (in this or another process) has this data directory's image mounted."""


class QuotaUnsupported(RuntimeError):
    """This store cannot bound a volume's size; the message says why and what would."""


class BtrfsBackend:
    """Volumes are btrfs subvolumes; snapshots are O(1) ioctls."""

    name = "btrfs"

    def create_volume(self, path: Path) -> None:
        btrfs.create_subvolume(path)

    def snapshot(self, src: Path, dst: Path, *, readonly: bool) -> None:
        btrfs.snapshot(src, dst, readonly)

    def delete(self, path: Path) -> None:
        """Destroy subvolume ``path``; anything else there is removed as a plain tree."""
        try:
            if btrfs.is_subvolume(path):
                btrfs.delete_subvolume(path)
                return
        except FileNotFoundError:
            return
        remove_tree(path, on_other_device=_delete_nested_subvolume)


def _delete_nested_subvolume(path: str) -> None:
    if not btrfs.is_subvolume(path):
        raise OSError(errno.EXDEV, "refusing to delete across a mount point", path)
    btrfs.delete_subvolume(path)


@dataclass(eq=False)
class Store:
    """Where volumes live (``root``), the backend that manages them, and its set-up.

    ``close()`` undoes what ``choose_backend`` set up (for a loop image: the
    mount, and with it the loop device) and may be called more than once.
    """

    backend: SnapshotBackend
    root: Path
    # How volume sizes are bounded in the kernel ("btrfs simple quotas"...), or None
    # with ``no_quota`` saying why not.
    quota: str | None = None
    no_quota: str = ""
    _teardown: list[Callable[[], None]] = field(default_factory=list, init=False, repr=False)

    def set_limit(self, volume: Path, max_bytes: int | None) -> None:
        """Bound what ``volume`` may hold to ``max_bytes`` (None: unbounded).

        Writes past it fail with EDQUOT inside that volume only. Raises
        QuotaUnsupported on a store without quotas.
        """
        if self.quota is None:
            raise QuotaUnsupported(self.no_quota)
        btrfs.set_limit(volume, max_bytes)

    def used(self, volume: Path) -> int | None:
        """The bytes ``volume`` holds of its own (what its limit bounds); None on a store
        without quotas, which counts nothing per volume (and walking a volume to add up
        its files would cost what it holds)."""
        return None if self.quota is None else btrfs.exclusive_bytes(volume)

    def charge_group(self, volume: Path) -> str | None:
        """Where ``volume``'s own bytes are counted (``btrfs.charged_bytes`` reads it),
        readable after it is deleted: under simple quotas an extent stays charged to the
        volume that wrote it for as long as a snapshot (a frozen layer) references it.
        None on any other store, where a deleted volume's group counts nothing (full
        qgroups move shared extents to the snapshots' own groups; no quota, nothing)."""
        return btrfs.qgroup_dir(volume) if self.quota == SIMPLE_QUOTAS else None

    def capacity(self) -> int:
        """Bytes the store's filesystem holds in all (no limit above it means anything)."""
        st = os.statvfs(self.root)
        return st.f_blocks * st.f_frsize

    def close(self) -> None:
        while self._teardown:
            self._teardown.pop()()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def choose_backend(
    data_dir: Path, kind: str = "auto", *, image_size: int = DEFAULT_IMAGE_SIZE
) -> Store:
    """Open the volume store of ``data_dir`` with backend ``kind``.

    - ``"copy"``: plain directories under ``data_dir/volumes``.
    - ``"btrfs"``: subvolumes under ``data_dir/volumes`` if ``data_dir`` is on
      btrfs; otherwise under ``data_dir/store/volumes``, where ``store`` is
      the btrfs image ``data_dir/store.img`` (created sparse on first use,
      reused after) loop-mounted, with simple quotas on. Its size follows the
      host's free space, up to ``image_size`` (see storage.host_disk). Raises
      BackendUnavailable, saying what is missing, when neither works, and
      StoreUnhealthy (never falling back) for a store that aborted or failed.
    - ``"auto"``: ``"btrfs"`` if possible, else ``"copy"`` with a warning.

    A loop-mounted store belongs to one Store at a time (StoreBusy otherwise):
    a mount left at ``data_dir/store`` by a process that died is adopted, and
    unmounted by ``close()`` like one this call made.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown storage backend {kind!r}; expected one of {', '.join(KINDS)}")
    data_dir = Path(data_dir).absolute()
    data_dir.mkdir(parents=True, exist_ok=True)
    if kind == "copy":
        return _copy_store(data_dir)
    if btrfs.is_btrfs(data_dir):
        return _host_btrfs_store(data_dir)
    try:
        return _loopback_store(data_dir, image_size)
    except BackendUnavailable as exc:
        if kind == "btrfs":
            raise
        log.warning(
            "btrfs unavailable for %s (%s); using the copy backend, where a snapshot "
            "costs time proportional to the data it copies",
            data_dir,
            exc,
        )
        return _copy_store(data_dir)


def _store(backend: SnapshotBackend, root: Path) -> Store:
    root.mkdir(exist_ok=True)
    return Store(backend, root)


def _copy_store(data_dir: Path) -> Store:
    """Plain directories: no per-volume limit (a project quota would need an XFS or
    ext4 filesystem mounted with prjquota, which the data directory's is not known to be;
    a loop image per volume would cost a mkfs and a mount per sandbox and fork)."""
    store = _store(CopyBackend(), data_dir / "volumes")
    store.no_quota = COPY_NO_QUOTA
    return store


def _host_btrfs_store(data_dir: Path) -> Store:
    """Subvolumes on the host's own btrfs. Quotas are used if the host already runs
    them; they are not turned on here: simple quotas set an incompat bit, and full
    qgroups slow every snapshot on the host's filesystem, neither ours to decide."""
    store = _store(BtrfsBackend(), data_dir / "volumes")
    mode = btrfs.quota_mode(data_dir)
    if mode in ("simple", "qgroup"):
        store.quota = f"btrfs {mode} quotas"
    else:
        store.no_quota = (
            f"the store is on the host's btrfs at {data_dir}, where quotas are off, and "
            "branchbox does not turn them on for a filesystem it does not own; "
            f"`btrfs quota enable --simple {data_dir}` (kernel 6.7+) makes disk_mb work"
        )
    return store


def bounded_image_size(data_dir: Path, wanted: int) -> int:
    """``wanted`` bytes, or less: no more than the free space of the host filesystem
    holding ``data_dir`` less its reserve. Raises BackendUnavailable below
    host_disk.MIN_STORE_SIZE."""
    free = host_disk.host_free(data_dir)
    size = max(0, min(wanted, free - host_disk.host_reserve(data_dir))) >> 20 << 20
    if size < host_disk.MIN_STORE_SIZE:
        raise BackendUnavailable(
            f"only {free >> 20} MiB free under {data_dir}: a btrfs store needs at least "
            f"{host_disk.MIN_STORE_SIZE >> 20} MiB beside the host's reserve of "
            f"{host_disk.host_reserve(data_dir) >> 20} MiB"
        )
    log.info(
        "creating the btrfs store image in %s: %d MiB (asked %d MiB; the host has %d MiB free)",
        data_dir, size >> 20, wanted >> 20, free >> 20,
    )
    return size


def _loopback_store(data_dir: Path, image_size: int) -> Store:
    """Mount (or adopt) the btrfs image of ``data_dir``, holding a lock on the image file.

    The lock (flock on the image itself) is what makes adopting a leftover
    mount safe: whoever mounted it cannot still be using it.
    """
    image, mountpoint = data_dir / "store.img", data_dir / "store"
    lock_fd = os.open(image, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    created = False
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreBusy(f"{image} is in use by another branchbox store") from None
        if os.fstat(lock_fd).st_size == 0:
            created = True
            os.ftruncate(lock_fd, bounded_image_size(data_dir, image_size))
        mountpoint.mkdir(exist_ok=True)
        device = _mount_store(image, mountpoint)
    except BaseException:
        os.close(lock_fd)
        if created:
            image.unlink()
        raise
    store = Store(BtrfsBackend(), mountpoint / "volumes")
    store._teardown.append(lambda: os.close(lock_fd))
    store._teardown.append(lambda: _unmount_store(mountpoint, device))
    try:
        store_health.check(mountpoint, image)
        guard = host_disk.HostDiskGuard(image, mountpoint, device, max(image_size,
                                                                       os.stat(image).st_size))
        try:
            guard.fit()  # the host may have less room than when the store last ran
        except OSError as exc:
            raise store_health.StoreUnhealthy(exc.strerror) from None
        guard.start()
        store._teardown.append(guard.stop)
        store.root.mkdir(exist_ok=True)
        _enable_quota(store, mountpoint)
    except BaseException:
        store.close()
        raise
    return store


def _enable_quota(store: Store, mountpoint: Path) -> None:
    """Simple quotas on the daemon's own image (idempotent: an adopted mount has them).

    A kernel without them (before 6.7) leaves the store without limits, said in
    ``no_quota``: full qgroups would work there but make every fork's snapshot
    several times slower, which is the hot path.
    """
    try:
        btrfs.enable_simple_quota(mountpoint)
    except OSError as exc:
        store.no_quota = (
            f"this kernel cannot turn on btrfs simple quotas ({exc.strerror}); "
            "disk limits need Linux 6.7 or later"
        )
        log.warning("btrfs store without per-sandbox disk limits: %s", store.no_quota)
        return
    store.quota = SIMPLE_QUOTAS


def _mount_store(image: Path, mountpoint: Path) -> str:
    """Make ``mountpoint`` show the btrfs in ``image``; return the loop device.

    Errors become BackendUnavailable with the reason a person can act on.
    """
    existing = loopback.mount_at(mountpoint, loopback.current_mounts())
    if existing is not None:
        if loopback.backing_file(existing.source) != os.path.realpath(image):
            raise BackendUnavailable(
                f"{mountpoint} is already mounted from {existing.source}, not from {image}"
            )
        log.info("adopting the btrfs store already mounted at %s", mountpoint)
        return existing.source
    if os.geteuid() != 0:
        raise BackendUnavailable("mounting a btrfs image needs root")
    try:
        if not loopback.has_btrfs_signature(image):
            loopback.format_btrfs(image, label="branchbox")
        # No write barriers: a barrier is a flush of the backing file at every
        # transaction commit, and every snapshot (each fork child's) commits one:
        # measured 1.8-3.2 ms a snapshot without, 3.0-4.3 ms with. The price: the store
        # now also holds files that outlive the daemon (stopped sandboxes, saved and
        # built images), and after a host crash or power loss (not a daemon crash, nor
        # a clean reboot, which flushes) its btrfs may not mount again; the daemon then
        # refuses it and says so (store_health). Workspace commits go to the host's own
        # filesystem with syncfs and do not depend on this.
        # discard=async: blocks btrfs frees are punched out of the image in the
        # background, so the image gives the host back what sandboxes deleted.
        return loopback.mount_image(image, mountpoint, "btrfs", "nobarrier,discard=async")
    except OSError as exc:
        reason = {
            errno.ENODEV: "the kernel has no btrfs support (modprobe btrfs)",
            errno.EPERM: "not permitted to mount (needs CAP_SYS_ADMIN on the host)",
        }.get(exc.errno or 0, str(exc))
        raise BackendUnavailable(reason) from exc


def _unmount_store(mountpoint: Path, device: str) -> None:
    if not loopback.unmount_image(mountpoint, device):
        log.warning(
            "%s was busy: unmounted lazily, %s detaches when its last user exits",
            mountpoint,
            device,
        )
