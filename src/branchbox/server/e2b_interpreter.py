"""E2B's code interpreter API (the sandbox's port 49999): ``/execute`` and ``/contexts``.

``/execute`` runs a cell (with its ``env_vars`` in ``os.environ`` meanwhile) in the
sandbox's REPL and streams E2B's NDJSON lines as it
runs: ``stdout``/``stderr`` (``text``, ``timestamp``), then ``result`` lines (each
matplotlib figure, then the cell's value with its rich representations: text,
html, markdown, svg, png, jpeg, latex, json, javascript) and an ``error`` line
(name, value, traceback) if the cell raised. A client that goes away (E2B's
``timeout`` is the client's) interrupts the cell; the REPL keeps its state.

A context is a named namespace of the sandbox's one REPL, with its own working
directory (see ``agent.repl``): each context's variables are its own, creating
one costs nothing, and fork children inherit them. Contexts run one cell at a
time (the sandbox's REPL is single-threaded), as a Jupyter kernel does.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Response
from pydantic import Field

from branchbox.engine import errors
from branchbox.server.deps import EngineDep
from branchbox.server.e2b_access import SandboxId
from branchbox.server.e2b_control import E2B_HOME, E2BBody, E2BSandboxRoute
from branchbox.server.streams import ndjson_response

router = APIRouter(tags=["e2b code interpreter"], include_in_schema=False,
                   route_class=E2BSandboxRoute)

# Our mime types and E2B's result field names.
_FORMATS = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown",
            "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
            "application/pdf": "pdf", "text/latex": "latex", "application/json": "json",
            "application/javascript": "javascript"}


class Execute(E2BBody):
    code: str = Field(max_length=16 << 20)
    context_id: str | None = Field(None, max_length=64)
    language: str | None = Field(None, max_length=32)
    env_vars: dict[str, str] | None = None


class NewContext(E2BBody):
    language: str | None = Field(None, max_length=32)
    cwd: str | None = Field(None, max_length=4096)


def _python_only(language: str | None) -> None:
    if language not in (None, "python", "python3"):
        raise errors.InvalidRequest(f"language {language!r} is not supported: branchbox "
                                    "sandboxes run Python cells (use commands for a shell)")


def _lines(header: dict) -> list[dict]:
    """One agent event of a ``run_code`` as E2B's lines (the agent runs in the sandbox: an
    event that is not what it should be becomes an error line, not a crash)."""
    try:
        return _translated(header)
    except (KeyError, TypeError, AttributeError):
        return _failed("the sandbox's agent answered a malformed result", "SandboxError", 500)


def _translated(header: dict) -> list[dict]:
    kind = header.get("ev")
    if kind in ("stdout", "stderr"):
        return [{"type": kind, "text": header.get("data", ""), "timestamp": time.time_ns()}]
    if kind != "done":
        return []
    result = header.get("result") or {}
    figures = [figure["image/png"] for figure in result.get("figures") or []]
    lines = [{"type": "result", "png": png, "is_main_result": False} for png in figures]
    if result.get("text") is not None:
        main = {_FORMATS[mime]: data for mime, data in (result.get("results") or {}).items()
                if mime in _FORMATS}
        if figures and main.get("png") == figures[0]:
            del main["png"]  # the first figure stands in for a value without a picture
        lines.append({"type": "result", **main, "is_main_result": True})
    if error := result.get("error"):  # its keys only: never a "type" of the agent's choice
        lines.append({"type": "error", "name": error["name"], "value": error["value"],
                      "traceback": error["traceback"]})
    return lines


def _failed(message: str, kind: str, _status: int) -> list[dict]:
    """A failure after the stream began (the REPL died, the sandbox closed)."""
    return [{"type": "error", "name": kind, "value": message, "traceback": message}]


@router.post("/execute")
async def execute(body: Execute, sandbox_id: SandboxId, engine: EngineDep) -> Response:
    _python_only(body.language)
    args: dict = {"code": body.code, "env": body.env_vars or {}}
    if body.context_id is not None:
        args["context"] = body.context_id
    return await ndjson_response(engine.stream(sandbox_id, "run_code", args), _lines, _failed)


def _context(context: dict) -> dict:
    return {"id": context["id"], "language": "python", "cwd": context.get("cwd") or E2B_HOME}


@router.post("/contexts")
async def create_context(body: NewContext, sandbox_id: SandboxId, engine: EngineDep) -> dict:
    _python_only(body.language)
    cwd = body.cwd or E2B_HOME
    made = await engine.call(sandbox_id, "context", {"action": "create",
                                                     "id": uuid.uuid4().hex, "cwd": cwd})
    return _context({"id": made["id"], "cwd": cwd})


@router.get("/contexts")
async def list_contexts(sandbox_id: SandboxId, engine: EngineDep) -> list[dict]:
    listed = await engine.call(sandbox_id, "context", {"action": "list"})
    return [_context(context) for context in listed["contexts"]]


@router.delete("/contexts/{context_id}", status_code=204, response_class=Response)
async def remove_context(context_id: str, sandbox_id: SandboxId, engine: EngineDep) -> None:
    await engine.call(sandbox_id, "context", {"action": "remove", "id": context_id})


@router.post("/contexts/{context_id}/restart", status_code=204, response_class=Response)
async def restart_context(context_id: str, sandbox_id: SandboxId, engine: EngineDep) -> None:
    """The context's variables are gone; its working directory stays."""
    await engine.call(sandbox_id, "context", {"action": "reset", "id": context_id})
