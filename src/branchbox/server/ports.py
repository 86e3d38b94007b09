"""The port proxy: ``/v1/sandboxes/{id}/ports/{port}/...`` reaches ``sandbox:port``.

A sandbox's address is on the daemon's bridge, which only the daemon's host
can reach; a remote client (or one behind the daemon's TCP port) gets to a dev
server in a sandbox through here, with the same API key as every other call.
HTTP is streamed both ways (a large download never sits in the daemon's
memory); a WebSocket is relayed message by message. The daemon connects from
the host, which the firewall lets in (a sandbox answers; it never opens a
connection to the host).

The path after ``/ports/{port}`` and the query go to the sandbox as they came;
hop-by-hop headers and the daemon's credentials do not: ``Authorization``,
E2B's ``X-API-Key`` and access tokens, and the live page's key cookie (a
browser sends it here too: it is scoped to the daemon's origin, which this path
shares). For the same reason a page served from here is run as its own opaque
origin (``Content-Security-Policy: sandbox``): its scripts must not call the
daemon's API with the cookie of an operator who opened it, and it may not set
that cookie. What a sandbox sends back is bounded like everything else from it:
a WebSocket message larger than ``WS_MAX_MESSAGE`` closes the relay (1009).
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Callable

import httpx
import websockets
from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from branchbox.engine import errors
from branchbox.engine.sandboxes import Engine
from branchbox.server.deps import EngineDep, ws_key_ok
from branchbox.server.relaying import HOP_BY_HOP, relay, subprotocols
from branchbox.server.ui.session import COOKIE

router = APIRouter(prefix="/v1/sandboxes", tags=["ports"])
# WebSocket routes check the key themselves (the app-wide check takes a Request), so they
# are mounted without it.
ws_router = APIRouter(prefix="/v1/sandboxes", tags=["ports"])

METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
# Never forwarded either way: connection-specific headers, and the Host (ours).
_HOP = HOP_BY_HOP | {"host"}
_CREDENTIALS = {"authorization", "x-api-key", "x-access-token", "e2b-traffic-access-token"}
# Everything a page may do but be the daemon's origin (no allow-same-origin).
_PAGE_POLICY = (b"sandbox allow-scripts allow-forms allow-popups allow-modals "
                b"allow-downloads")
WS_MAX_MESSAGE = 16 << 20  # one message from the sandbox, held whole by the relay
_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=10.0)
# No shared cap on connections: every proxied request holds one for as long as the
# sandbox takes to answer (for ever, if it likes), and under a shared cap one sandbox that
# never answers left every other sandbox's proxied requests waiting for a free one. Each
# sandbox has a cap of its own instead (beyond it: 429).
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=64)
PROXIED_PER_SANDBOX = 256


class PortUnreachable(errors.EngineError):
    status = 502
    kind = "SandboxError"


def _target(engine: Engine, sandbox_id: str, port: int) -> str:
    """``address:port`` of the sandbox (404 when it does not exist, 400 on a bad port)."""
    if not 1 <= port <= 65535:
        raise errors.InvalidRequest(f"port must be between 1 and 65535, not {port}")
    sb = engine.get(sandbox_id)
    address = engine.net.address(sb.body.key)
    if address is None:
        raise PortUnreachable("the sandbox has no network address")
    return f"{address}:{port}"


def _client(request: Request) -> httpx.AsyncClient:
    """One pooled client per app (no environment proxies: the bridge is local)."""
    client = getattr(request.app.state, "port_client", None)
    if client is None:
        client = httpx.AsyncClient(timeout=_TIMEOUT, limits=_LIMITS, trust_env=False,
                                   follow_redirects=False)
        request.app.state.port_client = client
    return client


@router.api_route("/{sandbox_id}/ports/{port}", methods=METHODS, include_in_schema=False)
@router.api_route("/{sandbox_id}/ports/{port}/{path:path}", methods=METHODS)
async def proxy_http(sandbox_id: str, port: int, request: Request, engine: EngineDep,
                     path: str = "") -> StreamingResponse:
    """Forward the request to ``port`` in the sandbox and stream the answer back."""
    url = f"http://{_target(engine, sandbox_id, port)}/{path}"
    headers = _forwarded(request.headers.items())
    client = _client(request)
    release = _admit(request, sandbox_id)
    try:
        return await _proxied(client, request, url, headers, port, release)
    except BaseException:
        release()
        raise


async def _proxied(client: httpx.AsyncClient, request: Request, url: str,
                   headers: list[tuple[str, str]], port: int,
                   release: Callable[[], None]) -> StreamingResponse:
    # A body only when the request has one: an empty chunked body on a GET is bytes a
    # simple server never reads, and closing with unread bytes resets the connection.
    has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
    upstream = client.build_request(request.method, url, params=request.url.query or None,
                                    headers=headers,
                                    content=request.stream() if has_body else None)
    try:
        reply = await client.send(upstream, stream=True)
    except httpx.TransportError as exc:
        raise PortUnreachable(f"nothing answers on port {port} in the sandbox: "
                              f"{type(exc).__name__}") from None
    weakref.finalize(reply, release)  # whatever happens to the answer below

    async def done() -> None:
        release()
        await reply.aclose()

    async def body() -> AsyncIterator[bytes]:
        """The sandbox's body; its connection ends with it, also when our client leaves
        mid-way (Starlette then skips the background task)."""
        try:
            async for chunk in reply.aiter_raw():
                yield chunk
        finally:
            await done()

    response = StreamingResponse(body(), status_code=reply.status_code,
                                 background=BackgroundTask(done))
    response.raw_headers = _returned(reply.headers.raw)
    return response


def _admit(request: Request, sandbox_id: str) -> Callable[[], None]:
    """Count a proxied request to ``sandbox_id`` (429 past its cap); the release."""
    counts: dict[str, int] = request.app.state.__dict__.setdefault("port_requests", {})
    if counts.get(sandbox_id, 0) >= PROXIED_PER_SANDBOX:
        raise errors.ResourceLimit(f"{PROXIED_PER_SANDBOX} proxied requests to this sandbox "
                                   "are in progress already; retry once some finish")
    counts[sandbox_id] = counts.get(sandbox_id, 0) + 1
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            counts[sandbox_id] -= 1
            if not counts[sandbox_id]:
                del counts[sandbox_id]
    return release


def _forwarded(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The request's headers the sandbox may see: not hop-by-hop ones, not the daemon's
    credentials, and the cookie header without the live page's key."""
    kept = []
    for name, value in headers:
        name = name.lower()
        if name in _HOP or name in _CREDENTIALS:
            continue
        if name == "cookie":
            value = "; ".join(c for c in (p.strip() for p in value.split(";"))
                              if c and c.split("=", 1)[0].strip() != COOKIE)
            if not value:
                continue
        kept.append((name, value))
    return kept


