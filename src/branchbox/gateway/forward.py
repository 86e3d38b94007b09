"""Passing a request on to its node, and who may have it passed on.

Nodes trust only the gateway: their one key is the cluster's internal node key, which
clients never see. A client that shows one of the gateway's keys (``Authorization:
Bearer``, or E2B's ``X-API-Key``) is shown to the node with the node key, in both
headers (the native routes read the first, E2B's control plane the second). E2B's
sandbox plane sends no key but a sandbox's access token, an HMAC of its id under the
nodes' key (``server.e2b_access``): the gateway checks it the same way before it passes
the request on, token and all, and the node checks it again. Anyone else is refused
here, before any node or connection is spent on them.

The Host header goes through unchanged: E2B addresses a sandbox's ports by it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping

import httpx
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from branchbox.gateway.nodes import Node
from branchbox.server.e2b_access import access_granted, api_key_ok
from branchbox.server.errors import error_response
from branchbox.server.keys import key_accepted
from branchbox.server.relaying import HOP_BY_HOP
from branchbox.server.streams import NDJSON, error_line

TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=30.0)
"""No read timeout: a run streams for as long as its own timeout lets it."""
_KEYS = (b"authorization", b"x-api-key")
_HOP = {name.encode() for name in HOP_BY_HOP}
Headers = list[tuple[bytes, bytes]]
"""As received and sent: bytes, since a value need not be ASCII (a browser's cookie)."""


class NodeDown(Exception):
    """A node could not be connected to: nothing reached it, so the request may go to
    another node (a create) or be answered 503."""

    def __init__(self, node: Node, why: str) -> None:
        super().__init__(why)
        self.node, self.why = node, why


class Credentials:
    """The gateway's API keys (what clients show) and the node key (what nodes accept)."""

    def __init__(self, keys: Iterable[str], node_key: str) -> None:
        self.keys = frozenset(keys)
        if not self.keys or not node_key:
            raise ValueError("a gateway needs its clients' keys and the nodes' key")
        self.node_key = node_key

    def client_ok(self, headers: Mapping[str, str]) -> bool:
        """Whether the client shows one of the gateway's keys."""
        return key_accepted(self.keys, headers.get("authorization", "")) \
            or api_key_ok(self.keys, headers)

    def may_reach(self, headers: Mapping[str, str], sandbox_id: str) -> bool:
        """Whether a request may be passed on to ``sandbox_id``'s node: a client key, or
        that sandbox's E2B access token (nodes' only key being the node key)."""
        return self.client_ok(headers) or access_granted(frozenset({self.node_key}), headers,
                                                         sandbox_id)

    def upstream(self, headers: Iterable[tuple[bytes, bytes]], *, keyed: bool) -> Headers:
        """The headers to send a node: not hop-by-hop ones nor the client's keys; the node
        key in their place for a client that showed a key (``keyed``)."""
        out = [(name.lower(), value) for name, value in headers
               if name.lower() not in _HOP and name.lower() not in _KEYS]
        if keyed:
            key = self.node_key.encode()
            out += [(b"authorization", b"Bearer " + key), (b"x-api-key", key)]
        return out


def as_text(headers: Headers) -> list[tuple[str, str]]:
    """``headers`` for a WebSocket handshake (the websockets library takes text): those
    whose value is ASCII."""
    return [(name.decode(), value.decode()) for name, value in headers if value.isascii()]


async def _relayed(reply: httpx.Response, node: Node) -> AsyncIterator[bytes]:
    """The node's answer as it comes. If the node fails once it has begun, a stream of
    lines (a run's) ends with an error line, as a daemon's failed stream does; any other
    answer is cut short (its length, or its chunking, tells the client)."""
    try:
        async for chunk in reply.aiter_raw():
            yield chunk
    except httpx.TransportError as exc:
        if reply.headers.get("content-type", "").startswith(NDJSON):
            (line,) = error_line(f"node {node.label} failed during the call "
                                 f"({type(exc).__name__}): its outcome is unknown",
                                 "NodeUnavailable", 503)
            yield b"\n" + json.dumps(line).encode() + b"\n"


def error(status: int, message: str, kind: str) -> JSONResponse:
    """An answer of the gateway's own, the daemon's shape (a 503 says when to retry)."""
    answer = error_response(status, message, kind)
    if status == 503:
        answer.headers["Retry-After"] = "5"
    return answer


def unavailable(message: str) -> JSONResponse:
    return error(503, message, "NodeUnavailable")


async def forward(request: Request, node: Node, client: httpx.AsyncClient,
                  credentials: Credentials, *, body: bytes | None = None) -> Response:
    """The node's answer to ``request`` (``body``: the request's body when the gateway
    has read it already), streamed back as it comes; NodeDown if the node cannot be
    connected to."""
    path = request.scope.get("raw_path") or request.url.path.encode()
    query = request.scope.get("query_string", b"")
    url = node.url + path.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")
    if body is None and ("content-length" in request.headers
                         or "transfer-encoding" in request.headers):
        content = request.stream()
    else:
        content = body
    headers = credentials.upstream(request.headers.raw,
                                   keyed=credentials.client_ok(request.headers))
    upstream = client.build_request(request.method, url, content=content, headers=headers)
    try:
        reply = await client.send(upstream, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise NodeDown(node, f"{type(exc).__name__}: {exc}") from None
    except httpx.PoolTimeout:  # nothing was sent
        return unavailable(f"the gateway has no free connection to node {node.label}; retry")
    except ClientDisconnect:
        return Response(status_code=400)  # the client left mid-upload: nobody reads this
    except httpx.TransportError as exc:  # it took the request: what it did is unknown
        return error(502, f"node {node.label} failed during the request ({type(exc).__name__}"
                          f"): whether it was carried out is unknown", "NodeUnavailable")
    response = StreamingResponse(_relayed(reply, node), status_code=reply.status_code,
                                 background=BackgroundTask(reply.aclose))
    response.raw_headers = [(k, v) for k, v in reply.headers.raw
                            if k.lower().decode("latin-1") not in HOP_BY_HOP]
    return response
