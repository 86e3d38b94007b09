"""Snapshots over REST (engine.snapshots): a sandbox's instant kept beyond it under a
name, for new sandboxes to start from (``POST /v1/sandboxes`` with ``snapshot``); and
Podflare's spaces, the snapshots a persistent sandbox leaves at its idle timeout.

Creating one names its sandbox in the path (routable by its id); listing and deleting
name none: a gateway asks every node.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body

from branchbox.server.deps import NO_CONTENT, EngineDep
from branchbox.server.models import CreateSnapshot, ResumeSpace

router = APIRouter(tags=["snapshots"])


@router.post("/v1/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def create_snapshot(sandbox_id: str, engine: EngineDep,
                          body: Annotated[CreateSnapshot, Body(default_factory=CreateSnapshot)]
                          ) -> dict:
    """This instant of the sandbox (memory, files, env, cwd) kept as snapshot ``name``
    (made up if not given; an older snapshot of that name is replaced)."""
    return (await engine.snapshot(sandbox_id, body.name)).snapshot_info()


@router.get("/v1/snapshots")
async def list_snapshots(engine: EngineDep) -> dict:
    return {"snapshots": [cp.snapshot_info() for cp in engine.snapshots()]}


@router.delete("/v1/snapshots/{name}", **NO_CONTENT)
async def delete_snapshot(name: str, engine: EngineDep) -> None:
    """End the snapshot (sandboxes started from it go on)."""
    await engine.delete_snapshot(name)


@router.post("/v1/spaces/{space_id}/resume", status_code=201)
async def resume_space(space_id: str, engine: EngineDep,
                       body: Annotated[ResumeSpace, Body(default_factory=ResumeSpace)]) -> dict:
    """Podflare's resume: a new sandbox from the space (its memory and files), which is
    used up; answers as a create does."""
    sb = await engine.resume_space(space_id, timeout=body.timeout,
                                   idle_timeout=body.idle_timeout, internet=body.egress,
                                   persistent=bool(body.persistent))
    return engine.info(sb.id)


@router.delete("/v1/spaces/{space_id}", **NO_CONTENT)
async def delete_space(space_id: str, engine: EngineDep) -> None:
    await engine.delete_space(space_id)
