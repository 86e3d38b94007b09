"""Passing a request on to its node, and what the node is shown of the client's keys.

Nodes trust only the gateway: their one key is the cluster's internal node key, which
clients never see. A client's valid API key (``Authorization: Bearer``, or E2B's
``X-API-Key``) is swapped for the node key on the way; anything else the client sent
(an E2B sandbox's access token, a wrong key) reaches the node as it came, which then
judges it. A gateway without API keys is open, as a daemon without keys is: every
request is shown the node key.

The Host header goes through unchanged: E2B addresses a sandbox's ports by it.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from branchbox.gateway.nodes import Node, Nodes
from branchbox.server.keys import key_accepted
from branchbox.server.relaying import HOP_BY_HOP

TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=30.0)
"""No read timeout: a run streams for as long as its own timeout lets it."""
UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
               httpx.ReadError, httpx.WriteError, httpx.PoolTimeout)


class Credentials:
    """The gateway's API keys (what clients show) and the node key (what nodes accept)."""

    def __init__(self, keys: Iterable[str], node_key: str | None) -> None:
        self.keys = frozenset(keys)
        self.node_key = node_key

    def client_ok(self, headers: Mapping[str, str]) -> bool:
        """Whether the client shows one of the gateway's keys (always, without keys)."""
        return not self.keys or self._bearer_ok(headers.get("authorization", "")) \
            or self._api_key_ok(headers.get("x-api-key", ""))

    def _bearer_ok(self, value: str) -> bool:
        return key_accepted(self.keys, value)

    def _api_key_ok(self, value: str) -> bool:
        return any([hmac.compare_digest(value.encode(), k.encode()) for k in self.keys])

    def upstream(self, headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """The headers to send the node: not hop-by-hop ones; a client's valid key swapped
        for the node key (every request gets it on an open gateway)."""
        out: list[tuple[str, str]] = []
        for name, value in headers:
            name = name.lower()
            if name in HOP_BY_HOP or (not self.keys and name in ("authorization", "x-api-key")):
                continue
            if name == "authorization" and self._bearer_ok(value):
                value = f"Bearer {self.node_key}" if self.node_key else ""
            elif name == "x-api-key" and self._api_key_ok(value):
                value = self.node_key or ""
            if value:
                out.append((name, value))
        if not self.keys and self.node_key:
            out += [("authorization", f"Bearer {self.node_key}"), ("x-api-key", self.node_key)]
        return out


def error(status: int, message: str, kind: str, **headers: str) -> JSONResponse:
    """An answer of the gateway's own, shaped as the daemon's are."""
    return JSONResponse({"error": message, "type": kind}, status_code=status, headers=headers)


def unavailable(node: Node, what: str) -> JSONResponse:
    return error(503, f"{what} is on node {node.name or node.url}, which is unavailable: "
                      f"{node.error}", "NodeUnavailable", **{"Retry-After": "5"})


async def forward(request: Request, node: Node, nodes: Nodes, client: httpx.AsyncClient,
                  credentials: Credentials, *, body: bytes | None = None,
                  what: str = "the request's sandbox") -> Response:
    """The node's answer to ``request`` (``body``: the request's body when the gateway
    has read it already), streamed back as it comes."""
    path = request.scope.get("raw_path") or request.url.path.encode()
    query = request.scope.get("query_string", b"")
    url = node.url + path.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")
    if body is None and ("content-length" in request.headers
                         or "transfer-encoding" in request.headers):
        content = request.stream()
    else:
        content = body
    upstream = client.build_request(request.method, url, content=content,
                                    headers=credentials.upstream(request.headers.items()))
    try:
        reply = await client.send(upstream, stream=True)
    except UNREACHABLE as exc:
        nodes.down(node, f"{type(exc).__name__}: {exc}")
        return unavailable(node, what)
    response = StreamingResponse(reply.aiter_raw(), status_code=reply.status_code,
                                 background=BackgroundTask(reply.aclose))
    response.raw_headers = [(k, v) for k, v in reply.headers.raw
                            if k.lower().decode("latin-1") not in HOP_BY_HOP]
    return response
