"""The SDK's end of ``/v1/calls``: runs of code and commands over one WebSocket.

A run over HTTP costs ~2.3 ms of the SDK's and the server's Python around ~0.6 ms of
work in the engine and the REPL; over an open WebSocket it is a message each way
(see ``server.call_channel`` for the protocol). One ``CallChannel`` belongs to an
``Api``, so a sandbox and every child forked from it share one connection, and runs
of many sandboxes go on over it at once.

The connection is opened at the first run, on the loop of that run, and again after
it closes, on another loop, or in a process forked since (a child must not speak on
its parent's connection). A server that has no ``/v1/calls`` (an older daemon, a proxy that
passes no WebSocket) is remembered: runs go over HTTP from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncGenerator
from typing import Any

from websockets.asyncio.client import ClientConnection, connect, unix_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from branchbox.sdk._config import ClientConfig, ssl_context
from branchbox.sdk._errors import SandboxError, error_from_reply

MAX_MESSAGE = 16 << 20  # the server's limit of one WebSocket message (uvicorn's default)
_FINAL = ("result", "exit", "error")
_SERVICE_RESTART = 1012  # the close code of a server that stops (uvicorn's)


class Unavailable(Exception):
    """The server takes no runs over a WebSocket: HTTP it is."""


class CallChannel:
    def __init__(self, config: ClientConfig) -> None:
        self._config = config
        self._ws: ClientConnection | None = None
        self._pid = 0
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the connection's
        self._opening: asyncio.Lock | None = None
        self._runs: dict[int, asyncio.Queue] = {}
        self._cancels: set[asyncio.Future] = set()  # sends of cancels under way
        self._ids = 0
        self.unavailable = False

    async def lines(self, op: str, sandbox_id: str, body: dict) -> AsyncGenerator[dict, None]:
        """The lines of a run (as an NDJSON reply's), its final one last. Raises
        :class:`Unavailable` before anything is sent if the server takes no runs here;
        a run given up on (the generator closed early) is cancelled on the server."""
        ws = await self._open()
        self._ids += 1
        # Unbounded: the reader never waits for one run's reader (that would hold up every
        # run on the connection, and for ever once that run is given up on).
        run, lines = self._ids, asyncio.Queue()
        self._runs[run] = lines
        message = json.dumps({"id": run, "op": op, "sandbox": sandbox_id, "body": body}).encode()
        if len(message) > MAX_MESSAGE:
            del self._runs[run]
            raise Unavailable("larger than a message")
        finished = False
        try:
            try:
                await ws.send(message, text=True)
            except ConnectionClosed as exc:  # closed meanwhile: nothing was sent
                raise Unavailable("closed") from exc
            while True:
                line = await lines.get()
                if isinstance(line, BaseException):
                    raise line
                yield line
                if line.get("type") in _FINAL:
                    finished = True
                    return
        finally:
            self._runs.pop(run, None)
            if not finished and ws.state.name == "OPEN":
                # Not awaited: this may run while the caller is being cancelled.
                cancel = asyncio.ensure_future(_quietly(ws.send(json.dumps({"cancel": run}))))
                self._cancels.add(cancel)
                cancel.add_done_callback(self._cancels.discard)

    async def _open(self) -> ClientConnection:
        if self.unavailable:
            raise Unavailable("remembered")
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._pid != os.getpid():
            # Another loop's connection (an earlier asyncio.run) or a forked process's
            # inherited one cannot be used here: left alone, not closed.
            self._ws, self._loop, self._opening = None, loop, asyncio.Lock()
            self._pid = os.getpid()
        async with self._opening:
            ws = self._ws
            if ws is not None and ws.state.name == "OPEN":
                return ws
            headers = ({"Authorization": f"Bearer {self._config.api_key}"}
                       if self._config.api_key else {})
            # Pings find a TCP connection that died quietly (an idle one through NAT, say);
            # a unix socket cannot die so.
            # No size limit on what the server sends: a line is as large as the run's
            # (bounded) output makes it, as over HTTP; a limit would close the connection
            # and end every run on it.
            options: dict[str, Any] = {"additional_headers": headers, "max_size": None,
                                       "open_timeout": 10, "compression": None,
                                       "ping_interval": None if self._config.socket else 20}
            try:
                if self._config.socket:
                    ws = await unix_connect(self._config.socket, "ws://branchbox/v1/calls",
                                            **options)
                else:
                    url = "ws" + self._config.url.removeprefix("http") + "/v1/calls"
                    tls = ssl_context(True) if url.startswith("wss:") else None
                    ws = await connect(url, proxy=None, ssl=tls, **options)
            except InvalidStatus as exc:
                if exc.response.status_code in (401, 403):  # a bad key: HTTP says so fully
                    raise Unavailable("refused") from exc
                self.unavailable = True
                raise Unavailable("not served") from exc
            except (InvalidHandshake, OSError, TimeoutError) as exc:
                raise Unavailable(str(exc)) from exc
            self._ws = ws
            self._reader = asyncio.ensure_future(self._read(ws))
            return ws

    async def _read(self, ws: ClientConnection) -> None:
        """Hand each line to its run's queue; at the end, the end to every run."""
        ending: BaseException
        try:
            async for message in ws:
                reply = json.loads(message)
                lines = self._runs.get(reply.get("id"))
                if lines is not None:
                    lines.put_nowait(reply["line"])
            ending = SandboxError("the branchbox server closed the connection")
        except ConnectionClosed as exc:
            ending = (error_from_reply(503, {"error": "the server is stopping; the call was "
                                             "not completed (retry it once the server is "
                                             "back)", "type": "ServerStopping"})
                      if exc.rcvd is not None and exc.rcvd.code == _SERVICE_RESTART else
                      SandboxError(f"lost the branchbox server at {self._config.url} ({exc})"))
        except Exception as exc:  # noqa: BLE001 - a reply we cannot read ends the connection
            ending = SandboxError(f"unreadable reply from the branchbox server: {exc!r}")
            await ws.close()
        for lines in list(self._runs.values()):
            lines.put_nowait(ending)

    def is_open(self) -> bool:
        """Whether a connection of this process and loop is open now (a call sent now
        opens none)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        return (self._ws is not None and self._ws.state.name == "OPEN"
                and self._loop is loop and self._pid == os.getpid())

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        current = asyncio.get_running_loop()
        if ws is not None and self._pid == os.getpid() and self._loop is current:
            await ws.close()
            if self._reader is not None:
                await asyncio.gather(self._reader, return_exceptions=True)


async def _quietly(sending) -> None:
    with contextlib.suppress(ConnectionClosed, OSError):
        await sending
