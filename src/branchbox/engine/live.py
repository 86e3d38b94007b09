"""What the engine holds for each live sandbox: its record, the body serving it, its family.

A sandbox is a *record* (its public identity) bound to a *body* (the processes,
cgroup and layers that currently serve it); merge_into re-binds a parent's record
to the winner's body, which is why the two are kept apart.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from branchbox.engine import errors
from branchbox.engine.family_room import FamilyRoom
from branchbox.engine.layers import LayerStack
from branchbox.engine.metrics import CpuMark
from branchbox.engine.records import SandboxRecord
from branchbox.runtime.cgroups import SandboxCgroup
from branchbox.runtime.channel import AgentChannel
from branchbox.runtime.dormant import Dormant
from branchbox.runtime.family import Family


@dataclass(eq=False)
class FamilyHandle:
    family: Family
    members: set[str] = field(default_factory=set)
    room: FamilyRoom = field(default_factory=FamilyRoom)  # what closed members left charged


@dataclass(eq=False)
class Body:
    """What serves a sandbox right now: layers, cgroup, REPL channel (or what holds a
    checkpoint: its process's socket instead)."""

    key: str
    layers: LayerStack
    cgroup: SandboxCgroup
    channel: AgentChannel | Dormant | None = None
    repl_host: int | None = None  # the REPL's host pid, once found (a fork, its network)
    stopped: str | None = None  # why the daemon killed its processes (engine.run_guard)
    stopped_as: type[errors.EngineError] = errors.SandboxTimeout  # what a call then gets
    killing: asyncio.Future | None = None  # that kill, until every process is gone
    held_frozen: bool = False  # paused: the thaw guard leaves it frozen


@dataclass(eq=False)
class Live:
    record: SandboxRecord
    body: Body
    family: FamilyHandle
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    generation: int = 0  # bumped by every merge into this sandbox
    forked_at: int | None = None  # the parent's generation when this one was forked
    timer: asyncio.TimerHandle | None = None
    watcher: asyncio.Task | None = None
    last_fork: dict | None = None  # timings of the latest fork, seconds (for info and bench)
    last_used: float = field(default_factory=time.monotonic)  # for the idle timeout
    cpu_mark: CpuMark | None = None  # its latest metrics sample's CPU time (engine.metrics)

    @property
    def id(self) -> str:
        return self.record.id
