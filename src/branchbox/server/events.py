"""``GET /v1/events``: the engine's lifecycle events as a server-sent event stream.

Each event is one SSE message: ``id: <event id>`` and ``data: <JSON>`` (the
event's ``type`` is inside the JSON, so an ``EventSource``'s ``onmessage`` sees
them all). A ``lost`` notice carries no id, so a client's ``Last-Event-ID``
stays on the last event it really got. A comment line goes out after 15 s
without events: proxies keep the connection, and a client that went away is
noticed. A stream ends when the server stops. Memory per client is nothing but
its cursor into the engine's ring (see ``engine.events``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from branchbox.engine import errors
from branchbox.engine.events import EventBus
from branchbox.server.deps import EngineDep

router = APIRouter(tags=["events"])
SSE = "text/event-stream"
RETRY_MS = 2000  # how soon an EventSource reconnects (with Last-Event-ID) after a drop
KEEPALIVE = 15  # seconds of silence before a comment line

_DESCRIPTION = (
    "Server-sent events, one per lifecycle step: ``id: N`` and ``data: {JSON}`` with "
    "``id``, ``type`` (create | start | fork | merge | close | gone | pause | resume | exec | "
    "commit | checkpoint | restore | lost), ``ts``, ``sandbox``, ``parent``, ``family`` and the "
    "type's fields: create and start (a stopped sandbox running again) ``image``; "
    "fork ``children`` and ``took`` (or ``checkpoint``: forked from that checkpoint); "
    "merge ``winner`` (the child whose state the sandbox now has; its id is retired); "
    "exec ``op``, ``code``, ``stdout``, ``stderr`` (tails of at most 2048 characters), "
    "``text``, ``error``, ``exit_code``, ``duration``; commit ``workspace``, ``version``, "
    "``changed``; checkpoint ``checkpoint`` (its id) and ``name``; restore ``checkpoint``. "
    "``lost`` (no id) says ``count`` events were dropped (-1: unknown) and the stream goes "
    "on at ``resume``.")


@router.get("/v1/events", response_class=StreamingResponse,
            responses={200: {"content": {SSE: {}}, "description": _DESCRIPTION}})
async def events(
    request: Request,
    engine: EngineDep,
    since: Annotated[int | None, Query(ge=0, description=(
        "Resume after this event id (0: everything the daemon still holds); without it "
        "(and without Last-Event-ID) only events from now on."))] = None,
    last_event_id: Annotated[str | None, Header(description=(
        "Sent by an EventSource when it reconnects: resume after it (it wins over "
        "``since``, which stays in the URL of a reconnecting EventSource)."))] = None,
) -> StreamingResponse:
    """The lifecycle events of every sandbox, live, resumable from a bounded history."""
    if last_event_id is not None:  # a reconnect: newer than the ``since`` of its URL
        if not (last_event_id.isascii() and last_event_id.isdigit()) or len(last_event_id) > 18:
            raise errors.InvalidRequest("Last-Event-ID must be an event id (a number)")
        since = int(last_event_id)
    if since is None:  # "from now on" is now, not when the body starts: a client that
        since = engine.events.last_id  # got the headers and then acts sees its events
    return StreamingResponse(_stream(engine.events, since, _stopping(request)), media_type=SSE,
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _stopping(request: Request) -> Callable[[], bool]:
    """Whether the server is shutting down. Its graceful shutdown waits for every response
    to end before the app hears of it, so a stream must notice by itself or hold the
    daemon's stop for the whole grace period."""
    server = getattr(request.app.state, "server", None)  # set by `branchbox serve`
    return lambda: server is not None and server.should_exit


async def _stream(bus: EventBus, since: int | None,
                  stopping: Callable[[], bool]) -> AsyncIterator[str]:
    yield f"retry: {RETRY_MS}\n\n"
    quiet = 0
    async for event in bus.subscribe(since, keepalive=1.0):  # a look at `stopping` a second
        if event is not None:
            quiet = 0
            yield format_event(event)
        elif stopping():
            return
        else:
            quiet += 1
            if quiet % KEEPALIVE == 0:
                yield format_event(None)


def format_event(event: dict | None) -> str:
    """One SSE message (``None``: a keep-alive comment)."""
    if event is None:
        return ": keep-alive\n\n"
    head = f"id: {event['id']}\n" if "id" in event else ""
    # json.dumps escapes newlines, so the data is always one line.
    return f"{head}data: {json.dumps(event, default=str)}\n\n"
