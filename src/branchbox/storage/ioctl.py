"""ioctl on a mutable buffer without holding the GIL.

Python's ``fcntl.ioctl`` holds the GIL for the whole call once the buffer is over 1024
bytes (it hands the kernel the object's own memory, which another thread could
otherwise resize under it). btrfs's argument structs are 4 KiB and a FIEMAP batch is
14 KiB: a snapshot commits a transaction and a synced FIEMAP writes a file out,
milliseconds in which every thread of the daemon, its event loop included, stood
still, even when the call ran in a worker thread. ctypes lets go of the GIL for the
call; the buffer is exported meanwhile, so it cannot be resized.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]


def ioctl(fd: int, request: int, buffer: bytearray) -> None:
    """``ioctl(fd, request, buffer)``, the kernel reading and writing ``buffer`` in
    place; ``OSError`` with the call's errno on failure."""
    arg = (ctypes.c_char * len(buffer)).from_buffer(buffer)
    if _libc.ioctl(fd, request, arg) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
