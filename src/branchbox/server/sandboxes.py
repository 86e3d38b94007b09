"""Sandbox lifecycle and branching: create, list, info, close, fork, merge, diff, commit."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body

from branchbox.engine import errors
from branchbox.engine.live import Live
from branchbox.engine.sandboxes import Engine
from branchbox.server.deps import NO_CONTENT, EngineDep, EventsDep
from branchbox.server.models import CreateSandbox, Diff, Fork, UpdateNetwork
from branchbox.server.replay import EventLog

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])


@router.post("", status_code=201)
async def create_sandbox(body: CreateSandbox, engine: EngineDep) -> dict:
    """Start a sandbox; answers once its REPL is ready, with its info. Without its
    resource use (``GET`` has it): a sandbox just made uses next to nothing, and
    reading that from its cgroups and /proc in a thread took longer than the rest of a
    create from the warm pool (4.6 against 8.6 ms a create, one client)."""
    internet = body.internet if body.internet is not None else body.egress
    network = body.network.model_dump(exclude_none=True) if body.network else None
    if body.snapshot is not None:
        return engine.info((await _from_snapshot(body, engine, internet, network)).id)
    disk_mb = body.disk_mb
    # Podflare's rootfs_gb asks for at least that much disk: a limit where the store
    # has quotas; where it has none every sandbox may already use the whole store.
    if disk_mb is None and body.rootfs_gb is not None and engine.store.quota:
        disk_mb = body.rootfs_gb * 1024
    sb = await engine.create(image=body.image, env=body.env, cwd=body.cwd,
                             timeout=body.timeout, memory_mb=body.memory_mb,
                             workspace=body.workspace, idle_timeout=body.idle_timeout,
                             disk_mb=disk_mb, internet=internet, network=network,
                             persistent=bool(body.persistent))
    return engine.info(sb.id)


async def _from_snapshot(body: CreateSandbox, engine: Engine, internet: bool | None,
                         network: dict | None) -> Live:
    """A create from a snapshot: what the snapshot fixes cannot be asked for."""
    fixed = sorted(name for name in ("cwd", "memory_mb", "workspace", "disk_mb",
                                     "rootfs_gb")
                   if getattr(body, name) is not None)
    if body.image != "default":
        fixed.insert(0, "image")
    if fixed:
        raise errors.InvalidRequest(
            f"a sandbox started from a snapshot has the snapshot's {', '.join(fixed)}: "
            "give only env, timeouts, persistent and the network policy with snapshot")
    return await engine.start_from_snapshot(body.snapshot, env=body.env, timeout=body.timeout,
                                            idle_timeout=body.idle_timeout, internet=internet,
                                            network=network, persistent=bool(body.persistent))


@router.get("")
async def list_sandboxes(engine: EngineDep) -> dict:
    return {"sandboxes": await engine.infos()}  # live, then stopped (their files kept)


@router.get("/{sandbox_id}")
async def sandbox_info(sandbox_id: str, engine: EngineDep) -> dict:
    return await engine.report(sandbox_id)


@router.delete("/{sandbox_id}", **NO_CONTENT)
async def close_sandbox(sandbox_id: str, engine: EngineDep, events: EventsDep) -> None:
    """Kill everything in the sandbox and release its storage."""
    await closed(engine, events, sandbox_id)


async def closed(engine: Engine, events: EventLog, sandbox_id: str) -> dict:
    """A close, over HTTP here and over the calls WebSocket; it answers nothing."""
    await engine.close(sandbox_id)
    events.forget(sandbox_id)
    return {}


def children_answer(engine: Engine, children: list[Live]) -> dict:
    """What a fork (of a sandbox or of a checkpoint) answers: the children's ids and their
    addresses."""
    return {"children": [child.id for child in children],
            "addresses": {child.id: engine.net.address(child.body.key) for child in children}}


async def forked(engine: Engine, sandbox_id: str, n: int) -> dict:
    """A fork's answer, over HTTP here and over the calls WebSocket (``call_channel``)."""
    return children_answer(engine, await engine.fork(sandbox_id, n))


@router.post("/{sandbox_id}/fork")
async def fork_sandbox(sandbox_id: str, engine: EngineDep,
                       body: Annotated[Fork, Body(default_factory=Fork)]) -> dict:
    """``n`` children from this instant of the sandbox (memory, files, env, cwd)."""
    return await forked(engine, sandbox_id, body.n)


@router.patch("/{sandbox_id}/network")
async def update_network(sandbox_id: str, body: UpdateNetwork, engine: EngineDep) -> dict:
    """Change the sandbox's egress policy, open connections included."""
    lists = body.model_dump(exclude_none=True, include={"allow_out", "deny_out"})
    internet = body.internet if body.internet is not None else body.egress
    return await engine.update_network(sandbox_id, internet, lists)


@router.post("/{sandbox_id}/merge_into/{winner_id}", **NO_CONTENT)
async def merge_into(sandbox_id: str, winner_id: str, engine: EngineDep,
                     events: EventsDep) -> None:
    """The sandbox's id takes over the winner's state; the winner's id is retired."""
    await merged(engine, events, sandbox_id, winner_id)


async def merged(engine: Engine, events: EventLog, sandbox_id: str, winner_id: str) -> dict:
    """A merge, over HTTP here and over the calls WebSocket; it answers nothing."""
    await engine.merge_into(sandbox_id, winner_id)
    events.forget(winner_id)
    return {}


@router.post("/{sandbox_id}/diff")
async def diff(sandbox_id: str, body: Diff, engine: EngineDep) -> dict:
    """Files added, removed and modified in ``other`` relative to this sandbox."""
    return await engine.diff(sandbox_id, body.other, body.paths)


@router.post("/{sandbox_id}/commit")
async def commit(sandbox_id: str, engine: EngineDep) -> dict:
    """Write the sandbox's workspace changes into the host directory it came from."""
    return await engine.commit(sandbox_id)
