"""Runs over one WebSocket: the SDK's way to run code and commands, fork, merge,
checkpoint, restore and close.

An HTTP request costs this server ~0.9 ms of its event loop (routing, four middlewares,
dependencies, a response) and httpx's client ~1.4 ms; a message on an open WebSocket
costs each side tens of microseconds. So the SDK sends every ``run_code``, foreground
command, fork, merge, checkpoint and restore of its sandboxes down one connection to
``/v1/calls`` (and falls back to HTTP where it cannot open one), many at once, and a
close too once that connection is open. A run here is the very call of its HTTP route
(``POST .../run_code``, ``.../commands``, ``.../fork``, ``.../merge_into/{winner}``,
``.../checkpoints``, ``.../checkpoints/{cp}/restore``, ``.../checkpoints/{cp}/fork``,
``DELETE /v1/sandboxes/{id}``): the same validation, engine call, lines and replay
log; what the route has in its path after the sandbox's id, the body names
(``winner``, ``checkpoint``).

Client to server, one JSON object per text message::

    {"id": N, "op": "run_code" | "commands" | "fork" | "merge_into" | "checkpoint"
                    | "restore" | "fork_checkpoint" | "close", "sandbox": ID, "body": {...}}
    {"cancel": N}        the client gave up on run N

Server to client: ``{"id": N, "line": {...}}`` for each line of run N, in order; its
last line is its ``result`` (``exit``) or an ``error`` line (``{"type": "error",
"error", "kind", "status"}``, as an NDJSON stream ends after a failure); every op but
a run of code or a command answers with one line, its ``result``: what its route's
JSON reply holds (a fork's children and their addresses, a checkpoint's info; nothing
more for a merge, a restore or a close). Runs on one connection go
on at once (each sandbox still runs its calls one at a time).

A cancelled run, and every run of a connection that closes, is abandoned as an HTTP
call whose client hung up is (``engine.run_guard``): interrupted if it runs, never run
if it waits. A message that is not a request closes the connection (1007): nothing
could answer it. At most :data:`MAX_RUNS` run at once on a connection; more are
answered 429.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import State

from branchbox.engine.run_guard import CALLER_GONE, Hangup
from branchbox.server.deps import ws_key_ok
from branchbox.server.errors import describe, validation_message
from branchbox.server.execution import code_run, command_run
from branchbox.server.instants import checkpoint_forked, checkpointed, restored
from branchbox.server.models import (
    Close,
    CreateCheckpoint,
    Fork,
    ForkCheckpoint,
    MergeInto,
    Restore,
    RunCode,
    RunCommand,
)
from branchbox.server.sandboxes import closed, forked, merged
from branchbox.server.streams import Event, error_line

log = logging.getLogger("branchbox.server")
router = APIRouter(tags=["execution"])
MAX_RUNS = 64


async def _lines(events: AsyncIterator[Event],
                 to_lines: Callable[[dict], list[dict]]) -> AsyncIterator[dict]:
    try:
        async for header, _ in events:
            for line in to_lines(header):
                yield line
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def _answer(call: Callable[[State, str, Any], Awaitable[dict]]
            ) -> Callable[[State, str, Any], AsyncIterator[dict]]:
    """The lines of a call that answers once: its answer as a ``result`` line."""
    async def lines(state: State, sandbox_id: str, body: Any) -> AsyncIterator[dict]:
        yield {"type": "result", **await call(state, sandbox_id, body)}
    return lines


# op -> (its body's model, its lines): what the HTTP route of the same call answers
# (POST /v1/sandboxes/{id}/{op} for runs and forks; the others carry in their path what
# their body names here: a checkpoint, a winner).
_RUNS: dict[str, tuple[type, Callable[[State, str, Any], AsyncIterator[dict]]]] = {
    "run_code": (RunCode, lambda state, sid, body: _lines(
        *code_run(state.engine, state.events, sid, body))),
    "commands": (RunCommand, lambda state, sid, body: _lines(
        *command_run(state.engine, state.events, sid, body))),
    "fork": (Fork, _answer(lambda state, sid, body: forked(state.engine, sid, body.n))),
    "merge_into": (MergeInto, _answer(lambda state, sid, body: merged(
        state.engine, state.events, sid, body.winner))),
    "checkpoint": (CreateCheckpoint, _answer(lambda state, sid, body: checkpointed(
        state.engine, sid, body.name))),
    "restore": (Restore, _answer(lambda state, sid, body: restored(
        state.engine, sid, body.checkpoint))),
    "fork_checkpoint": (ForkCheckpoint, _answer(lambda state, sid, body: checkpoint_forked(
        state.engine, sid, body.checkpoint, body.n))),
    "close": (Close, _answer(lambda state, sid, body: closed(state.engine, state.events, sid))),
}


class BadMessage(ValueError):
    """A message that is not a request of this protocol."""


class Gone(Exception):
    """The connection closed under a send: nobody is left to answer."""


@router.websocket("/v1/calls")
async def calls(ws: WebSocket) -> None:
    """Serve runs until the client closes (see the module's docstring)."""
    if not ws_key_ok(ws):
        await ws.close(code=1008, reason="invalid api key")
        return
    await ws.accept()
    sending = asyncio.Lock()  # one message at a time, whichever run it is from
    runs: dict[int, tuple[asyncio.Task, Hangup]] = {}

    async def send(run: int, line: dict) -> None:
        async with sending:
            try:
                await ws.send_text(json.dumps({"id": run, "line": line},
                                              separators=(",", ":")))
            except (WebSocketDisconnect, RuntimeError, OSError) as exc:  # closed meanwhile
                raise Gone() from exc

    try:
        async for _, request in requests(ws):
            run = request.get("cancel")
            if run is not None:
                if run in runs:
                    runs[run][1].set()
                continue
            run = request["id"]
            if run in runs:
                await send(run, *error_line(f"run {run} is still going on this connection",
                                            "InvalidRequest", 400))
            elif len(runs) >= MAX_RUNS:
                await send(run, *error_line(f"at most {MAX_RUNS} runs at once on one "
                                            "connection", "ResourceLimit", 429))
            else:
                runs[run] = _start(ws, request, send, lambda run=run: runs.pop(run, None))
    except (WebSocketDisconnect, Gone):
        pass
    finally:
        for _, gone in runs.values():
            gone.set()
        # Each ends soon: abandoned (interrupted, or dropped while it waited).
        await asyncio.gather(*(task for task, _ in runs.values()), return_exceptions=True)


async def requests(ws: WebSocket) -> AsyncIterator[tuple[str, dict]]:
    """Each message of the client and the request it is, until the client closes; a
    message that is not a request closes the connection (1007) and ends them."""
    while True:
        received = await ws.receive()
        if received["type"] == "websocket.disconnect":
            return
        try:
            if received.get("text") is None:
                raise BadMessage("messages are JSON text")
            request = _request(received["text"])
        except BadMessage as exc:
            await ws.close(code=1007, reason=str(exc)[:120])
            return
        yield received["text"], request


def _request(message: str) -> dict:
    """A run or a cancel, its fields checked for type; BadMessage otherwise."""
    try:
        request = json.loads(message)
    except ValueError:
        raise BadMessage("a message must be a JSON object") from None
    if not isinstance(request, dict):
        raise BadMessage("a message must be a JSON object")
    if "cancel" in request:
        if set(request) != {"cancel"} or not _is_id(request["cancel"]):
            raise BadMessage("a cancel is {\"cancel\": <run id>}")
        return request
    if set(request) != {"id", "op", "sandbox", "body"} or not _is_id(request["id"]) \
            or request["op"] not in _RUNS or not isinstance(request["sandbox"], str) \
            or not isinstance(request["body"], dict):
        raise BadMessage('a run is {"id": <int>, "op": "' + '"|"'.join(_RUNS)
                         + '", "sandbox": <id>, "body": {...}}')
    return request


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53


def _start(ws: WebSocket, request: dict, send: Callable[[int, dict], Awaitable[None]],
           done: Callable[[], object]) -> tuple[asyncio.Task, Hangup]:
    """The run's task, in a context where the engine sees its own "caller gone" event."""
    gone = Hangup()
    context = contextvars.copy_context()
    context.run(CALLER_GONE.set, gone)
    task = asyncio.get_running_loop().create_task(_run(ws, request, send), context=context)
    task.add_done_callback(lambda _: done())
    return task, gone


async def _run(ws: WebSocket, request: dict,
               send: Callable[[int, dict], Awaitable[None]]) -> None:
    run = request["id"]
    model, lines_of = _RUNS[request["op"]]
    try:
        try:
            body = model.model_validate(request["body"])
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
            await send(run, *error_line(validation_message(RequestValidationError(errors)),
                                        "InvalidRequest", 400))
            return
        if getattr(body, "background", False):
            await send(run, *error_line("a background command is started with POST "
                                        "/v1/sandboxes/{id}/commands", "InvalidRequest", 400))
            return
        await _stream(run, lines_of(ws.app.state, request["sandbox"], body), send)
    except Gone:
        pass


async def _stream(run: int, lines: AsyncIterator[dict],
                  send: Callable[[int, dict], Awaitable[None]]) -> None:
    """Every line of the run, then its end; a failure is the last line."""
    try:
        async for line in lines:
            await send(run, line)
    except Gone:
        raise
    except Exception as exc:  # noqa: BLE001 - reported in-band, as a stream does
        status, message, kind = describe(exc)
        if status == 500:
            log.error("run failed", exc_info=exc)
        await send(run, *error_line(message, kind, status))
    finally:
        await lines.aclose()  # type: ignore[attr-defined]
