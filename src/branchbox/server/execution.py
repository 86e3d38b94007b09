"""Running things in a sandbox: Python in its REPL, commands, and Podflare's ``/exec``.

Output streams as NDJSON while it happens: ``{"type": "stdout"|"stderr",
"data"}`` lines, then one final line (``result`` for code, ``exit`` for a
command) carrying the agent's answer, or an ``error`` line if the run failed
after output had begun.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Body, Response

from branchbox.server.deps import NO_CONTENT, EngineDep
from branchbox.server.models import KillCommand, PodflareExec, RunCode, RunCommand, WaitCommand
from branchbox.server.streams import event_line, ndjson_response

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", tags=["execution"])


@router.post("/run_code")
async def run_code(sandbox_id: str, body: RunCode, engine: EngineDep) -> Response:
    """Run Python in the sandbox's persistent REPL; NDJSON ending in a ``result`` line."""
    events = engine.stream(sandbox_id, "run_code", body.model_dump(exclude_none=True))
    return await ndjson_response(events, lambda header: [event_line(header, "result")])


@router.post("/commands", response_model=None)
async def run_command(sandbox_id: str, body: RunCommand, engine: EngineDep) -> Response | dict:
    """Run a command; NDJSON ending in an ``exit`` line, or ``{"pid"}`` in the background."""
    args = body.model_dump(exclude_none=True)
    if body.background:
        return await engine.call(sandbox_id, "exec", args)
    return await ndjson_response(engine.stream(sandbox_id, "exec", args),
                                 lambda header: [event_line(header, "exit")])


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
async def podflare_exec(sandbox_id: str, body: PodflareExec, engine: EngineDep) -> Response:
    """Podflare's exec: Python (in the REPL) or a bash script, as ``{type, data, seq, ts}``."""
    args: dict[str, object]
    if body.language == "python":
        op, args = "run_code", {"code": body.code}
    else:
        op, args = "exec", {"cmd": ["bash", "-c", body.code]}
    if body.timeout is not None:
        args["timeout"] = body.timeout
    return await ndjson_response(engine.stream(sandbox_id, op, args),
                                 _podflare_lines(body.language))


def _podflare_lines(language: str) -> Callable[[dict], list[dict]]:
    """Podflare reports a Python exception as stderr text and exit status 1."""
    seq = itertools.count()

    def to_lines(header: dict) -> list[dict]:
        if header.get("ev") != "done":
            out = [(header.get("ev"), header.get("data", ""))]
        elif language == "bash":
            out = [("exit", (header.get("result") or {}).get("exit_code"))]
        else:
            error = (header.get("result") or {}).get("error")
            out = [("stderr", _traceback_text(error)), ("exit", 1)] if error else [("exit", 0)]
        return [{"type": kind, "data": data, "seq": next(seq), "ts": time.time()}
                for kind, data in out]

    return to_lines


def _traceback_text(error: dict) -> str:
    return error.get("traceback") or f"{error.get('name')}: {error.get('value')}\n"
