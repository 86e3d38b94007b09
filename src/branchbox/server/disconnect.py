"""Noticing a client that went away, for the engine (``engine.run_guard.CALLER_GONE``).

A handler waiting on the engine does not read from its client, so nothing tells
it when the client hangs up: a call queued behind a busy sandbox would run
later for nobody (and a client that retries would run non-idempotent code
twice), and a run that prints nothing would run on with the sandbox locked.
This ASGI middleware gives every HTTP request an event that is set when its
client disconnects, which the engine checks while a call waits for a sandbox
and while it waits for the sandbox's next event.

Only the request's body may be read before the disconnect message, so the
watch starts once the application has received the whole body (at once for a
request without one); from then on it owns ``receive`` and hands the
disconnect message to whoever asks later (a streaming response's own watch).
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from branchbox.engine.run_guard import CALLER_GONE, Hangup

_NO_BODY: Message = {"type": "http.request", "body": b"", "more_body": False}


class DisconnectWatch:
    """ASGI middleware: sets ``CALLER_GONE`` to an event set when the client hangs up."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gone = Hangup()
        watcher: asyncio.Task | None = None
        last: Message = {"type": "http.disconnect"}

        async def watch() -> None:
            nonlocal last
            while True:  # after the body only the disconnect comes (empty bodies skipped)
                message = await receive()
                if message["type"] == "http.disconnect":
                    last = message
                    gone.set()
                    return

        async def watched_receive() -> Message:
            nonlocal watcher
            if watcher is not None:  # the body is in: the watch owns receive
                await gone.wait()
                return last
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                watcher = asyncio.get_running_loop().create_task(watch())
            return message

        headers = Headers(scope=scope)
        if "transfer-encoding" not in headers and headers.get("content-length", "0") == "0":
            watcher = asyncio.get_running_loop().create_task(watch())
            pending: list[Message] = [_NO_BODY]

            async def bodiless_receive() -> Message:
                return pending.pop() if pending else await watched_receive()

            app_receive: Receive = bodiless_receive
        else:
            app_receive = watched_receive
        token = CALLER_GONE.set(gone)
        try:
            await self.app(scope, app_receive, send)
        finally:
            CALLER_GONE.reset(token)
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
