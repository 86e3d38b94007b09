"""``sandbox.files``: the sandbox's filesystem, with file contents streamed both ways."""

from __future__ import annotations

import builtins
import os
from collections.abc import AsyncIterator
from typing import IO, TYPE_CHECKING
from urllib.parse import quote

if TYPE_CHECKING:
    from branchbox.sdk._async import AsyncSandbox

CHUNK = 1 << 20
Data = bytes | bytearray | memoryview | str | IO[bytes] | IO[str]


class AsyncFiles:
    """Paths are absolute paths inside the sandbox."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    def _url(self, path: str, suffix: str = "", **more: str) -> str:
        """The URL of a call on ``path``, which goes as its bytes, percent-encoded: a name
        that is not UTF-8, as a listing gives it (``os.fsdecode``), names the same file
        (httpx would refuse to encode it)."""
        given = [("path", os.fsencode(path)), *((k, v.encode()) for k, v in more.items())]
        query = "&".join(f"{key}={quote(value, safe='/')}" for key, value in given)
        return self._sandbox._url(f"/files{suffix}?{query}")

    async def read(self, path: str) -> bytes:
        """The whole file (use ``read_stream`` for files too large to hold in memory)."""
        return b"".join([chunk async for chunk in self.read_stream(path)])

    async def read_stream(self, path: str) -> AsyncIterator[bytes]:
        """The file's contents in chunks, as they arrive."""
        async with self._sandbox._api.stream("GET", self._url(path)) as reply:
            async for chunk in reply.aiter_bytes():
                yield chunk

    async def write(self, path: str, data: Data, *, mode: int | None = None) -> None:
        """Store ``data`` at ``path``, creating parent directories.

        ``data`` may be bytes, text (stored as UTF-8) or a file object opened for
        reading, which is sent in chunks without being read whole. ``mode`` sets the
        permission bits (e.g. ``0o755``).
        """
        more = {} if mode is None else {"mode": format(mode, "o")}
        await self._sandbox._api.call("PUT", self._url(path, **more), content=_content(data))

    async def list(self, path: str) -> builtins.list[dict]:
        """The entries of a directory."""
        reply = await self._sandbox._api.call("GET", self._url(path, "/list"))
        return reply["entries"]

    async def exists(self, path: str) -> bool:
        reply = await self._sandbox._api.call("GET", self._url(path, "/exists"))
        return bool(reply["exists"])

    async def stat(self, path: str) -> dict:
        """Type, size, mode and times; raises ``FileNotFound`` if there is nothing there."""
        return await self._sandbox._api.call("GET", self._url(path, "/stat"))

    async def remove(self, path: str, recursive: bool = False) -> None:
        """Delete a file, or a directory (non-empty ones need ``recursive=True``)."""
        await self._sandbox._api.call("DELETE", self._url(path, recursive=str(recursive).lower()))


def _content(data: Data) -> bytes | AsyncIterator[bytes]:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    if hasattr(data, "read"):
        return _chunks(data)
    raise TypeError(f"files.write() takes bytes, str or a readable file, not "
                    f"{type(data).__name__}")


async def _chunks(source: IO[bytes] | IO[str]) -> AsyncIterator[bytes]:
    while chunk := source.read(CHUNK):
        yield chunk.encode() if isinstance(chunk, str) else chunk
