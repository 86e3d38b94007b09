"""Keeping a loop-mounted store inside the host disk that holds its image file.

The store is a sparse image: every block btrfs writes for the first time takes a
block of the host's disk. If the host runs out first, the loop device fails that
write with an I/O error and btrfs aborts its transaction: the whole store turns
read-only for every sandbox, data a sandbox already "synced" is lost, and nothing
works until the store is recreated (issue 16, finding 1). A full *store*, on the
other hand, is harmless: btrfs answers the writer ENOSPC and carries on.

So the store's size follows the host: at most what the image holds already plus
the host's free space, minus a reserve left for the host (its own logs, the
daemon's SQLite, other users). :class:`HostDiskGuard` checks that every
``CHECK_INTERVAL`` seconds (a stat and a statvfs) and resizes the store online:
btrfs first (shrinking moves data out of the cut-off end), then the image file
and the loop device, so the image never extends past the filesystem it holds; it
grows back, up to the size the store was asked to have, when the host has room
again. Blocks btrfs frees go back to the host: the store is mounted with
``discard=async`` (the loop device punches holes in the image) and the guard
trims the free space when the image holds much more than btrfs uses.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from branchbox.storage import btrfs, loopback

log = logging.getLogger(__name__)

MIN_STORE_SIZE = 256 << 20  # below this mkfs.btrfs and a few sandboxes do not fit
# Left free on the host: 5% of its disk, between these bounds.
RESERVE_SHARE = 0.05
MIN_RESERVE = 64 << 20
MAX_RESERVE = 2 << 30
# Seconds between checks, read at each one.
CHECK_INTERVAL = 1.0
# Grow only by at least this much (a resize is a transaction; no churn near a boundary).
GROW_STEP = 256 << 20
# Trim when the image holds this much more than btrfs uses, at most every TRIM_INTERVAL s.
TRIM_SLACK = 128 << 20
TRIM_INTERVAL = 30.0

FITRIM = 0xC0185879  # _IOWR('X', 121, struct fstrim_range {u64 start, len, minlen})


def host_reserve(path: Path) -> int:
    """Bytes to leave free on the filesystem holding ``path``."""
    st = os.statvfs(path)
    share = int(st.f_blocks * st.f_frsize * RESERVE_SHARE)
    return min(MAX_RESERVE, max(MIN_RESERVE, share))


def host_free(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def image_host_bytes(image: Path) -> int:
    """Bytes of the host's disk ``image`` takes (its allocated blocks, not its size)."""
    return os.stat(image).st_blocks * 512


def fitting_size(image: Path, wanted: int) -> int:
    """The size (MiB-aligned) the store in ``image`` may have now: ``wanted`` at most, and
    no more than the host can back (what the image holds plus the host's free space,
    less the reserve). May be below MIN_STORE_SIZE: the caller decides what that means."""
    room = image_host_bytes(image) + host_free(image.parent) - host_reserve(image.parent)
    return max(0, min(wanted, room)) >> 20 << 20


def trim(mountpoint: Path) -> int:
    """Discard every free block of the filesystem at ``mountpoint``; returns the bytes
    trimmed, as the kernel reports them (the loop device punches them out of the image)."""
    rng = bytearray(struct.pack("=QQQ", 0, (1 << 64) - 1, 0))
    fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FITRIM, rng, True)
    finally:
        os.close(fd)
    return struct.unpack_from("=QQQ", rng)[1]


@dataclass(eq=False)
class HostDiskGuard:
    """Keeps the store mounted at ``mountpoint`` from ``image`` (loop ``device``) within
    the host's free space; ``max_size`` is the most it may grow to."""

    image: Path
    mountpoint: Path
    device: str
    max_size: int
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _last_trim: float = field(default=0.0, repr=False)
    _last_error: str = field(default="", repr=False)

    def fit(self) -> int:
        """Resize the store to what the host can back now; return its size.

        Raises OSError(ENOSPC) when the store cannot shrink enough (it holds more than
        the host could back) or the host has room for less than MIN_STORE_SIZE: then
        writes that need new host blocks could abort it.
        """
        size = os.stat(self.image).st_size
        fitting = fitting_size(self.image, self.max_size)
        target = max(MIN_STORE_SIZE, fitting)
        # Not for every MiB another user of the host writes (each resize is a btrfs
        # transaction): a deficit of a quarter of the reserve leaves the rest of it free.
        if target < size - host_reserve(self.image.parent) // 4:
            self._shrink(size, target)
            size = target
        if fitting < MIN_STORE_SIZE:
            raise OSError(errno.ENOSPC, (
                f"the host disk under {self.image} is nearly full: room for "
                f"{fitting >> 20} MiB of store, less than the {MIN_STORE_SIZE >> 20} MiB "
                "minimum; free space on it"), os.fspath(self.image))
        if target - size >= GROW_STEP:
            self._grow(size, target)
            return target
        return size

    def _shrink(self, size: int, target: int) -> None:
        try:
            btrfs.resize(self.mountpoint, target)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"the host disk under {self.image} has room for a store of "
                f"{target >> 20} MiB, but the store holds more than that and cannot shrink "
                f"({exc.strerror}): free space on the host, or close sandboxes",
                os.fspath(self.image)) from None
        os.truncate(self.image, target)
        loopback.set_capacity(self.device)
        log.warning("host disk low: the store at %s shrank from %d to %d MiB",
                    self.mountpoint, size >> 20, target >> 20)

    def _grow(self, size: int, target: int) -> None:
        os.truncate(self.image, target)
        loopback.set_capacity(self.device)
        btrfs.resize(self.mountpoint, None)
        log.info("the store at %s grew from %d to %d MiB (host disk has room again)",
                 self.mountpoint, size >> 20, target >> 20)

    def trim_if_slack(self) -> None:
        """Give freed blocks back to the host when the image holds much more than btrfs
        uses (discard=async gets there too, but only after minutes)."""
        if time.monotonic() - self._last_trim < TRIM_INTERVAL:
            return
        st = os.statvfs(self.mountpoint)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        if image_host_bytes(self.image) - used > max(TRIM_SLACK, used // 10):
            self._last_trim = time.monotonic()
            trim(self.mountpoint)

    def start(self) -> None:
        """Check in a thread every CHECK_INTERVAL seconds until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="host-disk-guard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL):
            try:
                self.fit()
                self.trim_if_slack()
            except OSError as exc:
                # Logged once per new message: the log is the operator's only signal here.
                if str(exc) != self._last_error:
                    self._last_error = str(exc)
                    log.error("checking the host disk under %s: %s", self.image, exc)
            else:
                self._last_error = ""
