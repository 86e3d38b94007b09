"""Pause/resume, start and checkpoints: a sandbox held still or started again, and instants
of it kept to go back to.

Every route is under ``/v1/sandboxes/{id}``, so a request is routable by its sandbox
id alone (a checkpoint lives on its sandbox's node).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body

from branchbox.engine.sandboxes import Engine
from branchbox.server.deps import NO_CONTENT, EngineDep
from branchbox.server.models import CreateCheckpoint, Fork
from branchbox.server.sandboxes import children_answer

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", tags=["instants"])


@router.post("/pause")
async def pause(sandbox_id: str, engine: EngineDep) -> dict:
    """Freeze everything in the sandbox (no CPU; its timeout stops); returns its info."""
    return await engine.pause(sandbox_id)


@router.post("/resume")
async def resume(sandbox_id: str, engine: EngineDep) -> dict:
    """Thaw a paused sandbox; returns its info."""
    return await engine.resume(sandbox_id)


@router.post("/start")
async def start(sandbox_id: str, engine: EngineDep) -> dict:
    """A stopped sandbox (processes gone, files kept) runs again with a fresh REPL on its
    files; a no-op for a running one. Returns its info."""
    return await engine.start_sandbox(sandbox_id)


@router.post("/checkpoints", status_code=201)
async def create_checkpoint(sandbox_id: str, engine: EngineDep,
                            body: Annotated[CreateCheckpoint,
                                            Body(default_factory=CreateCheckpoint)]) -> dict:
    """Keep this instant of the sandbox (memory and files), frozen."""
    return await checkpointed(engine, sandbox_id, body.name)


# The answers of the calls below, over HTTP here and over the calls WebSocket
# (``call_channel``), where the SDK sends them.
async def checkpointed(engine: Engine, sandbox_id: str, name: str | None) -> dict:
    return (await engine.checkpoint(sandbox_id, name)).info()


async def restored(engine: Engine, sandbox_id: str, checkpoint_id: str) -> dict:
    await engine.restore(sandbox_id, checkpoint_id)
    return {}


async def checkpoint_forked(engine: Engine, sandbox_id: str, checkpoint_id: str,
                            n: int) -> dict:
    return children_answer(engine, await engine.fork_checkpoint(sandbox_id, checkpoint_id, n))


@router.get("/checkpoints")
async def list_checkpoints(sandbox_id: str, engine: EngineDep) -> dict:
    return {"checkpoints": [cp.info() for cp in engine.checkpoints(sandbox_id)]}


@router.post("/checkpoints/{checkpoint_id}/restore", **NO_CONTENT)
async def restore(sandbox_id: str, checkpoint_id: str, engine: EngineDep) -> None:
    """The sandbox becomes the checkpoint's instant again (same id, same address)."""
    await restored(engine, sandbox_id, checkpoint_id)


@router.post("/checkpoints/{checkpoint_id}/fork")
async def fork_checkpoint(sandbox_id: str, checkpoint_id: str, engine: EngineDep,
                          body: Annotated[Fork, Body(default_factory=Fork)]) -> dict:
    """``n`` new sandboxes from the checkpoint's instant, children of the sandbox."""
    return await checkpoint_forked(engine, sandbox_id, checkpoint_id, body.n)


@router.delete("/checkpoints/{checkpoint_id}", **NO_CONTENT)
async def delete_checkpoint(sandbox_id: str, checkpoint_id: str, engine: EngineDep) -> None:
    await engine.delete_checkpoint(sandbox_id, checkpoint_id)
