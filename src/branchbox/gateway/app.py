"""The gateway's ASGI application: every request to the node that can answer it.

- A request that names a sandbox (``routing.sandbox_named``) goes to the node its id
  names: 404 when no node has that tag, 503 ``NodeUnavailable`` when that node is down.
- A create goes to the least-loaded node that is up and has the image; if that node
  cannot be reached, to the next (nothing was made on the first).
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
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from branchbox.gateway import fanout
from branchbox.gateway.calls import MAX_MESSAGE, calls
from branchbox.gateway.forward import TIMEOUT, Credentials, error, forward
from branchbox.gateway.nodes import REFRESH_SECONDS, Node, Nodes, NoNode, Unroutable
from branchbox.gateway.routing import CREATES, LISTINGS, image_of_create, sandbox_named
from branchbox.server.e2b_access import addressed
from branchbox.server.relaying import relay, subprotocols

MAX_CREATE_BODY = 1 << 20  # a create's JSON: env, network policy; read whole to pick a node
_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def create_gateway(source: Callable[[], Awaitable[list[str]]], *, api_keys: Iterable[str] = (),
                   node_key: str | None = None,
                   refresh: float = REFRESH_SECONDS) -> Starlette:
    """The gateway over the nodes whose URLs ``source`` lists (a static list, or
    ``discovery.KubernetesNodes.urls``). With ``api_keys``, clients must show one; nodes
    are shown ``node_key`` instead."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        client = httpx.AsyncClient(timeout=TIMEOUT, trust_env=False, follow_redirects=False,
                                   limits=httpx.Limits(max_connections=1024,
                                                       max_keepalive_connections=128))
        app.state.client = client
        app.state.nodes = nodes = Nodes(source, client, node_key, refresh=refresh)
        await nodes.refresh()  # the first table before the first request
        refreshing = asyncio.create_task(nodes.run())
        try:
            yield
        finally:
            refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refreshing
            await client.aclose()

    app = Starlette(lifespan=lifespan, routes=[
        Route("/v1/healthz", _healthz),
        Route("/v1/nodes", _nodes),
        WebSocketRoute("/v1/calls", calls),
        WebSocketRoute("/{path:path}", _websocket),
        Route("/{path:path}", _http, methods=_METHODS),
    ])
    app.state.credentials = Credentials(api_keys, node_key)
    return app


async def _healthz(_: Request) -> Response:
    """``ok`` while the gateway serves, whatever its nodes do (open to all)."""
    return PlainTextResponse("ok")


async def _nodes(request: Request) -> Response:
    if not request.app.state.credentials.client_ok(request.headers):
        return error(401, "invalid api key", "AuthError")
    return JSONResponse({"nodes": request.app.state.nodes.describe()})


async def _http(request: Request) -> Response:
    state = request.app.state
    nodes: Nodes = state.nodes
    credentials: Credentials = state.credentials
    path, method = request.url.path, request.method
    sandbox = sandbox_named(path, request.headers)
    if sandbox is not None:
        try:
            node = nodes.holder(sandbox)
        except Unroutable as exc:
            return error(exc.status, exc.message, exc.kind, **_retry(exc))
        return await forward(request, node, nodes, state.client, credentials,
                             what=f"sandbox {sandbox}")
    if not credentials.client_ok(request.headers):
        return error(401, "invalid api key", "AuthError")
    if (method, path) in CREATES:
        return await _create(request, nodes, state.client, credentials)
    if method == "GET" and path in LISTINGS:
        return await fanout.listing(request, nodes, state.client, credentials)
    if method == "GET" and path == "/v1/events":
        return await fanout.events(request, nodes, state.client, credentials)
    if method == "DELETE" and path.startswith("/v1/images/"):
        return await _everywhere(request, nodes, state.client, credentials)
    try:  # an image build, the API's schema, a path no route has: any node answers alike
        node = nodes.pick() if (method, path) == ("POST", "/v1/images") else _any(nodes)
    except NoNode as exc:
        return error(503, str(exc), "NodeUnavailable", **{"Retry-After": "5"})
    return await forward(request, node, nodes, state.client, credentials)


def _retry(exc: Unroutable) -> dict[str, str]:
    return {"Retry-After": "5"} if exc.status == 503 else {}


def _any(nodes: Nodes) -> Node:
    up = nodes.up()
    if not up:
        raise NoNode("no node is up")
    return up[0]


async def _create(request: Request, nodes: Nodes, client: httpx.AsyncClient,
                  credentials: Credentials) -> Response:
    """A create to the least-loaded node with its image; on to the next if that node does
    not answer at all (nothing was made there)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_CREATE_BODY:
            return error(413, f"a create's body is at most {MAX_CREATE_BODY} bytes",
                         "PayloadTooLarge")
    try:
        image = image_of_create(request.url.path, json.loads(body or b"{}"))
    except ValueError:
        image = None  # the node says what is wrong with the body
    tried: set[Node] = set()
    while True:
        try:
            node = nodes.pick(image)
        except NoNode as exc:
            return error(503, str(exc), "NodeUnavailable", **{"Retry-After": "5"})
        if node in tried:  # picked again: every candidate failed this time
            return error(503, f"no node answered the create: {node.error}", "NodeUnavailable")
        tried.add(node)
        reply = await forward(request, node, nodes, client, credentials, body=bytes(body))
        if not (reply.status_code == 503 and not node.up):
            return reply


async def _everywhere(request: Request, nodes: Nodes, client: httpx.AsyncClient,
                      credentials: Credentials) -> Response:
    """An image's removal on every node that is up: done if any node removed it, else the
    first refusal (each node only knows its own images)."""
    headers = credentials.upstream(request.headers.items())
    answers = await asyncio.gather(*(
        client.request(request.method, node.url + request.url.path, headers=headers)
        for node in nodes.up()), return_exceptions=True)
    replies = [a for a in answers if isinstance(a, httpx.Response)]
    if any(r.status_code == 204 for r in replies):
        return Response(status_code=204)
    if not replies:
        return error(503, "no node is up", "NodeUnavailable")
    return Response(replies[0].content, status_code=replies[0].status_code,
                    media_type=replies[0].headers.get("content-type"))


async def _websocket(ws: WebSocket) -> None:
    """A WebSocket to a sandbox's port, relayed to the sandbox's node."""
    nodes: Nodes = ws.app.state.nodes
    try:
        node = nodes.holder(sandbox_named(ws.url.path, ws.headers) or "")
    except Unroutable as exc:
        await ws.close(code=1008 if exc.status == 404 else 1011, reason=exc.message[:120])
        return
    headers = ws.app.state.credentials.upstream(
        (k, v) for k, v in ws.headers.items()
        if not k.startswith("sec-websocket-") and k != "host")
    target = addressed(ws.headers)
    if target is not None and "e2b-sandbox-id" not in ws.headers:  # E2B's Host addressing,
        headers += [("e2b-sandbox-id", target[0]),  # which the node reads from headers too
                    ("e2b-sandbox-port", str(target[1] or ""))]
    url = "ws" + node.url.removeprefix("http") + ws.url.path + (
        f"?{ws.url.query}" if ws.url.query else "")
    try:
        upstream = await websockets.connect(url, additional_headers=headers,
                                            subprotocols=subprotocols(ws), open_timeout=10,
                                            max_size=MAX_MESSAGE, proxy=None)
    except (TimeoutError, OSError, websockets.WebSocketException) as exc:
        await ws.close(code=1011, reason=f"the sandbox's node did not take it: {exc}"[:120])
        return
    await ws.accept(subprotocol=upstream.subprotocol)
    await relay(ws, upstream)
