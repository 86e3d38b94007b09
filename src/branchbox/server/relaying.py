"""What the two proxies share: the port proxy's (a client to a server in a sandbox) and the
gateway's (a client to the node that holds the sandbox)."""

from __future__ import annotations

import asyncio
import contextlib

import websockets
from starlette.websockets import WebSocket, WebSocketDisconnect

# RFC 9110 7.6.1: connection-specific headers, never forwarded either way.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade"})


async def relay(ws: WebSocket, upstream: websockets.ClientConnection) -> None:
    """Pass messages between the accepted ``ws`` and ``upstream`` until either side ends;
    then close both."""

    async def client_to_upstream() -> None:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("bytes") is not None:
                await upstream.send(message["bytes"])
            elif message.get("text") is not None:
                await upstream.send(message["text"])

    async def upstream_to_client() -> None:
        async for message in upstream:
            if isinstance(message, bytes):
                await ws.send_bytes(message)
            else:
                await ws.send_text(message)

    tasks = [asyncio.create_task(client_to_upstream()), asyncio.create_task(upstream_to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect,
                                     websockets.WebSocketException, RuntimeError, OSError):
                await task
        await upstream.close()
        with contextlib.suppress(RuntimeError, OSError):
            await ws.close()


def subprotocols(ws: WebSocket) -> list[str] | None:
    """The subprotocols the client offered, to offer upstream in turn."""
    offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",")
               if p.strip()]
    return offered or None
