"""A btrfs filesystem in an image file: sparse file, loop device, mount.

Hosts without btrfs still get O(1) snapshots this way. The loop device is
attached with ``LOOP_CONFIGURE`` and ``LO_FLAGS_AUTOCLEAR``: the kernel
detaches it by itself when the filesystem is unmounted, so there is no
device number to remember and none left over after a crash between steps.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from branchbox.agent import sysc

LOOP_CONTROL = "/dev/loop-control"
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LOOP_SET_CAPACITY = 0x4C07
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16

# struct loop_config {u32 fd; u32 block_size; struct loop_info64 info; u64 reserved[8]}
# is 304 bytes; within it, info.lo_flags sits at 8 + 52 and info.lo_file_name
# (64 bytes) at 8 + 56.
_CONFIG_SIZE = 304
_FLAGS_AT = 60
_FILE_NAME_AT = 64
_FILE_NAME_MAX = 63

# The btrfs superblock lives at 64 KiB; its magic at offset 0x40 within it.
_BTRFS_MAGIC = b"_BHRfS_M"
_BTRFS_MAGIC_AT = 0x10040

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")

class Mount(NamedTuple):
    """One line of /proc/self/mountinfo, the fields this module needs."""

    mountpoint: str
    source: str
    fstype: str


def has_btrfs_signature(image: Path) -> bool:
    """Whether ``image`` already holds a btrfs filesystem (so mkfs is not run twice)."""
    with open(image, "rb") as f:
        f.seek(_BTRFS_MAGIC_AT)
        return f.read(len(_BTRFS_MAGIC)) == _BTRFS_MAGIC


def format_btrfs(image: Path, label: str) -> None:
    """Make a btrfs filesystem on ``image`` (one-time set-up, so the CLI is fine).

    ``--nodiscard`` because the file is freshly sparse: trimming it would only
    cost time.
    """
    mkfs = shutil.which("mkfs.btrfs")
    if mkfs is None:
        raise FileNotFoundError(errno.ENOENT, "mkfs.btrfs not found (install btrfs-progs)")
    proc = subprocess.run(
        [mkfs, "-q", "--nodiscard", "-L", label, os.fspath(image)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        detail = proc.stderr.strip() or f"exit status {proc.returncode}"
        raise OSError(errno.EIO, f"mkfs.btrfs failed: {detail}", os.fspath(image))


@contextmanager
def attached(image: Path) -> Iterator[str]:
    """Attach ``image`` to a free loop device; yield the device path.

    The device auto-clears: once this context closes its descriptor, it stays
    only as long as something (a mount) holds it open.
    """
    if not os.path.exists(LOOP_CONTROL):
        raise FileNotFoundError(
            errno.ENOENT, "no loop device support (modprobe loop)", LOOP_CONTROL
        )
    image_fd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        loop_fd, device = _configure_free_device(image_fd, os.path.abspath(image))
    finally:
        os.close(image_fd)
    try:
        yield device
    finally:
        os.close(loop_fd)


def _configure_free_device(image_fd: int, image_path: str) -> tuple[int, str]:
    """Bind ``image_fd`` to a free loop device, retrying when another process wins the race."""
    config = bytearray(_CONFIG_SIZE)
    struct.pack_into("=I", config, 0, image_fd)
    name = os.fsencode(image_path)[:_FILE_NAME_MAX]
    config[_FILE_NAME_AT : _FILE_NAME_AT + len(name)] = name
    control = os.open(LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(16):
            number = fcntl.ioctl(control, LOOP_CTL_GET_FREE)
            device = f"/dev/loop{number}"
            loop_fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            try:
                _loop_configure(loop_fd, config)
            except OSError as exc:
                os.close(loop_fd)
                if exc.errno == errno.EBUSY:
                    continue
                raise OSError(exc.errno, f"LOOP_CONFIGURE failed: {exc.strerror}", device) from None
            return loop_fd, device
    finally:
        os.close(control)
    raise OSError(errno.EBUSY, "no free loop device after 16 attempts", LOOP_CONTROL)


def _loop_configure(loop_fd: int, config: bytearray) -> None:
    """LOOP_CONFIGURE, with direct I/O when the backing filesystem allows it.

    Direct I/O keeps the image's blocks out of the host page cache; btrfs
    caches them already, and caching twice would double the memory used.
    """
    struct.pack_into("=I", config, _FLAGS_AT, LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO)
    try:
        fcntl.ioctl(loop_fd, LOOP_CONFIGURE, config)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        struct.pack_into("=I", config, _FLAGS_AT, LO_FLAGS_AUTOCLEAR)
        fcntl.ioctl(loop_fd, LOOP_CONFIGURE, config)


def parse_mountinfo(text: str) -> list[Mount]:
    """Mounts listed in mountinfo ``text``, in mount order (later mounts stack on top)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        sep = fields.index("-")
        mounts.append(Mount(_unescape(fields[4]), _unescape(fields[sep + 2]), fields[sep + 1]))
    return mounts


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def current_mounts(mountinfo: Path = Path("/proc/self/mountinfo")) -> list[Mount]:
    """This process's mounts."""
    return parse_mountinfo(mountinfo.read_text())


def mount_at(target: Path, mounts: list[Mount]) -> Mount | None:
    """The visible (topmost) mount at ``target``, if any."""
    where = os.path.realpath(target)
    on_top = [m for m in mounts if m.mountpoint == where]
    return on_top[-1] if on_top else None


def mounts_under(path: Path, mounts: list[Mount]) -> list[str]:
    """Mount points at or below ``path``, deepest first (the order to unmount them in)."""
    top = os.path.realpath(path)
    inside = {
        m.mountpoint for m in mounts if m.mountpoint == top or m.mountpoint.startswith(top + "/")
    }
    return sorted(inside, key=lambda p: p.count("/"), reverse=True)


def superblock_options(target: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> set[str]:
    """The filesystem-wide options of the topmost mount at ``target`` (empty: none there).

    These, not the mount's own options, say whether the filesystem itself went
    read-only: btrfs that aborted a transaction turns its superblock "ro" while the
    mount still reads "rw".
    """
    where = os.path.realpath(target)
    found: set[str] = set()
    for line in mountinfo.read_text().splitlines():
        fields = line.split(" ")
        if _unescape(fields[4]) == where:
            found = set(fields[fields.index("-") + 3].split(","))
    return found


def set_capacity(device: str) -> None:
    """Make loop ``device`` take the current size of its backing file (after a truncate)."""
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, LOOP_SET_CAPACITY)
    finally:
        os.close(fd)


def mount_image(image: Path, target: Path, fstype: str, data: str | None = None) -> str:
    """Attach ``image`` to a loop device and mount it at ``target``; return the device."""
    with attached(image) as device:
        sysc.mount(device, str(target), fstype, 0, data)
    return device


def unmount_image(target: Path, device: str, timeout: float = 5.0) -> bool:
    """Unmount ``target`` and wait for its auto-clearing loop ``device`` to detach.

    A busy filesystem is detached lazily, so the mount disappears at once and
    the device goes when its last user does. Returns whether the device was
    gone within ``timeout`` seconds.
    """
    try:
        sysc.umount2(str(target))
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        sysc.umount2(str(target), sysc.MNT_DETACH)
    deadline = time.monotonic() + timeout
    while backing_file(device) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def backing_file(device: str) -> str | None:
    """The file loop ``device`` is attached to, or None when it is free (or not a loop device)."""
    sysfs = Path("/sys/block", os.path.basename(device), "loop", "backing_file")
    try:
        return sysfs.read_text().rstrip("\n")
    except FileNotFoundError:
        return None
