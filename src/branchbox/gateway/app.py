"""The gateway's ASGI application: every request to the node that can answer it.

- A request that names a sandbox (``routing.sandbox_named``) must show a client key or
  that sandbox's E2B access token; it goes to the node the id names: 404 when no node
  has that tag, 503 ``NodeUnavailable`` when that node is down.
- Every other request must show a client key. A create goes to the least-loaded node
  that is up and has the image; if that node cannot be connected to, to the next
  (nothing was made on the first).
- Listings and events are every node's, merged (``fanout``); an image build goes to the
  least-loaded node (later creates of that image go where it is), an image's removal
  to every node.
- ``/v1/calls`` is split per node (``calls``); other WebSockets (a sandbox's ports) are
  relayed to the sandbox's node.
- ``/v1/healthz`` is the gateway's own; ``/v1/nodes`` shows its node table.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import httpx
import websockets
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from branchbox.gateway import fanout
from branchbox.gateway.calls import MAX_MESSAGE, QUEUE, calls
from branchbox.gateway.forward import (
    TIMEOUT,
    Credentials,
    NodeDown,
    as_text,
    error,
    forward,
    unavailable,
)
from branchbox.gateway.nodes import REFRESH_SECONDS, Node, Nodes, NoNode, Unroutable
from branchbox.gateway.routing import (
    CREATES,
    LISTINGS,
    REMOVALS,
    Misaddressed,
    image_of_create,
    sandbox_named,
    space_resumed,
)
from branchbox.server.e2b_access import addressed
from branchbox.server.ports import METHODS
from branchbox.server.relaying import relay, subprotocols

MAX_CREATE_BODY = 1 << 20  # a create's JSON: env, network policy; read whole to pick a node
SHORT_CALL = 60.0  # seconds for calls the gateway makes on its own (an image's removal)


def create_gateway(source: Callable[[], Awaitable[list[str]]], *, api_keys: Iterable[str],
                   node_key: str, refresh: float = REFRESH_SECONDS,
                   on_stop: Callable[[], Awaitable[None]] | None = None) -> Starlette:
    """The gateway over the nodes whose URLs ``source`` lists (a static list, or
    ``discovery.KubernetesNodes.urls``; ``on_stop`` closes what it holds). Clients must
    show one of ``api_keys``; nodes are shown ``node_key`` instead."""
    credentials = Credentials(api_keys, node_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        client = httpx.AsyncClient(timeout=TIMEOUT, trust_env=False, follow_redirects=False,
                                   limits=httpx.Limits(max_connections=1024,
                                                       max_keepalive_connections=128,
                                                       keepalive_expiry=2.0))
        own = httpx.AsyncClient(trust_env=False)  # reports: never queued behind requests
        # Event streams hold a connection to every node for as long as a subscriber
        # listens: apart from the pool that requests wait for.
        streams = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=0))
        app.state.client, app.state.streams = client, streams
        app.state.nodes = nodes = Nodes(source, own, node_key, refresh=refresh)
        await nodes.refresh()  # the first table before the first request
        refreshing = asyncio.create_task(nodes.run())
        try:
            yield
        finally:
            refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refreshing
            for closing in (client, own, streams):
                await closing.aclose()
            if on_stop is not None:
                await on_stop()

    app = Starlette(lifespan=lifespan, routes=[
        Route("/v1/healthz", _healthz),
        Route("/v1/nodes", _nodes),
        WebSocketRoute("/v1/calls", calls),
        WebSocketRoute("/{path:path}", _websocket),
        Route("/{path:path}", _http, methods=METHODS),
    ], exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.credentials = credentials
    return app


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    answer = error(exc.status_code, str(exc.detail), "InvalidRequest")
    answer.headers.update(exc.headers or {})  # a 405's Allow
    return answer


async def _internal_error(_: Request, exc: Exception) -> Response:
    return error(500, f"internal error in the gateway: {type(exc).__name__}: {exc}",
                 "SandboxError")


async def _healthz(_: Request) -> Response:
    """``ok`` while the gateway serves, whatever its nodes do (open to all)."""
    return PlainTextResponse("ok")


async def _nodes(request: Request) -> Response:
    """The node table: each node's URL, tag, name, whether it is up (or why not), load."""
    if not request.app.state.credentials.client_ok(request.headers):
        return error(401, "invalid api key", "AuthError")
    return JSONResponse({"nodes": request.app.state.nodes.describe()})


async def _http(request: Request) -> Response:
    """Any HTTP request but the gateway's own (see the module's docstring)."""
    state = request.app.state
    nodes: Nodes = state.nodes
    credentials: Credentials = state.credentials
    path, method = request.url.path, request.method
    keyed = credentials.client_ok(request.headers)
    try:
        sandbox = None if (method, path) in CREATES else sandbox_named(path, request.headers)
    except Misaddressed as exc:
        return error(400, str(exc), "InvalidRequest")
    if sandbox is not None:
        if not (keyed or credentials.may_reach(request.headers, sandbox)):
            return error(401, "invalid api key", "AuthError")
        try:
            return await forward(request, nodes.holder(sandbox), state.client, credentials)
        except Unroutable as exc:
            return error(exc.status, exc.message, exc.kind)
        except NodeDown as exc:
            nodes.down(exc.node, exc.why)
            return unavailable(f"sandbox {sandbox} is on node {exc.node.label}, which does "
                               f"not answer: {exc.why}")
    if not keyed:
        return error(401, "invalid api key", "AuthError")
    if (method, path) in CREATES:
        return await _create(request, nodes, state.client, credentials)
    if method == "GET" and path in LISTINGS:
        return await fanout.listing(request, nodes, state.client, credentials)
    if method == "GET" and path == "/v1/events":
        return await fanout.events(request, nodes, state.streams, credentials)
    if (space := space_resumed(method, path)) is not None:  # to where the space is
        return await _to_one(request, nodes, state.client, credentials,
                             lambda: nodes.pick(space))
    if method == "DELETE" and path.startswith(REMOVALS):
        return await _everywhere(request, nodes, state.client, credentials)
    # An image build, the API's schema, a route no node has: one node answers for all.
    return await _to_one(request, nodes, state.client, credentials,
                         lambda: nodes.pick() if (method, path) == ("POST", "/v1/images")
                         else _any(nodes))


