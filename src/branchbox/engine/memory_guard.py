"""The memory all sandboxes share, taken back from the family that holds the most.

Each sandbox has its own memory limit (``memory_mb``), and all of them together one
bound: all of RAM but what the host keeps (runtime.cgroups.bound_all_sandboxes), which
this daemon's group has too, or less (``BRANCHBOX_SANDBOXES_MEMORY_MB``). The limits
overcommit the bound by design (a fork child gets its parent's limit, and an idle
child holds next to nothing), so sandboxes can reach it together; the kernel's OOM
killer then kills the process with the most memory under it, in whatever family. A
family of many mid-sized children pushed the host's sandboxes over, and another
family's one large REPL died for it.

The guard watches the group: once what its sandboxes hold but page cache (anonymous
and shared memory and the kernel's: page tables, sockets, slabs; the cache is the
kernel's to drop) comes within a margin of the bound, it stops the sandbox holding the
most in the family holding the most (its sandboxes, checkpoints and snapshots, and
what its closed members left charged), as a run past its timeout is stopped (its
processes killed, its files kept, its calls told why); a family none of whose
sandboxes runs gives up its newest checkpoint or snapshot instead. It looks again once
those processes are gone. It looks every POLL seconds.
A margin further down, it marks the family holding the most as the kernel's first
choice (``oom_score_adj``), so memory taken faster than the guard looks meets a killer
that takes what the guard would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from branchbox.engine import errors
from branchbox.engine.checkpoints import Checkpoint
from branchbox.engine.live import Body, Live
from branchbox.engine.run_guard import hard_stop, killed
from branchbox.runtime.cgroups import ChargedRemains, GroupMemory

log = logging.getLogger("branchbox.engine")

MARGIN = (64 << 20, 32)
"""The guard acts this far below the bound: max(64 MiB, 1/32 of it)."""
POLL = 0.02
"""Seconds between looks at the group's usage (one counter read, ~5 µs). Not cgroup v1's
usage thresholds: the kernel checks them only when it charges pages to an LRU list,
and page tables or other kernel memory took a group from 800 MiB to its bound
without one event."""
MARK_EVERY = 0.5
"""Seconds between rankings while the group is between the two lines (each reads every
sandbox's memory files)."""
RECLAIM_EVERY = 5.0
"""Seconds between the guard's reclaims of the group: near the bound, before it ranks,
it has the kernel drop what it can (on v1 the usage counts dentry and inode caches: a
sandbox that looked up 5 million names held 1.2 GiB of them, and closed sandboxes'
moved up to the group where no family holds them)."""
MIB = 1 << 20
OOM_FIRST = 1000
"""The ``oom_score_adj`` of the marked family's processes: the kernel's killer takes them
before any other (a sandbox cannot lower it: that takes CAP_SYS_RESOURCE on the host)."""


@dataclass
class _Family:
    """What one family holds, and what of it may be stopped: the sandbox running that
    holds the most, and its checkpoints and snapshots."""

    sandboxes: list[Live] = field(default_factory=list)
    kept: list[Checkpoint] = field(default_factory=list)  # checkpoints and snapshots
    remains: list[ChargedRemains] = field(default_factory=list)
    name: str = ""
    held: int = 0
    victim: Live | None = None
    victim_held: int = 0

    def weigh(self) -> None:
        """Read what each part holds (blocking: a few cgroup files each)."""
        for sb in self.sandboxes:
            held = _held(sb.body)
            self.held += held
            channel = sb.body.channel
            if sb.body.stopped is None and channel is not None \
                    and not channel.closed.is_set() and held > self.victim_held:
                self.victim, self.victim_held = sb, held
        self.held += sum(_held(cp.body) for cp in self.kept)
        for remains in self.remains:
            with contextlib.suppress(OSError):
                self.held += remains.held()


def _set_oom_adj(changes: list[tuple[list[Body], int]]) -> None:
    for bodies, adj in changes:
        for body in bodies:
            with contextlib.suppress(OSError):
                body.cgroup.set_oom_adj(adj)


def _held(body: Body) -> int:
    try:
        return body.cgroup.held_bytes()
    except (OSError, ValueError):  # closed meanwhile
        return 0


class MemoryGuard:
    """Watches this daemon's group for the engine (its live sandboxes and checkpoints)."""

    def __init__(self, engine, group: GroupMemory, limit: int | None) -> None:
        self.engine = engine
        self.group = group
        self.bound = group.bound(limit if limit is not None else 1 << 62)
        least, part = MARGIN
        margin = max(least, self.bound // part)
        self.line = self.bound - margin
        self.mark_line = self.bound - 2 * margin  # from here, the kernel's choice is set
        self._marked: str | None = None  # the family whose processes the kernel takes first
        self._ranked_at = float("-inf")
        self._reclaimed_at = float("-inf")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._mark(None)  # sandboxes a --keep stop leaves are like any other again

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    usage = self.group.usage()
                    held = self.group.held() if usage >= self.mark_line else 0
                    if held >= self.mark_line and loop.time() - self._reclaimed_at >= RECLAIM_EVERY:
                        # What the kernel can drop is no one's to be stopped for
                        await asyncio.to_thread(self.group.reclaim)
                        self._reclaimed_at = loop.time()
                        held = self.group.held()
                except OSError:  # the group went (a stop): nothing to guard
                    return
                over = held >= self.line
                if over or (held >= self.mark_line
                            and loop.time() - self._ranked_at >= MARK_EVERY):
                    ranked = await self._ranked()
                    self._ranked_at = loop.time()
                    await self._mark(ranked[0] if ranked else None)
                    if over and ranked:
                        await self._stop_one(ranked[0])
                        continue
                elif held < self.mark_line and self._marked is not None:
                    await self._mark(None)
                await asyncio.sleep(POLL)
        except Exception:  # noqa: BLE001 - logged; the kernel's killer still bounds them
            log.exception("the sandboxes' memory guard stopped")

    async def _ranked(self) -> list[_Family]:
        """The families that hold something the guard can stop, weighed, most first."""
        families = self._families()
        await asyncio.to_thread(lambda: [f.weigh() for f in families.values()])
        return sorted((f for f in families.values() if f.victim is not None or f.kept),
                      key=lambda f: f.held, reverse=True)

    async def _mark(self, family: _Family | None) -> None:
        """Make ``family``'s processes the kernel's first choice (``oom_score_adj`` 1000;
        those they fork inherit it) and the family marked before like any other again:
        memory taken faster than the guard stops it then meets a killer that takes what
        the guard would (by itself it takes the largest process of any family)."""
        name = family.name if family is not None else None
        if name == self._marked:
            return
        # Each family's sandboxes as they are now (fork children made since inherit it).
        changes = [] if self._marked is None else [(self._bodies_of(self._marked), 0)]
        changes += [] if name is None else [(self._bodies_of(name), OOM_FIRST)]
        self._marked = name
        await asyncio.to_thread(_set_oom_adj, changes)

    def _bodies_of(self, family: str) -> list[Body]:
        """The bodies of ``family``'s live sandboxes, checkpoints and snapshots."""
        return [sb.body for sb in list(self.engine.live.values()) if sb.record.family == family
                ] + [cp.body for cp in list(self.engine._checkpoints.values())
                     if cp.record.family == family]

    async def _stop_one(self, family: _Family) -> None:
        """Stop what holds the most of ``family``, the one holding the most: its largest
        running sandbox, or when none runs, its newest checkpoint or snapshot (whose
        process the kernel's killer would take: it maps what the family's closed
        sandboxes held); then wait for those processes to be gone, their memory with
        them."""
        near = (f"the host's sandboxes together came within {(self.bound - self.line) // MIB:,}"
                f" MiB of the {self.bound // MIB:,} MiB of memory they share, and")
        holding = (f"of the family holding the most ({family.held // MIB:,} MiB, "
                   f"{len(family.sandboxes)} sandbox(es) and {len(family.kept)} checkpoint(s) "
                   "or snapshot(s))")
        if family.victim is None:
            cp = max(family.kept, key=lambda c: c.record.created)
            why = (f"{near} nothing of the family holding the most runs: its newest "
                   f"{'snapshot ' + repr(cp.snapshot) if cp.snapshot else 'checkpoint ' + cp.id}"
                   f" was dropped {holding[:-1]}) so that every other family goes on")
            log.warning("dropping %s: %s", cp.id, why)
            self.engine.events.publish("dropped", cp.record, snapshot=cp.snapshot, reason=why)
            await self.engine.drop_kept(cp)
            return
        victim = family.victim
        await hard_stop(victim.body, (
            f"{near} sandbox {victim.id} held the most ({family.victim_held // MIB:,} MiB) "
            f"{holding}: it was stopped so that every other family goes on"), errors.ReplGone)
        await killed(victim.body)

    def _families(self) -> dict[str, _Family]:
        """Each family's parts, as they are now (read on the event loop, weighed off it)."""
        families: dict[str, _Family] = {}
        rooms = {}
        for sb in list(self.engine.live.values()):
            families.setdefault(sb.record.family, _Family(name=sb.record.family)
                                ).sandboxes.append(sb)
            rooms[sb.record.family] = sb.family.room
        for cp in list(self.engine._checkpoints.values()):
            families.setdefault(cp.record.family, _Family(name=cp.record.family)
                                ).kept.append(cp)
            if cp.family is not None:
                rooms[cp.record.family] = cp.family.room
        for name, room in rooms.items():
            families[name].remains = [r for r in room.remains if isinstance(r, ChargedRemains)]
        return families
