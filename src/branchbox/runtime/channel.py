"""The daemon's end of a sandbox's control socket (asyncio, frames of agent.protocol).

One reader task per channel routes frames to the request they answer (by
``rid``), so a background command can be waited on while other requests are
answered. The raw socket is used instead of asyncio streams because fork
requests carry file descriptors (SCM_RIGHTS).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import AsyncIterator

from branchbox.agent import protocol
from branchbox.agent.protocol import ChannelClosed


class AgentError(Exception):
    """A request the agent answered with ``fail``: ``kind`` is its error type."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class AgentChannel:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Queue] = {}
        self._send_lock = asyncio.Lock()
        self.closed = asyncio.Event()
        self._reader = self._loop.create_task(self._read_loop())

    async def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = await self._loop.sock_recv(self.sock, n - len(buf))
            if not chunk:
                raise ChannelClosed("control channel closed")
            buf += chunk
        return bytes(buf)

    async def _read_loop(self) -> None:
        import json

        try:
            while True:
                hlen, plen = protocol.decode_header(await self._recv_exact(8))
                header = json.loads(await self._recv_exact(hlen))
                payload = await self._recv_exact(plen) if plen else b""
                queue = self._pending.get(header.get("rid"))
                if queue is not None:
                    queue.put_nowait((header, payload))
        except (ChannelClosed, OSError, ValueError):
            pass
        finally:
            self.closed.set()
            for queue in self._pending.values():
                queue.put_nowait(None)

    async def send(self, header: dict, payload: bytes = b"", fds: list[int] = ()) -> None:
        data = protocol.encode(header, payload)
        async with self._send_lock:
            if fds:
                while True:
                    try:
                        sent = socket.send_fds(self.sock, [data], list(fds))
                        break
                    except BlockingIOError:
                        await asyncio.sleep(0.0005)
                data = data[sent:]
            if data:
                await self._loop.sock_sendall(self.sock, data)

    def open_request(self) -> tuple[int, asyncio.Queue]:
        rid = next(self._rids)
        return rid, self.expect(rid)

    def expect(self, rid: int) -> asyncio.Queue:
        """Route frames with ``rid`` to a new queue (rid 0: a fork child's hello)."""
        queue: asyncio.Queue = asyncio.Queue()
        self._pending[rid] = queue
        return queue

    def close_request(self, rid: int) -> None:
        self._pending.pop(rid, None)

    async def events(self, rid: int, queue: asyncio.Queue) -> AsyncIterator[tuple[dict, bytes]]:
        """Yield the events of request ``rid`` up to and including its ``done``."""
        try:
            while True:
                if self.closed.is_set() and queue.empty():
                    raise ChannelClosed("the sandbox's REPL process is gone")
                item = await queue.get()
                if item is None:
                    raise ChannelClosed("the sandbox's REPL process is gone")
                header, payload = item
                ev = header.get("ev")
                if ev == "fail":
                    err = header.get("error") or {}
                    raise AgentError(err.get("type", "Internal"), err.get("message", ""))
                yield header, payload
                if ev == "done":
                    return
        finally:
            self.close_request(rid)

    async def stream(
        self, op: str, args: dict | None = None, payload: bytes = b"", fds: list[int] = ()
    ) -> AsyncIterator[tuple[dict, bytes]]:
        rid, queue = self.open_request()
        await self.send({"op": op, "rid": rid, **(args or {})}, payload, fds)
        async for item in self.events(rid, queue):
            yield item

    async def call(
        self, op: str, args: dict | None = None, payload: bytes = b"", fds: list[int] = ()
    ) -> dict:
        result: dict = {}
        async for header, _ in self.stream(op, args, payload, fds):
            if header.get("ev") == "done":
                result = header.get("result") or {}
        return result

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self.sock.close()
        self.closed.set()
