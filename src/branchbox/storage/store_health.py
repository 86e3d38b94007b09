"""Refusing a btrfs store that is not fit to hold sandboxes, with what to do about it.

A btrfs that aborted a transaction (the host disk under its image ran full, or an
I/O error) turns read-only and stays so: adopting it as it was made every sandbox
fail with EROFS and every restart with EIO (issue 16, finding 1). A daemon checks
its store when it mounts or adopts it, and refuses one that is read-only, whose
device has recorded I/O or checksum errors (``btrfs device stats``; they persist
on disk across mounts), or where a small write does not go through.
"""

from __future__ import annotations

import os
from pathlib import Path

from branchbox.storage import btrfs, loopback

_PROBE = ".branchbox-health-probe"


class StoreUnhealthy(RuntimeError):
    """The store cannot be used safely; the message says why and how to start afresh."""


def problems(mountpoint: Path) -> list[str]:
    """What is wrong with the btrfs mounted at ``mountpoint`` (empty: nothing found)."""
    found = []
    if "ro" in loopback.superblock_options(mountpoint):
        found.append("it is read-only (btrfs aborted a transaction: the disk under it ran "
                     "full or failed)")
    try:
        counters = btrfs.device_errors(mountpoint)
    except OSError as exc:
        found.append(f"its device error counters cannot be read ({exc.strerror})")
    else:
        if counters:
            found.append("its device recorded errors (" + ", ".join(
                f"{name} {count}" for name, count in counters.items()) + ")")
    probe = mountpoint / _PROBE
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        found.append(f"a test write into it failed ({exc.strerror})")
    return found


def check(mountpoint: Path, image: Path) -> None:
    """Raise StoreUnhealthy, saying what to do, if the store at ``mountpoint`` is unfit."""
    found = problems(mountpoint)
    if found:
        raise StoreUnhealthy(
            f"the btrfs store in {image} (mounted at {mountpoint}) is unhealthy: "
            f"{'; '.join(found)}. What it holds (sandboxes' files, saved images) cannot be "
            "trusted; copy out what you need while it can still be mounted (read-only: "
            f"`mount -o ro,loop {image} /mnt`). To start with a new store: stop every "
            "branchbox daemon of this data directory, make room on the host disk if it is "
            f"full, run `umount {mountpoint}` (if it is still mounted) and `rm {image}`, "
            "then start the daemon again; it creates a new store.")
