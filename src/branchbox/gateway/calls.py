"""The calls WebSocket through the gateway: one client connection, a connection per node.

The SDK sends every run, fork, merge, checkpoint and restore of all its sandboxes down
one ``/v1/calls`` connection (``server.call_channel``), so one connection carries calls
for sandboxes on several nodes. The gateway checks each message as a node would (a
message that is not a request closes the client's connection, 1007), opens (once) a
connection to the sandbox's node and passes the message on unchanged; the node's lines
come back unchanged too (run ids are the client's, unique on its connection: a run id
still going is refused here, as a node refuses it). A cancel goes where its run went. A
node whose connection drops ends each of its runs with an error line (503
``NodeUnavailable``); when the client hangs up, every node connection closes, which
abandons its runs as a node does for any client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import websockets
from starlette.websockets import WebSocket, WebSocketDisconnect

from branchbox.gateway.forward import Credentials, as_text
from branchbox.gateway.nodes import Node, Nodes, Unroutable
from branchbox.server.call_channel import MAX_RUNS, requests
from branchbox.server.streams import error_line

FINAL = ("result", "exit", "error")  # a run's last line (as the SDK reads it)
MAX_MESSAGE = 16 << 20
QUEUE = 4  # messages a node link buffers before it stops reading (a slow client)
MAX_RUNS_ALL_NODES = 8 * MAX_RUNS  # each node refuses more than MAX_RUNS on its link


class _Session:
    """One client connection and its connections to nodes."""

    def __init__(self, ws: WebSocket, nodes: Nodes, credentials: Credentials) -> None:
        self.ws, self.nodes, self.credentials = ws, nodes, credentials
        self.sending = asyncio.Lock()
        self.links: dict[Node, websockets.ClientConnection] = {}
        self.readers: set[asyncio.Task] = set()
        self.owner: dict[int, Node] = {}  # run id -> the node it went to, until its end
        self.opening: dict[Node, asyncio.Lock] = {}

    async def send(self, text: str) -> None:
        async with self.sending:
            await self.ws.send_text(text)

    async def fail(self, run: int, message: str, kind: str, status: int) -> None:
        (line,) = error_line(message, kind, status)
        await self.send(json.dumps({"id": run, "line": line}, separators=(",", ":")))

    async def link(self, node: Node) -> websockets.ClientConnection:
        """The open connection to ``node``, made on its first run (OSError or TimeoutError
        when the node cannot be reached, InvalidHandshake when it refuses)."""
        async with self.opening.setdefault(node, asyncio.Lock()):
            if node not in self.links:
                headers = as_text(self.credentials.upstream([], keyed=True))
                conn = await websockets.connect(f"{node.ws_url}/v1/calls",
                                                additional_headers=headers, open_timeout=5,
                                                max_size=MAX_MESSAGE, max_queue=QUEUE,
                                                proxy=None)
                self.links[node] = conn
                reader = asyncio.create_task(self.read(node, conn))
                self.readers.add(reader)
                reader.add_done_callback(self.readers.discard)
            return self.links[node]

    async def read(self, node: Node, conn: websockets.ClientConnection) -> None:
        """Pass ``node``'s lines to the client; when the link ends, close it and end its
        runs with an error."""
        try:
            async for text in conn:
                if isinstance(text, bytes):
                    continue
                with contextlib.suppress(ValueError, LookupError, TypeError, AttributeError):
                    message = json.loads(text)
                    if message["line"].get("type") in FINAL:
                        self.owner.pop(message["id"], None)
                await self.send(text)
        except (websockets.WebSocketException, WebSocketDisconnect, RuntimeError, OSError):
            pass  # the node or the client went: the client's loop sees the latter
        finally:
            if self.links.get(node) is conn:
                del self.links[node]
            await conn.close()
            orphans = [run for run, owner in self.owner.items() if owner is node]
            for run in orphans:
                if self.owner.pop(run, None) is not node:
                    continue  # failed meanwhile by route (its send broke too)
                with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                    await self.fail(run, f"the connection to node {node.label} was lost: the "
                                         "call's outcome is unknown", "NodeUnavailable", 503)

    async def route(self, text: str, message: dict) -> None:
        if "cancel" in message:
            node = self.owner.get(message["cancel"])
            if node is not None and node in self.links:
                with contextlib.suppress(websockets.WebSocketException, OSError):
                    await self.links[node].send(text)
            return
        run, sandbox = message["id"], message["sandbox"]
        if run in self.owner:
            await self.fail(run, f"run {run} is still going on this connection",
                            "InvalidRequest", 400)
            return
        if len(self.owner) >= MAX_RUNS_ALL_NODES:
            await self.fail(run, f"at most {MAX_RUNS_ALL_NODES} runs at once on one connection "
                                 f"(and {MAX_RUNS} on each node)", "ResourceLimit", 429)
            return
        try:
            node = self.nodes.holder(sandbox)
        except Unroutable as exc:
            await self.fail(run, exc.message, exc.kind, exc.status)
            return
        self.owner[run] = node
        try:
            conn = await self.link(node)
            await conn.send(text)
        except (OSError, TimeoutError) as exc:  # not reached: nothing ran
            if isinstance(exc, OSError):  # refused or unreachable; a slow handshake is not
                self.nodes.down(node, f"{type(exc).__name__}: {exc}")
            if self.owner.pop(run, None) is not None:
                await self.fail(run, f"sandbox {sandbox} is on node {node.label}, which does "
                                     f"not answer: {exc}", "NodeUnavailable", 503)
        except websockets.WebSocketException as exc:  # refused, or closed under the send
            if self.owner.pop(run, None) is not None:
                await self.fail(run, f"node {node.label} did not take the call: {exc}",
                                "NodeUnavailable", 503)

    async def close(self) -> None:
        for conn in list(self.links.values()):
            await conn.close()
        await asyncio.gather(*self.readers, return_exceptions=True)


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
        async for text, message in requests(ws):
            await session.route(text, message)
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        await session.close()
