"""What changed between two related btrfs subvolumes, read from the kernel's send stream.

A fork's parent keeps writing to its own volume while its children stand on a
snapshot of it, so a diff of parent and child has two unshared layers that are
nearly the same: walking them both cost time in proportion to all the parent ever
wrote (200,000 files: past the diff's 10 s budget, for a child that changed nothing).
btrfs knows what differs: ``send`` compares the two trees and skips the blocks they
share, so its stream (here without file data) costs what changed since the snapshot.
This module turns that stream into paths.

The stream's format is the kernel's (``fs/btrfs/send.h``, version 1): a magic and a
version, then commands ``{le32 length, le16 command, le32 crc}`` each followed by
attributes ``{le16 type, le16 length, data}``. A path is relative to the subvolume
root and may be any bytes. New inodes first appear under temporary names at the root
(``o<ino>-<gen>-<n>``) and are renamed into place; a directory moved or removed is
one rename, not a command per file below it.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from branchbox.storage import btrfs

MAGIC = b"btrfs-stream\0"
_VERSION = struct.Struct("<I")
_COMMAND = struct.Struct("<IHI")
_ATTRIBUTE = struct.Struct("<HH")
_MAX_COMMAND = 1 << 20  # far above what a command without file data carries

# Commands (version 1) whose path, and what lies below it, may differ as a whole: an
# entry moved, removed or made (a new file or whiteout may hide a directory below it
# in the layers under this one), or an xattr changed (the opaque mark).
_SUBVOL, _SNAPSHOT, _END = 1, 2, 21
_WHOLE = {3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14}  # mkfile, mknod..symlink, rename..xattrs
_PATH, _PATH_TO = 15, 16


class StreamError(Exception):
    """The send stream is not one this parser reads (a newer version, a cut stream)."""


@dataclass(frozen=True)
class Change:
    """A path (below the subvolume root, as bytes) that differs; ``whole``: what lies
    below it may differ too (a directory moved or removed, an entry made or an xattr
    set), so it has to be looked at in full."""

    path: bytes
    whole: bool


def changes(snapshot: Path, parent_treeid: int,
            check: Callable[[], None]) -> Iterator[Change]:
    """What differs between read-only subvolume ``snapshot`` and the read-only one of
    tree ``parent_treeid``, in the stream's order; ``check()`` is called between
    commands and may raise to stop (the kernel's send then ends at its next write)."""
    failed: list[OSError] = []
    read_end, write_end = os.pipe2(os.O_CLOEXEC)

    def send() -> None:
        try:
            btrfs.send_changes(snapshot, parent_treeid, write_end)
        except OSError as exc:
            failed.append(exc)
        finally:
            os.close(write_end)

    sender = threading.Thread(target=send, name="bb-send", daemon=True)
    try:
        sender.start()
    except BaseException:  # no thread to be had: neither end is anyone's
        os.close(read_end)
        os.close(write_end)
        raise
    try:
        with os.fdopen(read_end, "rb", buffering=1 << 16) as stream:
            try:
                yield from _parse(stream, check)
            except StreamError:
                sender.join()
                if failed:  # the stream was cut by the kernel's refusal: say that
                    raise failed[0] from None
                raise
    finally:  # the read end is closed: a sender still writing gets EPIPE and ends
        sender.join()


def _parse(stream: BinaryIO, check: Callable[[], None]) -> Iterator[Change]:
    if _exact(stream, len(MAGIC)) != MAGIC:
        raise StreamError("not a btrfs send stream")
    (version,) = _VERSION.unpack(_exact(stream, _VERSION.size))
    if version != 1:
        raise StreamError(f"send stream version {version}")
    while True:
        check()
        length, command, _crc = _COMMAND.unpack(_exact(stream, _COMMAND.size))
        if length > _MAX_COMMAND:
            raise StreamError(f"a command of {length} bytes")
        if command == _END:
            return
        body = _exact(stream, length)
        if command in (_SUBVOL, _SNAPSHOT):
            continue  # names the subvolume itself
        whole = command in _WHOLE
        for kind, value in _attributes(body):
            if kind in (_PATH, _PATH_TO):  # a rename's new name is its PATH_TO
                yield Change(value, whole)


def _attributes(body: bytes) -> Iterator[tuple[int, bytes]]:
    at = 0
    while at < len(body):
        if at + _ATTRIBUTE.size > len(body):
            raise StreamError("an attribute header past its command's end")
        kind, length = _ATTRIBUTE.unpack_from(body, at)
        at += _ATTRIBUTE.size
        if at + length > len(body):
            raise StreamError("an attribute past its command's end")
        yield kind, body[at:at + length]
        at += length


def _exact(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise StreamError("the send stream ended early")
    return data