def _any(nodes: Nodes) -> Node:
    if not (up := nodes.up()):
        raise NoNode("no node is up")
    return up[0]


async def _to_one(request: Request, nodes: Nodes, client: httpx.AsyncClient,
                  credentials: Credentials, choose: Callable[[], Node],
                  body: bytes | None = None) -> Response:
    """``request`` to the node ``choose`` gives, or to the next one while none can be
    connected to (nothing reached those)."""
    tried: set[Node] = set()
    while True:
        try:
            node = choose()
        except NoNode as exc:
            return unavailable(str(exc))
        if node in tried:  # chosen again: every node that is up failed just now
            return unavailable(f"no node could be reached: {node.error}")
        tried.add(node)
        try:
            return await forward(request, node, client, credentials, body=body)
        except NodeDown as exc:
            nodes.down(exc.node, exc.why)


async def _create(request: Request, nodes: Nodes, client: httpx.AsyncClient,
                  credentials: Credentials) -> Response:
    """A create to the least-loaded node with its image."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_CREATE_BODY:
                return error(413, f"a create's body is at most {MAX_CREATE_BODY} bytes",
                             "PayloadTooLarge")
    except ClientDisconnect:
        return Response(status_code=400)  # the client left: nobody reads this
    try:
        image = image_of_create(request.url.path, json.loads(body or b"{}"))
    except (ValueError, RecursionError):
        image = None  # the node says what is wrong with the body
    return await _to_one(request, nodes, client, credentials, lambda: nodes.pick(image),
                         bytes(body))


async def _everywhere(request: Request, nodes: Nodes, client: httpx.AsyncClient,
                      credentials: Credentials) -> Response:
    """An image's or a snapshot's removal on every node that is up: each only knows its
    own, so 404s are nodes without it; any other refusal (in use: 409) is the answer."""
    headers = credentials.upstream(request.headers.raw, keyed=True)
    path = (request.scope.get("raw_path") or request.url.path.encode()).decode("latin-1")
    answers = await asyncio.gather(*(
        client.request(request.method, node.url + path, headers=headers, timeout=SHORT_CALL)
        for node in nodes.up()), return_exceptions=True)
    replies = [a for a in answers if isinstance(a, httpx.Response)]
    refusals = [r for r in replies if r.status_code not in (204, 404)]
    if len(replies) < len(answers):
        return unavailable("not every node could be asked to remove it; retry")
    if not refusals and any(r.status_code == 204 for r in replies):
        return Response(status_code=204)
    if not replies:
        return unavailable("no node is up")
    first = (refusals or replies)[0]
    return Response(first.content, status_code=first.status_code,
                    media_type=first.headers.get("content-type"))


async def _websocket(ws: WebSocket) -> None:
    """A WebSocket to a sandbox's port, relayed to the sandbox's node."""
    nodes: Nodes = ws.app.state.nodes
    credentials: Credentials = ws.app.state.credentials
    try:
        sandbox = sandbox_named(ws.url.path, ws.headers) or ""
        if not (credentials.client_ok(ws.headers) or credentials.may_reach(ws.headers, sandbox)):
            await ws.close(code=1008, reason="invalid api key")
            return
        node = nodes.holder(sandbox)
    except (Unroutable, Misaddressed) as exc:
        await ws.close(code=1011 if getattr(exc, "status", 400) == 503 else 1008,
                       reason=str(exc)[:120])
        return
    headers = as_text(credentials.upstream(
        [(k, v) for k, v in ws.headers.raw
         if not k.lower().startswith(b"sec-websocket-") and k.lower() != b"host"],
        keyed=credentials.client_ok(ws.headers)))
    target = addressed(ws.headers)
    if target is not None and "e2b-sandbox-id" not in ws.headers:  # E2B's Host addressing,
        headers += [("e2b-sandbox-id", target[0]),  # which the node reads from headers too
                    ("e2b-sandbox-port", str(target[1] or ""))]
    path = (ws.scope.get("raw_path") or ws.url.path.encode()).decode("latin-1")
    query = ws.scope.get("query_string", b"").decode("latin-1")
    try:
        upstream = await websockets.connect(f"{node.ws_url}{path}" + (f"?{query}" if query
                                                                      else ""),
                                            additional_headers=headers,
                                            subprotocols=subprotocols(ws), open_timeout=10,
                                            max_size=MAX_MESSAGE, max_queue=QUEUE, proxy=None)
    except (TimeoutError, OSError, websockets.WebSocketException) as exc:
        await ws.close(code=1011, reason=f"the sandbox's node did not take it: {exc}"[:120])
        return
    await ws.accept(subprotocol=upstream.subprotocol)
    await relay(ws, upstream)
