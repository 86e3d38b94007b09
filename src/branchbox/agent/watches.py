"""Directory watches: ``watch``, ``watch_events``, ``unwatch`` (inotify).

A watch is an inotify instance of its own, read by the agent's loop whenever
it is readable, so events are collected while other requests run (not while
user code runs in the REPL: the loop is single-threaded; the kernel queues them
meanwhile). The caller collects them with ``watch_events``; at most
``MAX_PENDING`` wait uncollected, after which the watch says it lost some. A
recursive watch adds a watch for each directory created below it.

Event names are paths relative to the watched directory; kinds are create,
write, remove, rename (for the old name; the new one is a create) and chmod. An
upload (written aside, then renamed into place) is one write of its file.
A forked child starts with no watches (its parent's belong to the parent).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct

from . import sysc
from .files import UPLOAD_PREFIX, check_path
from .server import Agent, RequestError, param

IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_Q_OVERFLOW = 0x100, 0x200, 0x400, 0x4000
IN_ISDIR, IN_IGNORED, IN_ONLYDIR = 0x40000000, 0x8000, 0x01000000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
_HEADER = struct.Struct("iIII")
MAX_PENDING = 10_000
MAX_WATCHES = 64  # per sandbox process: each holds an inotify instance
MAX_DIRS = 8192  # directories one recursive watch follows


def _kind(mask: int) -> str | None:
    if mask & (IN_CREATE | IN_MOVED_TO):
        return "create"
    if mask & IN_MODIFY:
        return "write"
    if mask & IN_DELETE:
        return "remove"
    if mask & IN_MOVED_FROM:
        return "rename"
    if mask & IN_ATTRIB:
        return "chmod"
    return None


class _Watch:
    def __init__(self, agent: Agent, root: str, recursive: bool) -> None:
        self.agent = agent
        self.root = root
        self.recursive = recursive
        self.fd = sysc.libc().inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        self.dirs: dict[int, str] = {}  # watch descriptor -> directory relative to root
        self.pending: list[dict] = []
        self.lost = 0
        self.uploads: set[int] = set()  # rename cookies of uploads moving into place
        try:
            self._add("")
            if recursive:
                for path, dirnames, _ in os.walk(root):
                    for name in dirnames:
                        self._add(os.path.relpath(os.path.join(path, name), root))
        except BaseException:
            os.close(self.fd)
            raise
        agent.watch(self.fd, self._on_readable)

    def _add(self, relative: str) -> None:
        if len(self.dirs) >= MAX_DIRS:
            self.lost += 1
            return
        path = os.path.join(self.root, relative) if relative else self.root
        wd = sysc.libc().inotify_add_watch(self.fd, os.fsencode(path), _MASK | IN_ONLYDIR)
        if wd < 0:
            err = ctypes.get_errno()
            if relative:  # a subdirectory gone again already: nothing to watch
                return
            if err in (2, 20):  # ENOENT, ENOTDIR
                raise RequestError("NotFound", f"no directory {path}")
            raise OSError(err, os.strerror(err), path)
        self.dirs[wd] = relative

    def _on_readable(self) -> None:
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, cookie, size = _HEADER.unpack_from(data, offset)
            raw = data[offset + _HEADER.size: offset + _HEADER.size + size]
            offset += _HEADER.size + size
            name = os.fsdecode(raw.rstrip(b"\0"))
            if mask & IN_Q_OVERFLOW:
                self.lost += 1
                continue
            if mask & IN_IGNORED:
                self.dirs.pop(wd, None)
                continue
            directory = self.dirs.get(wd)
            kind = _kind(mask)
            if directory is None or kind is None:
                continue
            if name.startswith(UPLOAD_PREFIX):  # our own upload's temporary file: its
                if mask & IN_MOVED_FROM:          # rename into place is the event
                    self.uploads.add(cookie)
                continue
            if mask & IN_MOVED_TO and cookie in self.uploads:
                self.uploads.discard(cookie)
                kind = "write"  # an upload landed: the file's new contents

            relative = os.path.join(directory, name) if directory else name
            self._record(relative, kind)
            if self.recursive and kind == "create" and mask & IN_ISDIR:
                self._follow_new(relative)

    def _follow_new(self, relative: str) -> None:
        """Watch a directory created below the root, and report what was made in it
        before its watch existed (``mkdir -p a/b`` makes b before a can be watched)."""
        self._add(relative)
        try:
            with os.scandir(os.path.join(self.root, relative)) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError:  # gone again already
            return
        for entry in entries:
            inner = os.path.join(relative, entry.name)
            self._record(inner, "create")
            if entry.is_dir(follow_symlinks=False):
                self._follow_new(inner)

    def _record(self, name: str, kind: str) -> None:
        if len(self.pending) < MAX_PENDING:
            self.pending.append({"name": name, "type": kind})
        else:
            self.lost += 1

    def take(self) -> dict:
        events, lost = self.pending, self.lost
        self.pending, self.lost = [], 0
        return {"events": events, "lost": lost}

    def close(self, unwatch: bool = True) -> None:
        if unwatch:
            self.agent.unwatch(self.fd)
        os.close(self.fd)


class Watches:
    """This process's watches by id, and the handlers of their ops."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.watches: dict[str, _Watch] = {}
        agent.at_fork(self._forget)

    def handle_watch(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``watch`` {path, recursive?}: done {"id"}."""
        if len(self.watches) >= MAX_WATCHES:
            raise RequestError("Conflict", f"at most {MAX_WATCHES} watches at a time: "
                               "remove one first")
        watch = _Watch(agent, check_path(param(req, "path", str)),
                       param(req, "recursive", bool, False))
        watch_id = os.urandom(16).hex()
        self.watches[watch_id] = watch
        agent.done(req["rid"], {"id": watch_id})

    def handle_watch_events(self, agent: Agent, req: dict, payload: bytes,
                            fds: list[int]) -> None:
        """``watch_events`` {id}: done {"events": [{name, type}], "lost"} since the last."""
        agent.done(req["rid"], self._find(req).take())

    def handle_unwatch(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``unwatch`` {id}: done {}."""
        watch = self._find(req)
        del self.watches[param(req, "id", str)]
        watch.close()
        agent.done(req["rid"], {})

    def _find(self, req: dict) -> _Watch:
        watch = self.watches.get(param(req, "id", str))
        if watch is None:
            raise RequestError("NotFound", "no such watch")
        return watch

    def _forget(self) -> None:
        for watch in self.watches.values():
            with contextlib.suppress(OSError):
                watch.close(unwatch=False)
        self.watches.clear()
