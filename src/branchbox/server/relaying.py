"""What the two proxies share: the port proxy's (a client to a server in a sandbox) and the
gateway's (a client to the node that holds the sandbox).

A relay holds a bounded amount of memory whatever either side does, and ends promptly
once either side leaves. The upstream may be a sandbox's server, so hostile:
:class:`SandboxConnection` bounds what it makes the daemon hold or compute at a time
(measured before it, one server flooding pings grew the daemon ~25 MiB/s for as long as
its client stayed, and a flood of tiny messages stalled every other sandbox for seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import websockets
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import ClientConnection
from websockets.protocol import OPEN

# RFC 9110 7.6.1: connection-specific headers, never forwarded either way.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade"})
CLOSE_TIMEOUT = 3.0
"""Seconds a side has to take our close before its connection is dropped: one that does
not read would otherwise hold the relay (and what it buffered) for ever."""
SEND_STALL = 30.0
"""Seconds one message may wait for the upstream to take it (nginx's proxy_send_timeout,
60 s, is the same idea): a server that never reads ends the relay instead of holding it,
also when its client left meanwhile (unseen while we are stuck sending to it)."""
FEED_SLICE = 4096
"""Bytes of the upstream's stream parsed per turn of the event loop. One read is up to
256 KiB, which as two-byte frames is 131,072 of them: ~0.6 s of parsing with nothing else
running; 4 KiB of them is ~10 ms."""
_PONG = b"\x8a"  # the first byte of a whole Pong frame (FIN, opcode 0xA)


class SandboxConnection(ClientConnection):
    """A client connection that takes from its server only what it can pass on.

    * Its bytes are parsed ``FEED_SLICE`` at a time, one slice per turn of the loop, and
      reading stops until they are (the kernel holds the rest, within its own bounds).
    * Messages wait in no queue: reading stops from the first complete one until the relay
      takes it (``max_queue=0``), so a client that reads nothing holds back the server.
    * Pings are answered, but while the server does not read what we send, only the latest
      one (RFC 6455 5.5.3 allows it), once it reads again: automatic pongs were the one
      thing written without flow control, so a server that pinged and never read grew
      our write buffer without bound.
    """

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._unfed = memoryview(b"")
        self._feeding: asyncio.Handle | None = None
        self._held_pong: bytes | None = None
        self.recv_messages.resume = self._read_on  # was transport.resume_reading

    def data_received(self, data: bytes) -> None:
        self.transport.pause_reading()  # until all of it is fed
        self._unfed = memoryview(data)
        self._feed()

    def _feed(self) -> None:
        self._feeding = None
        if self.recv_messages.paused or not self._unfed:  # (none once the connection is lost)
            return
        chunk, self._unfed = self._unfed[:FEED_SLICE], self._unfed[FEED_SLICE:]
        super().data_received(bytes(chunk))
        self._read_on()

    def _read_on(self) -> None:
        """Feed the next slice on a later turn of the loop, or read once all are fed;
        neither while a message waits for the relay."""
        if self.recv_messages.paused:
            return
        if not self._unfed:
            self.transport.resume_reading()
        elif self._feeding is None:
            self._feeding = self.loop.call_soon(self._feed)

    def send_data(self) -> None:
        if self.paused:  # over the write limit: the server is not reading what we send
            writes = self.protocol.writes
            pongs = [w for w in writes if w[:1] == _PONG]
            if pongs:
                self._held_pong = pongs[-1]
                self.protocol.writes = [w for w in writes if w[:1] != _PONG]
        super().send_data()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._held_pong is not None:
            self.loop.call_soon(self._send_held_pong)  # not from inside the transport's flush

    def _send_held_pong(self) -> None:
        pong, self._held_pong = self._held_pong, None
        if pong is not None and self.protocol.state is OPEN and not self.transport.is_closing():
            self.transport.write(pong)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._feeding is not None:
            self._feeding.cancel()
        self._unfed = memoryview(b"")
        super().connection_lost(exc)


async def relay(ws: WebSocket, upstream: websockets.ClientConnection,
                until: Callable[[], Awaitable[None]] | None = None) -> None:
    """Pass messages between the accepted ``ws`` and ``upstream`` until either side ends,
    or ``until()`` returns (the sandbox is gone: its address may never answer again, and
    a quiet connection to it would stay until keepalive gave up); then close both (each
    within ``CLOSE_TIMEOUT``)."""
    handoff: asyncio.Queue[str | bytes] = asyncio.Queue(maxsize=1)

    async def from_client() -> None:
        """The client's messages, one read ahead of the one being sent: its leaving is
        seen while a slow server holds up the sending, unless another message of its
        waits too (then SEND_STALL ends the relay)."""
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(CLOSE_TIMEOUT):  # what it sent before still goes
                        await handoff.join()
                return
            data = message.get("bytes")
            await handoff.put(data if data is not None else message.get("text") or "")

    async def to_upstream() -> None:
        while True:
            data = await handoff.get()
            async with asyncio.timeout(SEND_STALL):
                await upstream.send(data)
            handoff.task_done()

    async def upstream_to_client() -> None:
        async for message in upstream:
            if isinstance(message, bytes):
                await ws.send_bytes(message)
            else:
                await ws.send_text(message)
            await asyncio.sleep(0)  # a flood of small messages takes turns with the rest

    works = (from_client, to_upstream, upstream_to_client, *([until] if until else []))
    tasks = [asyncio.create_task(work()) for work in works]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect, TimeoutError,
                                     websockets.WebSocketException, RuntimeError, OSError):
                await task
        await _close_upstream(upstream)
        with contextlib.suppress(RuntimeError, OSError, TimeoutError):
            async with asyncio.timeout(CLOSE_TIMEOUT):  # a client that does not read
                await ws.close()


async def _close_upstream(upstream: websockets.ClientConnection) -> None:
    """The closing handshake, or the connection dropped if it does not end in time (a
    server that does not read never lets our close frame out of the send buffer)."""
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT):
            await upstream.close()
    except TimeoutError:
        upstream.transport.abort()


def subprotocols(ws: WebSocket) -> list[str] | None:
    """The subprotocols the client offered, to offer upstream in turn."""
    offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",")
               if p.strip()]
    return offered or None
