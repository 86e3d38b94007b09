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
that cookie, nor use headers that act on the daemon's whole origin
(``Clear-Site-Data``, ``Alt-Svc``, ``Strict-Transport-Security``). Its redirects
(``Location``, ``Content-Location``, ``Refresh``) stay under its own prefix: a
client following ``307 Location: /v1/sandboxes/<another>`` would otherwise send the
daemon's key there (same host), with the method it used (a DELETE closed another
sandbox). What a sandbox sends back is bounded like everything else from it: a
WebSocket message larger than ``WS_MAX_MESSAGE`` closes the relay (1009), and a relay
holds at most a few messages (``relaying.SandboxConnection``).

A proxied request ends when nobody can be served by it any more: its client hung up
(also before the sandbox's server answered: it used to be held for ever, 256 of them
refused every later request to that sandbox), or the sandbox's network is gone (a
closed sandbox sends no reset: the daemon's sockets to it would wait for ever).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import socket
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple
from urllib.parse import SplitResult, unquote, urljoin, urlsplit, urlunsplit

import httpx
import websockets
from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from branchbox.engine import errors
from branchbox.engine.run_guard import CALLER_GONE, CallerGone, CutWait
from branchbox.engine.sandboxes import Engine
from branchbox.server.deps import EngineDep, ws_key_ok
from branchbox.server.e2b_ports import E2B_ADDRESSED
from branchbox.server.relaying import (
    CLOSE_TIMEOUT,
    HOP_BY_HOP,
    SandboxConnection,
    relay,
    subprotocols,
)
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
# No connection to a sandbox is kept for a later request: a server can answer more than
# it was asked, and a kept connection's extra answer went to the next request to that
# address, which a sandbox made later may hold.
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=0)
PROXIED_PER_SANDBOX = 256
NETWORK_CHECK_EVERY = 1.0
"""Seconds between checks, per proxied request, that the sandbox's network is still there."""
# Headers that act on the daemon's whole origin, which the sandbox's pages share.
_ORIGIN_WIDE = {b"clear-site-data", b"alt-svc", b"strict-transport-security"}
_LOCATIONS = {b"location", b"content-location"}
_URL_NOISE = re.compile(r"[\t\n\r]")  # removed from anywhere in a URL by browsers
_DOT = re.compile("%2e", re.IGNORECASE)
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_SPECIAL = frozenset({"http", "https", "ws", "wss"})  # the URL standard's, that take hosts
_REFRESH = re.compile(r"\s*([\d.]+)\s*(?:[;,]\s*)?(?:url\s*=\s*)?(.*)", re.IGNORECASE | re.DOTALL)


class PortUnreachable(errors.EngineError):
    status = 502
    kind = "SandboxError"


class _Target(NamedTuple):
    address: str
    port: int
    body_key: str  # whose network it is: gone with that body (a close, a merge, a restore)

    @property
    def netloc(self) -> str:
        return f"{self.address}:{self.port}"


def _target(engine: Engine, sandbox_id: str, port: int) -> _Target:
    """The sandbox's server (404 when it does not exist, 400 on a bad port)."""
    if not 1 <= port <= 65535:
        raise errors.InvalidRequest(f"port must be between 1 and 65535, not {port}")
    sb = engine.get(sandbox_id)
    address = engine.net.address(sb.body.key)
    if address is None:
        raise PortUnreachable("the sandbox has no network address")
    return _Target(address, port, sb.body.key)


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
    target = _target(engine, sandbox_id, port)
    where = _Where.of(request, target, sandbox_id, path)
    headers = _forwarded(request.headers.items())
    client = _client(request)
    release = _admit(request, sandbox_id)
    vigil = _Vigil(lambda: engine.net.address(target.body_key) is not None)
    try:
        return await _proxied(client, request, where, headers, vigil, release)
    except BaseException:
        vigil.close()
        release()
        raise


async def _proxied(client: httpx.AsyncClient, request: Request, where: _Where,
                   headers: list[tuple[str, str]], vigil: _Vigil,
                   release: Callable[[], None]) -> StreamingResponse:
    # A body only when the request has one: an empty chunked body on a GET is bytes a
    # simple server never reads, and closing with unread bytes resets the connection.
    has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
    upstream = client.build_request(request.method, where.base,
                                    params=request.url.query or None, headers=headers,
                                    content=request.stream() if has_body else None)
    try:
        reply = await vigil.wait(client.send(upstream, stream=True))
    except httpx.TransportError as exc:
        raise PortUnreachable(f"nothing answers on port {where.target.port} in the sandbox: "
                              f"{type(exc).__name__}") from None
    weakref.finalize(reply, release)  # whatever happens to the answer below

    async def done() -> None:
        vigil.close()
        release()
        await reply.aclose()

    async def body() -> AsyncIterator[bytes]:
        """The sandbox's body; its connection ends with it, also when our client leaves
        mid-way (Starlette then skips the background task) or the sandbox goes."""
        chunks = reply.aiter_raw()
        try:
            while True:
                try:
                    chunk = await vigil.wait(anext(chunks))
                except (StopAsyncIteration, CallerGone, PortUnreachable):
                    return  # past the headers, a body cut short is all there is to say
                yield chunk
        finally:
            await done()

    response = StreamingResponse(body(), status_code=reply.status_code,
                                 background=BackgroundTask(done))
    response.raw_headers = _returned(reply.headers.raw, where)
    return response


