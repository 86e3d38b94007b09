"""The calls WebSocket through the gateway: one client connection, a connection per node.

The SDK sends every run, fork, merge, checkpoint and restore of all its sandboxes down
one ``/v1/calls`` connection (``server.call_channel``), so one connection carries calls
for sandboxes on several nodes. The gateway reads each message's sandbox, opens (once)
a connection to that sandbox's node and passes the message on unchanged; the node's
lines come back unchanged too (run ids are the client's, unique on its connection). A
cancel goes where its run went. A node whose connection drops ends each of its runs
with an error line (503 ``NodeUnavailable``); when the client hangs up, every node
connection closes, which abandons its runs as the node does for any client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import websockets
from starlette.websockets import WebSocket, WebSocketDisconnect

from branchbox.gateway.forward import Credentials
from branchbox.gateway.nodes import Node, Nodes, Unroutable

log = logging.getLogger("branchbox.gateway")
FINAL = ("result", "exit", "error")  # a run's last line (as the SDK reads it)
MAX_MESSAGE = 16 << 20


class _Bad(ValueError):
    """Not a message of the calls protocol: the connection closes (1007), as a node's
    would."""


def _parse(text: str | None) -> dict:
    try:
        message = json.loads(text) if text is not None else None
    except ValueError:
        message = None
    if not isinstance(message, dict):
        raise _Bad("a message must be a JSON object")
    if "cancel" in message:
        if not isinstance(message["cancel"], int):
            raise _Bad('a cancel is {"cancel": <run id>}')
    elif not isinstance(message.get("id"), int) or not isinstance(message.get("sandbox"), str):
        raise _Bad('a run is {"id": <int>, "op": ..., "sandbox": <id>, "body": {...}}')
    return message


class _Session:
    """One client connection and its connections to nodes."""

    def __init__(self, ws: WebSocket, nodes: Nodes, credentials: Credentials) -> None:
        self.ws, self.nodes, self.credentials = ws, nodes, credentials
        self.sending = asyncio.Lock()
        self.links: dict[Node, websockets.ClientConnection] = {}
        self.readers: dict[Node, asyncio.Task] = {}
        self.owner: dict[int, Node] = {}  # run id -> the node it went to
        self.opening: dict[Node, asyncio.Lock] = {}

    async def send(self, text: str) -> None:
        async with self.sending:
            await self.ws.send_text(text)

    async def fail(self, run: int, message: str, kind: str, status: int) -> None:
        line = {"type": "error", "error": message, "kind": kind, "status": status}
        await self.send(json.dumps({"id": run, "line": line}, separators=(",", ":")))

    async def link(self, node: Node) -> websockets.ClientConnection:
        """The open connection to ``node``, made on its first run."""
        async with self.opening.setdefault(node, asyncio.Lock()):
            if node not in self.links:
                url = "ws" + node.url.removeprefix("http") + "/v1/calls"
                headers = [(k, v) for k, v in self.credentials.upstream(
                    self.ws.headers.items()) if k in ("authorization", "x-api-key")]
                conn = await websockets.connect(url, additional_headers=headers,
                                                open_timeout=5, max_size=MAX_MESSAGE,
                                                proxy=None)
                self.links[node] = conn
                self.readers[node] = asyncio.create_task(self.read(node, conn))
            return self.links[node]

    async def read(self, node: Node, conn: websockets.ClientConnection) -> None:
        """Pass ``node``'s lines to the client; when it goes, end its runs with an error."""
        try:
            async for text in conn:
                if isinstance(text, bytes):
                    continue
                with contextlib.suppress(ValueError, AttributeError, TypeError):
                    message = json.loads(text)
                    if message["line"].get("type") in FINAL:
                        self.owner.pop(message["id"], None)
                await self.send(text)
        except (websockets.WebSocketException, WebSocketDisconnect, RuntimeError, OSError):
            pass  # the node or the client went: the client's loop sees the latter
        finally:
            self.links.pop(node, None)
            orphans = [run for run, owner in self.owner.items() if owner is node]
            for run in orphans:
                del self.owner[run]
                with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                    await self.fail(run, f"the connection to node {node.name or node.url} was "
                                         "lost: the call's outcome is unknown",
                                    "NodeUnavailable", 503)

    async def route(self, text: str, message: dict) -> None:
        if "cancel" in message:
            node = self.owner.get(message["cancel"])
            if node is not None and node in self.links:
                await self.links[node].send(text)
            return
        run, sandbox = message["id"], message["sandbox"]
        try:
            node = self.nodes.holder(sandbox)
        except Unroutable as exc:
            await self.fail(run, exc.message, exc.kind, exc.status)
            return
        try:
            conn = await self.link(node)
            self.owner[run] = node
            await conn.send(text)
        except (websockets.WebSocketException, OSError, TimeoutError) as exc:
            self.owner.pop(run, None)
            self.nodes.down(node, f"{type(exc).__name__}: {exc}")
            await self.fail(run, f"node {node.name or node.url} holding sandbox {sandbox} "
                                 f"does not answer: {exc}", "NodeUnavailable", 503)

    async def close(self) -> None:
        for conn in list(self.links.values()):
            await conn.close()
        for task in self.readers.values():
            task.cancel()
        await asyncio.gather(*self.readers.values(), return_exceptions=True)


async def calls(ws: WebSocket) -> None:
    """Serve one client's calls until it closes."""
    nodes: Nodes = ws.app.state.nodes
    credentials: Credentials = ws.app.state.credentials
    if not credentials.client_ok(ws.headers):
        await ws.close(code=1008, reason="invalid api key")
        return
    await ws.accept()
    session = _Session(ws, nodes, credentials)
    try:
        while True:
            received = await ws.receive()
            if received["type"] == "websocket.disconnect":
                return
            try:
                message = _parse(received.get("text"))
            except _Bad as exc:
                await ws.close(code=1007, reason=str(exc)[:120])
                return
            await session.route(received["text"], message)
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        await session.close()
