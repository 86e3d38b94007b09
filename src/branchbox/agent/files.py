"""File operations: read, write, list, exists, remove, stat, mkdir, move.

Paths must be absolute; ``.`` components and repeated or trailing slashes are
normalised away, ``..`` components and NUL are refused, so a path names what
it seems to name to whoever checks it on the way in.

File contents travel as raw frame payloads of at most ``protocol.CHUNK``
bytes, never as one message, so neither side holds a large file whole.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from collections.abc import Iterator
from typing import BinaryIO

from . import protocol
from .server import Agent, RequestError, param

_ERROR_TYPES = {
    errno.ENOENT: "NotFound",
    errno.ENOTDIR: "NotFound",
    errno.EISDIR: "IsADirectory",
    # Refusals the caller can do something about. Anything else (EIO, ENOSPC, ...) is a
    # fault of the environment and reaches the caller as "Internal" with its traceback.
    errno.EACCES: "InvalidRequest",
    errno.EPERM: "InvalidRequest",
    errno.EROFS: "InvalidRequest",
    errno.EEXIST: "InvalidRequest",
    errno.ENOTEMPTY: "InvalidRequest",
    errno.ENAMETOOLONG: "InvalidRequest",
    errno.ELOOP: "InvalidRequest",
    errno.ETXTBSY: "InvalidRequest",  # a program running from that file
    errno.EBUSY: "InvalidRequest",  # a mount point
    errno.EFBIG: "InvalidRequest",  # past a file size limit the REPL's code set
    errno.ENXIO: "InvalidRequest",  # a socket, or a device with nothing behind it
}
_NEW_FILE_MODE = 0o644
UPLOAD_PREFIX = ".bbupload-"  # an upload's temporary file, renamed into place when complete


def check_path(value: str) -> str:
    """The normalised form of an absolute request path; InvalidRequest if it is not one."""
    if "\0" in value:
        raise RequestError("InvalidRequest", "path contains a NUL byte")
    if not value.startswith("/"):
        raise RequestError("InvalidRequest", f"path must be absolute: {value}")
    parts = [part for part in value.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise RequestError("InvalidRequest", f"path must not contain '..': {value}")
    return "/" + "/".join(parts)


def _path(req: dict) -> str:
    return check_path(param(req, "path", str))


@contextlib.contextmanager
def _os_errors(path: str) -> Iterator[None]:
    """Turn the OSErrors a caller can act on into typed request failures."""
    try:
        yield
    except OSError as exc:
        kind = _ERROR_TYPES.get(exc.errno or 0)
        if kind is None:
            raise
        raise RequestError(kind, f"{exc.strerror}: {exc.filename or path}") from exc


def _entry(path: str, st: os.stat_result) -> dict:
    if stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    elif stat.S_ISDIR(st.st_mode):
        kind = "dir"
    elif stat.S_ISREG(st.st_mode):
        kind = "file"
    else:
        kind = "other"
    return {
        "name": os.path.basename(path) or "/",
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
    }


def handle_read(agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """``read`` {path}: "chunk" events carrying the bytes, then done {"size"}."""
    rid = req["rid"]
    path = _path(req)
    with _os_errors(path):
        # O_NONBLOCK: opening a FIFO must not hang the agent; it is refused just below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise RequestError("IsADirectory", f"is a directory: {path}")
        if not stat.S_ISREG(mode):  # /dev/zero would stream forever
            raise RequestError("InvalidRequest", f"not a regular file: {path}")
        size = 0
        while chunk := os.read(fd, protocol.CHUNK):
            agent.check_interrupted()  # nobody reads on: a file may be of any size
            agent.event(rid, "chunk", chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    agent.done(rid, {"size": size})


LIST_CHUNK = 64 * 1024
"""A listing travels as "chunk" events of a JSON array of at most this many bytes: the
daemon checks and passes on each in a moment, whatever the directory holds (one answer
of 200,000 entries held its event loop, and every other sandbox's calls, 1.3 s)."""


def handle_list(agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """``list`` {path}: "chunk" events, each a JSON array of entries, all sorted by name;
    then done {"count"}. Symlinks are not followed."""
    rid = req["rid"]
    path = _path(req)
    with _os_errors(path):
        if not stat.S_ISDIR(os.stat(path).st_mode):
            raise RequestError("InvalidRequest", f"not a directory: {path}")
        entries = []
        with os.scandir(path) as it:
            for n, item in enumerate(it):
                if n % 4096 == 0:
                    agent.check_interrupted()  # nobody waits for it any more
                # An entry removed between readdir and lstat is simply no longer listed.
                with contextlib.suppress(FileNotFoundError):
                    st = item.stat(follow_symlinks=False)
                    entries.append(_entry(os.path.join(path, item.name), st))
    entries.sort(key=lambda entry: entry["name"])
    batch: list[str] = []
    size = 0
    for entry in entries:
        encoded = json.dumps(entry)  # ASCII: a name that is not UTF-8 as \udcXX escapes
        if batch and size + len(encoded) + 2 > LIST_CHUNK:
            _send_entries(agent, rid, batch)
            batch, size = [], 0
        batch.append(encoded)
        size += len(encoded) + 1
    if batch:
        _send_entries(agent, rid, batch)
    agent.done(rid, {"count": len(entries)})


def _send_entries(agent: Agent, rid: int, encoded: list[str]) -> None:
    """One "chunk" of a listing: its entries (each JSON already) as a JSON array."""
    agent.check_interrupted()  # nobody waits for it any more
    agent.event(rid, "chunk", f"[{','.join(encoded)}]".encode())


def handle_stat(agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """``stat`` {path}: done with the entry fields of ``list``, for the path itself."""
    path = _path(req)
    with _os_errors(path):
        st = os.lstat(path)
    agent.done(req["rid"], _entry(path, st))


def handle_exists(agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """``exists`` {path}: done {"exists"}; a dangling symlink exists (list shows it)."""
    agent.done(req["rid"], {"exists": os.path.lexists(_path(req))})


def handle_remove(agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """``remove`` {path, recursive?}: a directory needs recursive=true; done {}."""
    path = _path(req)
    recursive = param(req, "recursive", bool, False)
    if path == "/":
        raise RequestError("InvalidRequest", "refusing to remove /")
    with _os_errors(path):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
        elif recursive:
            shutil.rmtree(path)
        else:
            raise RequestError("InvalidRequest", f"is a directory (use recursive): {path}")
    agent.done(req["rid"], {})


def handle_mkdir(agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """``mkdir`` {path}: the directory and its missing parents; done {"created"}, false if
    a directory was there already."""
    path = _path(req)
    with _os_errors(path):
        if os.path.isdir(path):
            created = False
        else:
            os.makedirs(path)
            created = True
    agent.done(req["rid"], {"created": created, **_entry(path, os.lstat(path))})


def handle_move(agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """``move`` {source, destination}: rename (parents of the destination are made), or
    copy and remove across filesystems; done with the destination's entry."""
    source = check_path(param(req, "source", str))
    destination = check_path(param(req, "destination", str))
    with _os_errors(source):
        os.lstat(source)
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        shutil.move(source, destination)
        st = os.lstat(destination)
    agent.done(req["rid"], _entry(destination, st))


class _Upload:
    """A write in progress: a temporary file beside its target, renamed over it at the end."""

    def __init__(self, target: str, mode: int, append: bool) -> None:
        self.target = target
        self.mode = mode
        parent = os.path.dirname(target)
        os.makedirs(parent, exist_ok=True)
        fd, self.tmp = _new_file(parent)
        self.file: BinaryIO = open(fd, "wb")  # noqa: SIM115 - open across frames
        try:
            if append and os.path.exists(target):
                with open(target, "rb") as old:
                    shutil.copyfileobj(old, self.file)
        except BaseException:
            self.abort()
            raise

    def commit(self) -> int:
        """Put the new content in place; returns the file's size."""
        try:
            self.file.flush()
            os.fchmod(self.file.fileno(), self.mode)
            size = os.fstat(self.file.fileno()).st_size
            self.file.close()
            os.replace(self.tmp, self.target)
        except BaseException:
            self.abort()
            raise
        return size

    def abort(self) -> None:
        self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)


class Uploads:
    """The ``write`` op: a file arrives as several frames sharing one rid.

    The first frame opens the upload, each frame appends its payload, the frame
    with ``more: false`` commits it and alone gets the done. Until then the old
    file is untouched, so a failed or abandoned upload leaves it intact.
    """

    def __init__(self, agent: Agent) -> None:
        self.open: dict[int, _Upload] = {}
        # Rids whose upload failed: their remaining frames are dropped, not taken for a new
        # upload (which would commit a truncated file).
        self.failed: set[int] = set()
        agent.at_fork(self._forget)

    def handle_write(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``write`` {path, mode?, append?, more, abort?} + payload: done {"size"} after the last
        frame; a frame with ``abort: true`` discards the upload (the old file stays)."""
        rid = req["rid"]
        more = param(req, "more", bool, False)
        if param(req, "abort", bool, False):  # the sender gave up: drop what came so far
            self.failed.discard(rid)
            if rid in self.open:
                self.open.pop(rid).abort()
            raise RequestError("InvalidRequest", "upload aborted by the sender")
        if rid in self.failed:
            if not more:
                self.failed.discard(rid)
            return
        upload = self.open.get(rid)
        try:
            if upload is None:
                upload = self.open[rid] = self._start(req)
            with _os_errors(upload.target):
                upload.file.write(payload)
                if more:
                    return
                del self.open[rid]
                size = upload.commit()
        except BaseException:
            if rid in self.open:
                self.open.pop(rid).abort()
            if more:
                self.failed.add(rid)
            raise
        agent.done(rid, {"size": size})

    def _start(self, req: dict) -> _Upload:
        path = _path(req)
        mode = param(req, "mode", int, None)
        if mode is not None and not 0 <= mode <= 0o7777:
            raise RequestError("InvalidRequest", f"invalid mode {mode:#o}")
        append = param(req, "append", bool, False)
        target = os.path.realpath(path)  # write through a symlink, as open() would
        with _os_errors(path):
            if os.path.isdir(target):
                raise RequestError("IsADirectory", f"is a directory: {path}")
            if mode is None:
                try:
                    mode = stat.S_IMODE(os.stat(target).st_mode)
                except FileNotFoundError:
                    mode = _NEW_FILE_MODE
            return _Upload(target, mode, append)

    def _forget(self) -> None:
        # In a forked child: the temporary files are the parent's uploads; only close our copies.
        for upload in self.open.values():
            upload.file.close()
        self.open.clear()
        self.failed.clear()


def _new_file(parent: str) -> tuple[int, str]:
    """A new, empty file of ours in ``parent`` (fd, path), as ``tempfile.mkstemp`` makes
    one: not tempfile itself, which imports random, whose after-fork hook (a reseed)
    every fork child of every REPL would then run (each REPL writes a file at start)."""
    for _ in range(100):
        path = os.path.join(parent, UPLOAD_PREFIX + os.urandom(6).hex())
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            return os.open(path, flags, 0o600), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no unused temporary name in {parent}")