class _Vigil(CutWait):
    """Ends a proxied request's waits on the sandbox's server once they can serve nobody:
    our client hung up (CallerGone: ``server.disconnect`` tells), or the sandbox's network
    is gone (PortUnreachable). The wait under way is cancelled there and then (its
    connection is closed with it); a timer, not a task, watches the network."""

    def __init__(self, alive: Callable[[], bool]) -> None:
        super().__init__()
        self._alive = alive
        gone = CALLER_GONE.get()
        self._undo = (gone.on_set(partial(self.cut, CallerGone("the client went away")))
                      if gone is not None else None)
        self._timer = asyncio.get_running_loop().call_later(NETWORK_CHECK_EVERY, self._check)

    def close(self) -> None:
        if self._undo is not None:
            self._undo()
        self._timer.cancel()

    def _check(self) -> None:
        if self._alive():
            self._timer = asyncio.get_running_loop().call_later(NETWORK_CHECK_EVERY,
                                                                self._check)
        else:
            self.cut(PortUnreachable("the sandbox is gone: closed, or its body replaced"))


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


def _returned(raw: list[tuple[bytes, bytes]], where: _Where) -> list[tuple[bytes, bytes]]:
    """The sandbox's answer headers as sent (several Set-Cookie stay several), as bytes
    (whatever their charset), without hop-by-hop ones, uvicorn's own Date and Server,
    a cookie of the daemon's name or a header that acts on the daemon's whole origin,
    with its redirects kept under its prefix; plus the opaque-origin policy."""
    kept = []
    for name, value in raw:
        name = name.lower()
        if (name.decode("latin-1") in _HOP or name in (b"date", b"server")
                or name in _ORIGIN_WIDE):
            continue
        if name == b"set-cookie":
            value = _cookie(value, where)
            if value is None:
                continue
        elif name in _LOCATIONS:
            value = where.relocated(value.decode("latin-1")).encode("latin-1")
        elif name == b"refresh":
            refresh = _refresh(value.decode("latin-1"), where)
            if refresh is None:
                continue
            value = refresh.encode("latin-1")
        kept.append((name, value))
    return [*kept, (b"content-security-policy", _PAGE_POLICY)]


def _cookie(set_cookie: bytes, where: _Where) -> bytes | None:
    """A ``Set-Cookie`` as the client may store it, or None. Every sandbox's pages share
    the daemon's origin, so a cookie is kept to its sandbox's prefix: its ``Path`` goes
    under the prefix (one set for "/" reached every sandbox's server, and so its
    owner's session), its ``Domain`` is dropped (a cookie for a parent domain reached
    every sandbox addressed by name). A cookie without a name (``=branchbox_key=x``,
    which browsers send as ``branchbox_key=x``) or of the daemon's name is dropped."""
    name = _cookie_name(set_cookie)
    if not name or name == COOKIE.lower():
        return None
    pair, *attributes = set_cookie.split(b";")
    path = b"/"
    kept = [pair]
    for attribute in attributes:
        key, _, value = attribute.partition(b"=")
        key = key.strip(b" \t").lower()
        if key == b"path":
            path = value.strip(b" \t") if value.strip(b" \t").startswith(b"/") else b"/"
        elif key != b"domain":
            kept.append(attribute)
    prefix = where.prefix.encode("latin-1")
    kept.append(b" Path=" + (prefix + path if prefix else path))
    return b";".join(kept)


def _cookie_name(set_cookie: bytes) -> str:
    """The name a browser gives the cookie of a ``Set-Cookie`` (RFC 6265bis 5.6: what
    precedes the first ``=`` of its first pair, spaces and tabs around it removed; no
    ``=``, no name), lower-cased: whatever the case, it is not the sandbox's to set."""
    name, eq, _ = set_cookie.split(b";", 1)[0].partition(b"=")
    return name.strip(b" \t").decode("latin-1").lower() if eq else ""


def _refresh(value: str, where: _Where) -> str | None:
    """A ``Refresh`` header (``<seconds>[; url=<ref>]``) with its URL relocated; None when
    it cannot be read (a browser ignores those)."""
    match = _REFRESH.fullmatch(value)
    if match is None:
        return None
    delay, ref = match.group(1), match.group(2).strip()
    if ref[:1] in ("'", '"'):
        ref = ref[1:].split(ref[0], 1)[0]
    return f"{delay}; url={where.relocated(ref)}" if ref else delay


