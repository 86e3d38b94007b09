"""Calls in flight when the server stops get a 503 that says so, not a bare 500.

On SIGTERM uvicorn stops accepting connections and waits (``timeout_graceful_shutdown``)
for the requests under way; the ones still running then are cancelled, and a client
whose answer had not started got uvicorn's plain-text "Internal Server Error". So
the moment a stop begins (:meth:`StopSignal.begin`, called from the signal handler),
this middleware answers every request still waiting for the engine with 503 JSON
(``ServerStopping``) and cancels its work (a run is interrupted, as for a client
that hung up), and refuses new requests on kept-alive connections the same way.
An answer already streaming is left to finish or be cut.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from branchbox.server.errors import error_response

log = logging.getLogger(__name__)
STOPPING_MESSAGE = ("the server is stopping; the call was not completed (retry it once the "
                    "server is back)")


class StopSignal:
    """Set once, from a signal handler or any thread, when the server begins to stop."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False

    def event(self) -> asyncio.Event:
        """The event on the running loop (made on first use)."""
        if self._event is None:
            self._event, self._loop = asyncio.Event(), asyncio.get_running_loop()
            if self.stopping:
                self._event.set()
        return self._event

    def begin(self) -> None:
        """Safe in a signal handler: the event is set from the loop."""
        self.stopping = True
        if self._loop is not None and self._event is not None:
            self._loop.call_soon_threadsafe(self._event.set)


class StopGate:
    """ASGI middleware: 503 ``ServerStopping`` for HTTP calls once ``signal`` is set."""

    def __init__(self, app: ASGIApp, signal: StopSignal) -> None:
        self.app = app
        self.signal = signal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stop = self.signal.event()
        if stop.is_set():
            await _refuse(scope, receive, send)
            return
        started = muted = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            if muted:  # the call was cut: what it still sends is not the answer
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        call = asyncio.ensure_future(self.app(scope, receive, watched_send))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({call, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if call.done() or started:
                await call
                return
            muted = True
            call.cancel()
            await asyncio.wait({call})  # whatever the cut call ends with, the answer is 503
            if not call.cancelled() and call.exception() is not None:
                log.info("a call cut by the stop ended with %r", call.exception())
            await _refuse(scope, receive, send)
        finally:
            stopped.cancel()
            if not call.done():
                call.cancel()


async def _refuse(scope: Scope, receive: Receive, send: Send) -> None:
    await error_response(503, STOPPING_MESSAGE, "ServerStopping")(scope, receive, send)
