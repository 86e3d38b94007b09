"""The SDK's only door to the server: requests, streams and NDJSON, with errors mapped.

An ``Api`` wraps one ``httpx.AsyncClient``. A sandbox and every sandbox forked
from it share one (forking 32 children opens no new connections); the last of
them to close or detach closes it. Transport failures become ``SandboxError``
with the httpx exception chained, so callers catch one hierarchy.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import httpx

from branchbox.sdk._channel import CallChannel, Unavailable
from branchbox.sdk._config import resolve, ssl_context
from branchbox.sdk._daemon import ensure_daemon
from branchbox.sdk._errors import SandboxError, error_from_line, error_from_reply

# No read timeout: a run may print nothing for an hour; the server enforces run timeouts.
_TIMEOUT = httpx.Timeout(None, connect=10.0)


class Api:
    def __init__(self, url: str | None = None, api_key: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = resolve(url, api_key)
        # Only the default local daemon is started on demand, and only when we reach it
        # through our own socket transport (a caller's transport decides for itself).
        self._autostart = self.config.local_data_dir if transport is None else None
        own_transport = transport is None
        if transport is None and (self.config.socket or
                                  self.config.base_url.startswith("http://")):
            # No TLS over a unix socket or plain http: no CA bundle to load.
            transport = httpx.AsyncHTTPTransport(uds=self.config.socket or None,
                                                 verify=ssl_context(False))
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key \
            else {}
        # Runs go over a WebSocket of the server's, unless the caller brought a transport
        # (in-process ASGI, say: it carries HTTP only).
        self._channel = CallChannel(self.config) if own_transport else None
        tls = {} if transport is not None else {"verify": ssl_context(True)}  # https
        self._client = httpx.AsyncClient(base_url=self.config.base_url, transport=transport,
                                         headers=headers, timeout=_TIMEOUT, **tls)
        self._users = 1

    def is_local_socket(self) -> bool:
        """Whether requests go over a unix socket (so the client shares the daemon's host)."""
        return bool(self.config.socket)

    def base_url(self) -> str:
        return self.config.base_url

    async def ready(self) -> None:
        """Make sure a server answers (starting the local daemon if that is ours to do)."""
        if self._autostart is not None:
            try:
                await ensure_daemon(self._client, self._autostart)
            except httpx.TransportError as exc:
                raise self._unreachable(exc) from exc
            self._autostart = None

    def retain(self) -> Api:
        self._users += 1
        return self

    async def release(self) -> None:
        self._users -= 1
        if self._users == 0:
            if self._channel is not None:
                await self._channel.close()
            await self._client.aclose()

    @asynccontextmanager
    async def stream(self, method: str, path: str, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        """A response whose body is not read yet; error replies raise their exception."""
        try:
            async with self._client.stream(method, path, **kwargs) as reply:
                if reply.is_error:
                    await reply.aread()
                    raise error_from_reply(reply.status_code, _body(reply))
                yield reply
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """The decoded JSON reply (None for an empty one, as after 204)."""
        async with self.stream(method, path, **kwargs) as reply:
            await reply.aread()
        return reply.json() if reply.content else None

    async def lines(self, method: str, path: str, **kwargs: Any) -> AsyncGenerator[dict, None]:
        """The objects of an NDJSON reply, as they arrive."""
        async with self.stream(method, path, **kwargs) as reply:
            async for line in reply.aiter_lines():
                if line.strip():
                    yield json.loads(line)

    async def run(self, op: str, sandbox_id: str, body: dict) -> AsyncGenerator[dict, None]:
        """The lines of a run (``op``: ``run_code`` or ``commands``, with ``body`` as POST
        /v1/sandboxes/{id}/{op} takes it): over the server's calls WebSocket, else HTTP."""
        if self._channel is not None:
            async with aclosing(self._channel.lines(op, sandbox_id, body)) as lines:
                try:
                    first = await anext(lines)
                except Unavailable:  # nothing was sent
                    pass
                else:
                    yield first
                    async for line in lines:
                        yield line
                    return
        async with aclosing(self.lines("POST", f"/v1/sandboxes/{sandbox_id}/{op}",
                                       json=body)) as lines:
            async for line in lines:
                yield line

    async def answer(self, op: str, sandbox_id: str, body: dict, route: str,
                     route_body: dict | None = None, method: str = "POST", *,
                     open_only: bool = False) -> dict:
        """The answer of a call that answers once (a close, fork, merge, checkpoint or
        restore: ``server.call_channel``'s ops) over the calls WebSocket, ~2 ms sooner
        than HTTP; where there is none, the JSON reply of ``method`` on ``route`` with
        ``route_body`` (the route carries in its path what ``body`` names: a checkpoint,
        a winner). With ``open_only``, HTTP unless the connection is open already: a
        call that may be the last of its client (a close) would pay more for opening
        one than it saves."""
        if self._channel is not None and (self._channel.is_open() or not open_only):
            async with aclosing(self._channel.lines(op, sandbox_id, body)) as lines:
                try:
                    async for line in lines:
                        if line.get("type") == "error":
                            raise error_from_line(line)
                        return {key: value for key, value in line.items() if key != "type"}
                except Unavailable:  # nothing was sent
                    pass
                else:
                    raise error_from_reply(502, f"the server sent no answer to {op}")
        return await self.call(method, route, json=route_body) or {}

    def _unreachable(self, exc: httpx.TransportError) -> SandboxError:
        return SandboxError(f"lost or could not reach the branchbox server at {self.config.url} "
                            f"({type(exc).__name__}: {exc})",
                            hint="start it with `branchbox serve`, or point BRANCHBOX_URL at "
                                 "a running one")


def _body(reply: httpx.Response) -> Any:
    try:
        return reply.json()
    except ValueError:
        return reply.text