@dataclass(frozen=True)
class _Where:
    """Where the client sees the sandbox's server, to resolve the references it sends."""

    target: _Target
    base: str  # the URL the sandbox's server was asked: its relative references' base
    prefix: str  # where the client sees the server's "/"
    daemon: frozenset[str]  # the daemon's host names as the client may see them
    domain: bool  # E2B's addressing: every name under one of ``daemon`` is the daemon's

    @classmethod
    def of(cls, request: Request, target: _Target, sandbox_id: str, path: str) -> _Where:
        host = _host_key(request.url.hostname or "")
        names = {host, *_forwarded_hosts(request)}  # behind a proxy: its name too
        base = f"http://{target.netloc}/{path}"
        if not request.scope.get(E2B_ADDRESSED):
            return cls(target, base, f"/v1/sandboxes/{sandbox_id}/ports/{target.port}",
                       frozenset(names), False)
        # Named by E2B's Host or headers, the port's "/" is the root; by Host, every name
        # in the domain after ``<port>-<id>.`` is the daemon's.
        named = f"{target.port}-{sandbox_id}."
        if host.startswith(named):
            return cls(target, base, "", frozenset({*names, host.removeprefix(named)}), True)
        return cls(target, base, "", frozenset(names), False)

    def relocated(self, ref: str) -> str:
        """``ref`` as the client must see it. One on the sandbox's server (relative,
        path-absolute, or absolute to the address the server was asked at) goes under the
        prefix; so does one to the daemon's own host (its API is never the sandbox's to
        point a client at); one to another host is the sandbox's business."""
        ref = _URL_NOISE.sub("", ref.strip(" \t\f\v\x00")).replace("\\", "/")  # as browsers
        if (scheme := _SCHEME.match(ref)) and scheme.group(1).lower() in _SPECIAL \
                and not ref[scheme.end():].startswith("//"):
            # "https:/v1/..." names no host: a browser (or requests, httpx) on a page of
            # that scheme reads it as a path of the page's host: the daemon's.
            ref = ref[scheme.end():]
        url = urlsplit(urljoin(self.base, ref))
        if not (self._on_server(url) or self._is_daemon(url.hostname)):
            return ref
        return urlunsplit(("", "", self.prefix + _undotted(url.path), url.query, url.fragment))

    def _on_server(self, url: SplitResult) -> bool:
        try:
            port = url.port
        except ValueError:
            return False
        return (url.scheme == "http" and url.hostname == self.target.address
                and port == self.target.port)

    def _is_daemon(self, hostname: str | None) -> bool:
        if hostname is None:
            return False
        host = _host_key(hostname)
        return host in self.daemon or (self.domain and any(
            host.endswith("." + name) for name in self.daemon))


def _forwarded_hosts(request: Request) -> list[str]:
    """The host names a proxy in front of the daemon says the client used
    (``X-Forwarded-Host``, ``Forwarded: host=``), as :func:`_host_key` keeps them."""
    named = [part for value in request.headers.getlist("x-forwarded-host")
             for part in value.split(",")]
    named += [m.group(1) for value in request.headers.getlist("forwarded")
              for m in re.finditer(r'host="?([^";,]+)', value, re.IGNORECASE)]
    return [_host_key(urlsplit(f"//{name.strip()}").hostname or "") for name in named]


def _host_key(hostname: str) -> str:
    """A host name as browsers compare it: percent-decoded, IDNA-mapped (full-width
    letters, a soft hyphen), lower case, no final dot, an IPv4 address in its dotted form
    whichever form it was written in (``2130706433``, ``0x7f.1``)."""
    host = unquote(hostname)
    with contextlib.suppress(UnicodeError):
        host = host.encode("idna").decode("ascii")
    host = host.lower().rstrip(".")
    with_v4 = re.fullmatch(r"[0-9a-fx.]+", host) and any(c.isdigit() for c in host)
    try:
        if with_v4:
            return socket.inet_ntoa(socket.inet_aton(host))
        return str(ipaddress.ip_address(host))
    except (OSError, ValueError):
        return host


def _undotted(path: str) -> str:
    """``path`` with its dot segments resolved (RFC 3986 5.2.4; ``%2e`` is a dot, as
    browsers read it), never above its root and never starting with ``//`` (a host)."""
    segments = _DOT.sub(".", path).split("/")[1:]
    kept: list[str] = []
    for segment in segments:
        if segment == "..":
            if kept:
                kept.pop()
        elif segment != ".":
            kept.append(segment)
    if segments and segments[-1] in (".", ".."):
        kept.append("")
    return "/" + "/".join(kept).lstrip("/")


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
    url = f"ws://{target.netloc}/{path}" + (f"?{query}" if query else "")
    try:
        upstream = await websockets.connect(url, subprotocols=subprotocols(ws),
                                            open_timeout=10, max_size=WS_MAX_MESSAGE,
                                            max_queue=0, close_timeout=CLOSE_TIMEOUT,
                                            create_connection=SandboxConnection, proxy=None)
    except (TimeoutError, OSError, websockets.WebSocketException):
        await ws.close(code=1011, reason=f"nothing answers on port {port} in the sandbox")
        return
    await ws.accept(subprotocol=upstream.subprotocol)

    async def sandbox_gone() -> None:
        while engine.net.address(target.body_key) is not None:
            await asyncio.sleep(NETWORK_CHECK_EVERY)

    await relay(ws, upstream, until=sandbox_gone)
