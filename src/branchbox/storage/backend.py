"""Snapshot backends behind one interface, and picking one for a data directory.

Layers are "volumes": directories the engine creates, snapshots and deletes.
On btrfs a snapshot is O(1) whatever the size; elsewhere it is a full copy.
``choose_backend`` prefers btrfs even on hosts without it, by keeping the
store in a loop-mounted btrfs image file inside the data directory.
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

from branchbox.storage import btrfs, loopback
from branchbox.storage.copyfs import CopyBackend, remove_tree

log = logging.getLogger(__name__)

KINDS = ("auto", "btrfs", "copy")
DEFAULT_IMAGE_SIZE = 64 << 30  # apparent size; the file is sparse and grows as used


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
    _teardown: list[Callable[[], None]] = field(default_factory=list, init=False, repr=False)

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
      the btrfs image ``data_dir/store.img`` (created sparse, ``image_size``
      bytes, on first use; reused after) loop-mounted. Raises
      BackendUnavailable, saying what is missing, when neither works.
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
        return _store(CopyBackend(), data_dir / "volumes")
    if btrfs.is_btrfs(data_dir):
        return _store(BtrfsBackend(), data_dir / "volumes")
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
        return _store(CopyBackend(), data_dir / "volumes")


def _store(backend: SnapshotBackend, root: Path) -> Store:
    root.mkdir(exist_ok=True)
    return Store(backend, root)


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
            os.ftruncate(lock_fd, image_size)
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
        store.root.mkdir(exist_ok=True)
    except BaseException:
        store.close()
        raise
    return store


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
        # No write barriers: the store holds only the layers of live sandboxes, which die
        # with the daemon and which a restarted daemon deletes, and a barrier (a flush of
        # the backing file) is most of what a snapshot costs: 0.6 ms without, 2-3 ms with.
        return loopback.mount_image(image, mountpoint, "btrfs", "nobarrier")
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
