"""``branchbox mcp --http HOST:PORT``: the MCP server over streamable HTTP, behind the
daemon's API keys.

The MCP SDK's Starlette app serves ``/mcp``; in front of it one ASGI layer wants
``Authorization: Bearer <key>`` with a key the daemon would accept, and answers
like the daemon does without one (401 ``{"error": "invalid api key"}``), before
any MCP session is made.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterable
from typing import Any

import uvicorn
from mcp.server import Server
from starlette.types import ASGIApp, Receive, Scope, Send

from branchbox.server.address import tcp_listener
from branchbox.server.keys import key_accepted
from branchbox.server.stop_signal import sigterm_exits_cleanly

MCP_PATH = "/mcp"


class RequireKey:
    """Every request needs one of ``keys``; lifespan events alone pass through (a
    WebSocket is refused outright: the MCP app serves none, and nothing unchecked
    may reach it)."""

    def __init__(self, app: ASGIApp, keys: Iterable[str]) -> None:
        self.app = app
        self.keys = frozenset(keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "lifespan":
            headers = dict(scope["headers"])
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            if not key_accepted(self.keys, authorization):
                await _refuse(send)
                return
        await self.app(scope, receive, send)


async def _refuse(send: Send) -> None:
    body = json.dumps({"error": "invalid api key", "type": "AuthError"}).encode()
    await send({"type": "http.response.start", "status": 401, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as a host and a port; ValueError says why not."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--http wants HOST:PORT (e.g. 127.0.0.1:8788), not {address!r}")
    return host, int(port)


async def serve_http(server: Server[Any], host: str, port: int, keys: Iterable[str],
                     on_listening: Callable[[str], None]) -> None:
    """Serve until SIGINT or SIGTERM, which end every session (and close its sandboxes)."""
    keys = frozenset(keys)
    if not keys:
        raise ValueError("the MCP server over HTTP needs at least one API key")
    app = RequireKey(server.streamable_http_app(streamable_http_path=MCP_PATH, host=host), keys)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = tcp_listener(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
    runner = uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=10,
                                           access_log=False, log_level="warning"))
    on_listening(f"http://{shown}:{bound_port}{MCP_PATH}")
    try:
        with sigterm_exits_cleanly():
            await runner.serve(sockets=[sock])
    finally:
        sock.close()
