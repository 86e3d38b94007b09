"""A build's context: an uploaded tar, checked, never unpacked on the host.

What a client sends is hostile input. The tar is read member by member and kept
only if every member is a plain file, a directory or a symlink under a relative,
``..``-free name, within bounds (members, name length, total size). Nothing is
ever extracted on the host: a ``COPY`` takes the matching members into a new tar
(owned by root, setuid/setgid/sticky bits dropped) that the sandbox of the step
unpacks inside itself, where any symlink it meets is the sandbox's own. So no
context can reach outside itself or plant a special or setuid file.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import posixpath
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAX_MEMBERS = 100_000
MAX_NAME = 4096
_SAFE_MODE = 0o777  # what COPY keeps of a mode: never setuid, setgid or sticky


class ContextError(ValueError):
    """The context cannot be used; the message says which member and why."""


@dataclass(frozen=True)
class Entry:
    name: str  # relative, normalized, no leading "./"
    kind: str  # "file" | "dir" | "symlink"
    mode: int
    size: int
    link: str = ""
    offset: int = 0  # of the data in the tar file
    mtime: int = 0


class Context:
    """The checked members of a context tar at ``path`` (None: an empty context); member
    ``exclude`` (the spec) is left out of what COPY sees."""

    def __init__(self, path: Path | None, *, exclude: str | None = None) -> None:
        self.path = path
        self.entries: dict[str, Entry] = {}  # what COPY sees
        self._excluded: Entry | None = None
        if path is not None:
            self._read(path, exclude and posixpath.normpath(exclude))

    def _read(self, path: Path, exclude: str | None) -> None:
        try:
            with tarfile.open(path, "r:") as tar:
                for count, member in enumerate(tar, 1):
                    if count > MAX_MEMBERS:
                        raise ContextError(f"the context has more than {MAX_MEMBERS} entries")
                    entry = _entry(member)
                    if entry is not None and entry.name == exclude:
                        self._excluded = entry
                    elif entry is not None:
                        self.entries[entry.name] = entry
        except (tarfile.TarError, EOFError, UnicodeError) as exc:
            raise ContextError(f"the context is not a valid tar: {exc}") from None

    def spec_text(self, name: str, limit: int) -> str:
        """The text of member ``name`` (the spec sent inside the context)."""
        entry = self._excluded if self._excluded and self._excluded.name == posixpath.normpath(
            name) else self.entries.get(posixpath.normpath(name))
        if entry is None or entry.kind != "file":
            raise ContextError(f"the context has no file {name!r} (the spec)")
        if entry.size > limit:
            raise ContextError(f"the spec {name!r} is larger than {limit} bytes")
        with open(self.path, "rb") as f:  # type: ignore[arg-type]
            f.seek(entry.offset)
            try:
                return f.read(entry.size).decode()
            except UnicodeDecodeError:
                raise ContextError(f"the spec {name!r} is not UTF-8 text") from None

    def select(self, sources: list[str]) -> list[tuple[Entry, str]]:
        """The entries ``COPY sources... dest`` takes, each with its path relative to the
        destination: a file as its own name, a directory's contents below it (as Docker).
        A source that matches nothing is a ContextError."""
        chosen: dict[str, tuple[Entry, str]] = {}
        for source in sources:
            pattern = posixpath.normpath(source.lstrip("/"))
            roots = ([name for name in self.entries if fnmatch.fnmatchcase(name, pattern)]
                     if pattern != "." else ["."])
            if not roots:
                raise ContextError(f"COPY source {source!r} matches nothing in the context")
            for root in roots:
                entry = self.entries.get(root)
                if entry is not None and entry.kind != "dir":
                    chosen[root] = (entry, posixpath.basename(root))
                    continue
                prefix = "" if root == "." else root + "/"
                for name, below in self.entries.items():
                    if name.startswith(prefix) and name != root:
                        chosen[name] = (below, name[len(prefix):])
        return sorted(chosen.values(), key=lambda pair: pair[1])

    def digest(self, chosen: list[tuple[Entry, str]]) -> str:
        """A content hash of what a COPY takes (names, kinds, modes, bytes, link targets):
        part of the step's cache key, so a changed source is a new layer."""
        h = hashlib.sha256()
        for entry, rel in chosen:
            h.update(f"{rel}\0{entry.kind}\0{entry.mode & _SAFE_MODE:o}\0{entry.link}\0"
                     f"{entry.size}\0".encode())
            if entry.kind == "file":
                for chunk in self._chunks(entry):
                    h.update(chunk)
        return h.hexdigest()

    def copy_tar(self, chosen: list[tuple[Entry, str]], dest: str, out: BinaryIO,
                 dest_is_dir: bool) -> None:
        """Write to ``out`` a tar of ``chosen`` placed at absolute path ``dest`` (a single
        file is ``dest`` itself unless ``dest_is_dir``), root's, safe modes only."""
        with tarfile.open(fileobj=out, mode="w:", format=tarfile.PAX_FORMAT) as tar:
            for entry, rel in chosen:
                target = dest if (not dest_is_dir and len(chosen) == 1
                                  and entry.kind != "dir") else posixpath.join(dest, rel)
                info = tarfile.TarInfo(target.lstrip("/"))
                info.mode = entry.mode & _SAFE_MODE
                info.uid = info.gid = 0
                info.mtime = entry.mtime
                if entry.kind == "dir":
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                elif entry.kind == "symlink":
                    info.type, info.linkname = tarfile.SYMTYPE, entry.link
                    tar.addfile(info)
                else:
                    info.size = entry.size
                    tar.addfile(info, _Reader(self._chunks(entry)))

    def _chunks(self, entry: Entry):
        with open(self.path, "rb") as f:  # type: ignore[arg-type]
            f.seek(entry.offset)
            left = entry.size
            while left:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    raise ContextError(f"the context ends inside {entry.name!r}")
                left -= len(chunk)
                yield chunk


class _Reader(io.RawIOBase):
    """A file-like view of a chunk iterator (what tarfile.addfile reads from)."""

    def __init__(self, chunks) -> None:
        self._chunks, self._rest = chunks, b""

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._rest) < size:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._rest += chunk
        out, self._rest = (self._rest, b"") if size < 0 else (self._rest[:size],
                                                                self._rest[size:])
        return out


def _entry(member: tarfile.TarInfo) -> Entry | None:
    """The checked entry of ``member``, or None for the context's own root."""
    raw = member.name
    if len(raw) > MAX_NAME or "\0" in raw:
        raise ContextError(f"context entry name too long or invalid: {raw[:80]!r}")
    name = posixpath.normpath(raw)
    if raw.startswith("/") or name == ".." or name.startswith("../"):
        raise ContextError(f"context entry {raw!r} is outside the context")
    if name == ".":
        return None
    mtime = max(0, int(member.mtime))
    if member.isfile():
        return Entry(name, "file", member.mode, member.size, offset=member.offset_data,
                     mtime=mtime)
    if member.isdir():
        return Entry(name, "dir", member.mode, 0, mtime=mtime)
    if member.issym():
        if len(member.linkname) > MAX_NAME or "\0" in member.linkname:
            raise ContextError(f"context symlink {raw!r} has an invalid target")
        return Entry(name, "symlink", stat.S_IMODE(member.mode) or 0o777, 0,
                     link=member.linkname, mtime=mtime)
    what = "a hard link" if member.islnk() else "a special file"
    raise ContextError(f"context entry {raw!r} is {what}; only files, directories and "
                       "symlinks can be copied")
