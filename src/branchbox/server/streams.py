"""Engine event streams as HTTP responses (NDJSON lines or raw bytes).

Once a streaming response has sent its status line, an error can no longer
change it. So a stream is *opened* first: its first event is awaited before
the response exists, and whatever fails that early (unknown sandbox, dead
REPL, a path the agent refuses) becomes an ordinary HTTP error. Failures
after that point end an NDJSON stream with an ``error`` line, and abort a
byte stream mid-body so the client cannot mistake a partial file for a whole.

A run whose first event is already its last (no output, the common short
call) is answered in one piece: nothing is left to stream, and a plain
response costs far less than a streaming one.

A body yields to the event loop after every event. Events can be ready one after
another for a long time (a sandbox that writes as fast as it can), and a send to
a client that went away returns at once: without a yield, the task that notices
the disconnect would never run, and neither would anything else. Once noticed,
the body is cancelled and closes its events at once, which abandons the request
in the sandbox (an abandoned run is interrupted; see ``runtime.channel``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi.responses import Response, StreamingResponse

from branchbox.engine import errors
from branchbox.server.errors import describe
from branchbox.server.sandbox_json import dumps

log = logging.getLogger("branchbox.server")

Event = tuple[dict, bytes]
T = TypeVar("T")
NDJSON = "application/x-ndjson"


async def opened(events: AsyncIterator[T]) -> AsyncIterator[T]:
    """``events`` with its first event already received (raising any early failure here)."""
    return _resume(await _first(events), events)


async def _first(events: AsyncIterator[T]) -> T:
    try:
        return await anext(events)
    except StopAsyncIteration:
        raise errors.EngineError("the sandbox's agent ended a request without answering") \
            from None


async def _resume(first: T, events: AsyncIterator[T]) -> AsyncIterator[T]:
    # Closing `events` here (also when the client goes away) releases the sandbox's lock.
    try:
        yield first
        async for item in events:
            yield item
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def event_line(header: dict, final_type: str) -> dict:
    """An agent event as a client sees it: ``{"type": kind, ...fields}``."""
    if header.get("ev") == "done":
        # The type last: the result is the sandbox's, and must not end a run differently.
        return {**(header.get("result") or {}), "type": final_type}
    fields = {k: v for k, v in header.items() if k not in ("rid", "ev")}
    return {"type": header.get("ev"), **fields}


def error_line(message: str, kind: str, status: int) -> list[dict]:
    """How a native stream reports a failure after its status line: one ``error`` line."""
    return [{"type": "error", "error": message, "kind": kind, "status": status}]


async def ndjson_response(events: AsyncIterator[Event], to_lines: Callable[[dict], list[dict]],
                          failure: Callable[[str, str, int], list[dict]] = error_line
                          ) -> Response:
    """``to_lines(header)`` for each event, one JSON object per line, once ``events`` is
    opened (raising any early failure here); a later failure ends the stream with
    ``failure(message, kind, status)``."""
    first = await _first(events)
    if first[0].get("ev") == "done":  # the agent's last event: the run is over
        await events.aclose()  # type: ignore[attr-defined]
        return Response(b"".join(map(encode_line, to_lines(first[0]))), media_type=NDJSON)
    rest = _resume(first, events)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for header, _ in rest:
                for line in to_lines(header):
                    yield encode_line(line)
                await asyncio.sleep(0)  # let a client's disconnect (and the rest) be seen
        except Exception as exc:  # the status line is gone: report in-band
            status, message, kind = describe(exc)
            if status == 500:
                log.error("stream failed", exc_info=exc)
            for line in failure(message, kind, status):
                yield encode_line(line)
        finally:
            await rest.aclose()

    return StreamingResponse(body(), media_type=NDJSON)


def bytes_response(events: AsyncIterator[Event]) -> StreamingResponse:
    """The payloads of ``events`` as the response body, never held whole in memory."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for _, payload in events:
                if payload:
                    yield payload
                await asyncio.sleep(0)
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(body(), media_type="application/octet-stream")


def list_response(key: str, batches: AsyncIterator[list]) -> StreamingResponse:
    """``{key: [...]}`` with the items of ``batches``, each batch encoded as it comes: a
    long list is never one piece of work, nor whole in memory."""

    async def body() -> AsyncIterator[bytes]:
        sep = b""
        yield b"{" + dumps(key) + b":["
        try:
            async for batch in batches:
                if batch:
                    yield sep + dumps(batch)[1:-1]
                    sep = b","
        finally:
            await batches.aclose()  # type: ignore[attr-defined]
        yield b"]}"

    return StreamingResponse(body(), media_type="application/json")


def encode_line(line: dict) -> bytes:
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"
