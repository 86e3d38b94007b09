"""Running things in a sandbox: Python in its REPL, commands, and Podflare's ``/exec``.

Output streams as NDJSON while it happens: ``{"type": "stdout"|"stderr",
"data"}`` lines, then one final line (``result`` for code, ``exit`` for a
command) carrying the agent's answer, or an ``error`` line if the run failed
after output had begun. ``/exec`` speaks Podflare's shape instead (see
``replay``). Every run is also logged for ``GET .../replay``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import APIRouter, Body, Response

from branchbox.engine.sandboxes import Engine
from branchbox.server.deps import NO_CONTENT, EngineDep, EventsDep
from branchbox.server.models import KillCommand, PodflareExec, RunCode, RunCommand, WaitCommand
from branchbox.server.replay import EventLog, PodflareEvents
from branchbox.server.streams import NDJSON, Event, encode_line, event_line, ndjson_response

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", tags=["execution"])


def _logged(log: EventLog, sandbox_id: str, language: str,
            to_lines: Callable[[dict], list[dict]] | None = None) -> Callable[[dict], list[dict]]:
    """``to_lines`` that also logs the run for replay; without ``to_lines``, the logged
    (Podflare-shaped) events are themselves the lines."""
    events = PodflareEvents(language)

    def logged(header: dict) -> list[dict]:
        recorded = [log.record(sandbox_id, kind, data) for kind, data in events.feed(header)]
        return recorded if to_lines is None else to_lines(header)

    return logged


def code_run(engine: Engine, log: EventLog, sandbox_id: str,
             body: RunCode) -> tuple[AsyncIterator[Event], Callable[[dict], list[dict]]]:
    """A run of ``body`` in the sandbox's REPL: its events and what each is as lines (the
    last a ``result``), logged for replay. Served over HTTP here and over the calls
    WebSocket (``call_channel``)."""
    return engine.stream(sandbox_id, "run_code", body.model_dump(exclude_none=True)), _logged(
        log, sandbox_id, "python", lambda header: [event_line(header, "result")])


def command_run(engine: Engine, log: EventLog, sandbox_id: str,
                body: RunCommand) -> tuple[AsyncIterator[Event], Callable[[dict], list[dict]]]:
    """A foreground command, as :func:`code_run` (the last line an ``exit``)."""
    return engine.stream(sandbox_id, "exec", body.model_dump(exclude_none=True)), _logged(
        log, sandbox_id, "bash", lambda header: [event_line(header, "exit")])


@router.post("/run_code")
async def run_code(sandbox_id: str, body: RunCode, engine: EngineDep,
                   log: EventsDep) -> Response:
    """Run Python in the sandbox's persistent REPL; NDJSON ending in a ``result`` line."""
    return await ndjson_response(*code_run(engine, log, sandbox_id, body))


@router.post("/commands", response_model=None)
async def run_command(sandbox_id: str, body: RunCommand, engine: EngineDep,
                      log: EventsDep) -> Response | dict:
    """Run a command; NDJSON ending in an ``exit`` line, or ``{"pid"}`` in the background."""
    if body.background:
        return await engine.call(sandbox_id, "exec", body.model_dump(exclude_none=True))
    return await ndjson_response(*command_run(engine, log, sandbox_id, body))


@router.post("/commands/{pid}/wait")
async def wait_command(sandbox_id: str, pid: int, engine: EngineDep,
                       body: Annotated[WaitCommand, Body(default_factory=WaitCommand)]) -> dict:
    """Wait for a background command: ``{exit_code, stdout, stderr}``."""
    return await engine.call(sandbox_id, "wait", {"pid": pid, **body.model_dump(exclude_none=True)})


@router.post("/commands/{pid}/kill", **NO_CONTENT)
async def kill_command(sandbox_id: str, pid: int, engine: EngineDep,
                       body: Annotated[KillCommand, Body(default_factory=KillCommand)]) -> None:
    await engine.call(sandbox_id, "kill", {"pid": pid, "signal": body.signal})


@router.post("/exec")
async def podflare_exec(sandbox_id: str, body: PodflareExec, engine: EngineDep,
                        log: EventsDep) -> Response:
    """Podflare's exec: Python (in the REPL) or a bash script, as NDJSON ``{type, data, seq,
    ts}`` events: one line of output each, then ``exit`` with the status."""
    args: dict[str, object]
    if body.language == "python":
        op, args = "run_code", {"code": body.code}
    else:
        op, args = "exec", {"cmd": ["bash", "-c", body.code]}
    if body.timeout is not None:
        args["timeout"] = body.timeout

    def failed(message: str, _kind: str, _status: int) -> list[dict]:
        # Podflare's SDK reads every line as an event: a failure mid-run is one too.
        return [log.record(sandbox_id, "stderr", message), log.record(sandbox_id, "exit", -1)]

    return await ndjson_response(engine.stream(sandbox_id, op, args),
                                 _logged(log, sandbox_id, body.language), failed)


@router.get("/replay", response_class=Response,
            responses={200: {"content": {NDJSON: {}}, "description": "NDJSON events"}})
async def replay(sandbox_id: str, engine: EngineDep, log: EventsDep) -> Response:
    """Podflare's replay: the sandbox's recent run events (up to 1000), oldest first."""
    engine.get(sandbox_id)  # 404 for an unknown sandbox
    return Response(b"".join(map(encode_line, log.recent(sandbox_id))), media_type=NDJSON)
