"""The memory all sandboxes share, taken back from the family that holds the most.

Each sandbox has its own memory limit (``memory_mb``), and all of them together one
bound: all of RAM but what the host keeps (runtime.cgroups.bound_all_sandboxes), which
this daemon's group has too, or less (``BRANCHBOX_SANDBOXES_MEMORY_MB``). The limits
overcommit the bound by design (a fork child gets its parent's limit, and an idle
child holds next to nothing), so sandboxes can reach it together; the kernel's OOM
killer then kills the process with the most memory under it, in whatever family. A
family of many mid-sized children pushed the host's sandboxes over, and another
family's one large REPL died for it.

The guard watches the group: once what its sandboxes hold that reclaim cannot free
(anonymous and shared memory; page cache is the kernel's to drop) comes within a
margin of the bound, it stops the sandbox holding the most in the family holding the
most (its sandboxes, checkpoints and snapshots, and what its closed members left
charged), as a run past its timeout is stopped (its processes killed, its files kept,
its calls told why), and looks again once those processes are gone. It is woken by
the kernel when the group's usage crosses the line (cgroup v1's thresholds) and looks
every POLL seconds while the usage stays above it (page cache may keep it there); on
cgroup v2, which has no thresholds, it polls. The kernel's killer stays the last
resort, for memory taken faster than the guard looks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field

from branchbox.engine import errors
from branchbox.engine.live import Body, Live
from branchbox.engine.run_guard import hard_stop, killed
from branchbox.runtime.cgroups import ChargedRemains, GroupMemory

log = logging.getLogger("branchbox.engine")

MARGIN = (64 << 20, 32)
"""The guard acts this far below the bound: max(64 MiB, 1/32 of it)."""
POLL = 0.05
"""Seconds between looks while the group's usage is above the line."""
IDLE_LOOK = 5.0
"""Seconds between looks while the kernel's threshold says nothing (a safety net)."""
MIB = 1 << 20


@dataclass
class _Family:
    """What one family holds, and the sandbox of it that holds the most and may be stopped."""

    sandboxes: list[Live] = field(default_factory=list)
    others: list[Body] = field(default_factory=list)  # checkpoints' and snapshots' bodies
    remains: list[ChargedRemains] = field(default_factory=list)
    held: int = 0
    victim: Live | None = None
    victim_held: int = 0

    def weigh(self) -> None:
        """Read what each part holds (blocking: a few cgroup files each)."""
        for sb in self.sandboxes:
            pinned = _pinned(sb.body)
            self.held += pinned
            channel = sb.body.channel
            if sb.body.stopped is None and channel is not None \
                    and not channel.closed.is_set() and pinned > self.victim_held:
                self.victim, self.victim_held = sb, pinned
        self.held += sum(_pinned(body) for body in self.others)
        for remains in self.remains:
            with contextlib.suppress(OSError):
                self.held += remains.pinned()


def _pinned(body: Body) -> int:
    try:
        return body.cgroup.pinned_bytes()
    except (OSError, ValueError):  # closed meanwhile
        return 0


class MemoryGuard:
    """Watches this daemon's group for the engine (its live sandboxes and checkpoints)."""

    def __init__(self, engine, group: GroupMemory, limit: int | None) -> None:
        self.engine = engine
        self.group = group
        self.bound = group.bound(limit if limit is not None else 1 << 62)
        least, part = MARGIN
        self.line = self.bound - max(least, self.bound // part)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        alarm = None
        try:
            alarm = self.group.alarm(self.line)
        except OSError as exc:
            log.warning("no memory threshold on this daemon's group (%s): polling", exc)
        if alarm is not None:
            loop.add_reader(alarm, _take, alarm, woken)
        try:
            while True:
                woken.clear()
                try:
                    near = self.group.usage() >= self.line
                    over = near and self.group.pinned() >= self.line
                except OSError:  # the group went (a stop): nothing to guard
                    return
                if over:
                    await self._stop_one()
                elif near or alarm is None:
                    await asyncio.sleep(POLL)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(woken.wait(), IDLE_LOOK)
        except Exception:  # noqa: BLE001 - logged; the kernel's killer still bounds them
            log.exception("the sandboxes' memory guard stopped")
        finally:
            if alarm is not None:
                loop.remove_reader(alarm)
                os.close(alarm)

    async def _stop_one(self) -> None:
        """Stop the sandbox holding the most of the family holding the most; then wait
        for its processes to be gone (their memory with them)."""
        families = self._families()
        await asyncio.to_thread(lambda: [f.weigh() for f in families.values()])
        ranked = sorted((f for f in families.values() if f.victim is not None),
                        key=lambda f: f.held, reverse=True)
        if not ranked:  # only checkpoints, snapshots and remains hold it: nothing runs
            await asyncio.sleep(POLL)
            return
        family = ranked[0]
        victim = family.victim
        await hard_stop(victim.body, (
            f"the host's sandboxes together came within {(self.bound - self.line) // MIB:,} "
            f"MiB of the {self.bound // MIB:,} MiB of memory they share, and sandbox "
            f"{victim.id} held the most ({family.victim_held // MIB:,} MiB) of the family "
            f"holding the most ({family.held // MIB:,} MiB, {len(family.sandboxes)} "
            "sandbox(es)): it was stopped so that every other family goes on"),
            errors.ReplGone)
        await killed(victim.body)

    def _families(self) -> dict[str, _Family]:
        """Each family's parts, as they are now (read on the event loop, weighed off it)."""
        families: dict[str, _Family] = {}
        rooms = {}
        for sb in list(self.engine.live.values()):
            families.setdefault(sb.record.family, _Family()).sandboxes.append(sb)
            rooms[sb.record.family] = sb.family.room
        for cp in list(self.engine._checkpoints.values()):
            families.setdefault(cp.record.family, _Family()).others.append(cp.body)
            if cp.family is not None:
                rooms[cp.record.family] = cp.family.room
        for name, room in rooms.items():
            families[name].remains = [r for r in room.remains if isinstance(r, ChargedRemains)]
        return families


def _take(alarm: int, woken: asyncio.Event) -> None:
    """The kernel signalled the threshold: read the count (or the fd stays readable)."""
    with contextlib.suppress(BlockingIOError):
        os.eventfd_read(alarm)
    woken.set()