def _returned(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The sandbox's answer headers as sent (several Set-Cookie stay several), as bytes
    (whatever their charset), without hop-by-hop ones, uvicorn's own Date and Server,
    or a cookie of the daemon's name; plus the opaque-origin policy."""
    cookie = COOKIE.encode() + b"="
    kept = [(name.lower(), value) for name, value in raw
            if name.lower().decode("latin-1") not in _HOP
            and name.lower() not in (b"date", b"server")
            and not (name.lower() == b"set-cookie" and value.lstrip().startswith(cookie))]
    return [*kept, (b"content-security-policy", _PAGE_POLICY)]


@ws_router.websocket("/{sandbox_id}/ports/{port}")
@ws_router.websocket("/{sandbox_id}/ports/{port}/{path:path}")
async def proxy_websocket(ws: WebSocket, sandbox_id: str, port: int, path: str = "") -> None:
    """Relay a WebSocket to ``port`` in the sandbox, both directions at once."""
    if not ws_key_ok(ws):
        await ws.close(code=1008, reason="invalid api key")
        return
    engine: Engine = ws.app.state.engine
    try:
        target = _target(engine, sandbox_id, port)
    except errors.EngineError as exc:
        await ws.close(code=1008 if exc.status == 404 else 1011, reason=exc.message[:120])
        return
    query = ws.url.query
    url = f"ws://{target}/{path}" + (f"?{query}" if query else "")
    try:
        upstream = await websockets.connect(url, subprotocols=subprotocols(ws),
                                            open_timeout=10, max_size=WS_MAX_MESSAGE,
                                            max_queue=4, proxy=None)
    except (TimeoutError, OSError, websockets.WebSocketException):
        await ws.close(code=1011, reason=f"nothing answers on port {port} in the sandbox")
        return
    await ws.accept(subprotocol=upstream.subprotocol)
    await relay(ws, upstream)
