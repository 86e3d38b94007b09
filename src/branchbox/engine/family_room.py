"""What a family may still grow by: what it holds against its live sandboxes' limits.

Each sandbox's cgroup bounds the memory it charges and its volume's quota the bytes it
writes, but both are charged to whoever first touched them, for as long as they live:
the kernel charges a page to the cgroup that faulted it in, and btrfs simple quotas
charge an extent to the volume that wrote it, and neither can move the charge. A
closed parent's heap that its fork children still map, or the body a restore or a
merge replaced (its pages mapped by the checkpoint or the winner, its files in the
frozen layer they stack on), stays charged to a removed cgroup or a deleted volume:
held by the family, bounded by no live limit. Repeated — fork, close the parent,
allocate or write again — one sandbox of a 1 GiB limit held 4 GiB of memory after
five rounds, and one of a 100 MiB disk limit 516 MiB of the store, taken from every
other family.

So a family keeps account of such remains (:class:`~branchbox.runtime.cgroups.
ChargedRemains`, :class:`VolumeRemains`) while anything is charged to them, and the
engine refuses what would let it grow further — a fork, a checkpoint — while the
family holds more memory or disk than its live sandboxes' limits add up to (a fork over
its disk limits may go on over one squashed layer of what its children see, if that
fits: engine.branching). A restore is never refused: the checkpoint pinned what it
holds when it was made, and the body it replaces holds less once gone. Legitimate
branching stays within the limits: what a family holds is then what its sandboxes map
and see. A family holds at most its limits plus one round of its sandboxes' own
allocations and writes; closing the family frees it all.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from branchbox.engine import errors
from branchbox.runtime.cgroups import ChargedRemains
from branchbox.storage import btrfs

if TYPE_CHECKING:
    from branchbox.engine.live import Body
    from branchbox.storage.backend import Store

# Removed memory cgroups a family may keep charged at once: the kernel would keep each
# anyway, unnamed, and their ids are host-wide (65,535 at most).
MAX_REMAINS = 512
MIB = 1 << 20
# A deleted volume's bytes leave its quota group as btrfs's cleaner frees them, seconds
# later: a family over its disk limits just after deleting one is measured again meanwhile.
SETTLE = 5.0
SETTLE_STEP = 0.25
INLINE_READS = 16  # bodies and unread remains a check reads on the event loop (~0.1 ms each)
LINGERING = 64 << 10  # what a deleted volume's group keeps until the cleaner comes (≤ 16 KiB)


class Remains(Protocol):
    def pinned(self) -> int: ...
    def remove(self) -> None: ...


@dataclass(frozen=True, eq=False)  # one per removed body: by identity
class VolumeRemains:
    """A deleted writable volume's quota group: the bytes it wrote that frozen layers
    (its snapshots, which fork children and checkpoints stack on) still reference."""

    group: str  # its quota group's sysfs directory (Store.charge_group)
    deleted: float = field(default_factory=time.monotonic)

    def pinned(self) -> int:
        """What frozen layers hold of what the volume wrote; 0 when at most its root's
        tree blocks are left: btrfs frees those only when its cleaner gets to the
        deleted volume, tens of seconds later (a fork-merge loop left one per round)."""
        try:
            charged = btrfs.charged_bytes(self.group)
        except OSError as exc:  # the kernel dropped the group: nothing is charged
            if exc.errno in (errno.ENOENT, errno.ENODEV):  # ENODEV: while it was read
                return 0
            raise
        return charged if charged > LINGERING else 0

    def remove(self) -> None:
        """Nothing to delete: the kernel drops a quota group nothing is charged to."""


@dataclass
class Tally:
    """One resource of a family, measured: what its remains, live and kept bodies hold,
    and what its live ones may (None: one of them is unbounded)."""

    name: str
    retired: int = 0
    held: int = 0
    budget: int | None = 0

    @property
    def over(self) -> bool:
        return self.budget is not None and self.retired + self.held > self.budget


@dataclass
class FamilyRoom:
    """A family's remains: removed cgroups and deleted volumes still charged with what
    its live sandboxes map and stack on."""

    remains: list[Remains] = field(default_factory=list)
    # Each remains' charge when last read: a bound on it, since charges only shrink.
    last: dict[Remains, int] = field(default_factory=dict)
    reread_at: int = 0  # every remains is read again once the family holds this many

    def keep(self, *remains: Remains | None) -> None:
        self.remains += [r for r in remains if r is not None]

    def free(self) -> None:
        """The family is gone: delete every directory it kept."""
        remains, self.remains, self.last = self.remains, [], {}
        for r in remains:
            r.remove()

    async def check(self, what: str, live: list[Body], kept: list[Body], store: Store,
                    settle: bool = True) -> None:
        """Raise FamilyOverLimit if the family may not ``what`` (grow): it holds more
        than ``live`` (its sandboxes' bodies) may, counting ``kept`` (its checkpoints')
        and its remains; remains nothing is charged to any more are dropped on the way.

        Only a family that holds remains pays for this (one that holds none is within
        its limits by construction), and mostly a few reads per sandbox: remains read
        before count at their last charge and a sandbox at its whole usage, both
        bounds; only a family those bounds put over is read exactly. Every remains is
        read again each time their number doubles, which drops the drained ones. Over
        on disk just after a volume was deleted, it measures again for a few seconds
        (btrfs frees a deleted volume's bytes late) unless not ``settle``."""
        if not self.remains:
            return
        start = time.monotonic()
        exact = False
        while True:
            exact = exact or len(self.remains) >= self.reread_at
            seen = list(self.remains)
            known = {} if exact else {r: self.last[r] for r in seen if r in self.last}
            args = (seen, known, live, kept, store, exact)
            if len(seen) - len(known) + len(live) + len(kept) <= INLINE_READS:
                read, tallies = _measure(*args)  # a worker thread's turn costs more
            else:
                read, tallies = await asyncio.to_thread(_measure, *args)
            self.last.update(read)
            drained = {r for r, charge in read.items() if not charge}
            self.remains = [r for r in self.remains if r not in drained]  # kept meanwhile too
            for r in drained:
                del self.last[r]
            if exact:
                self.reread_at = 2 * len(self.remains) + 16
            cgroups = sum(isinstance(r, ChargedRemains) for r in self.remains)
            if cgroups > MAX_REMAINS:
                raise errors.FamilyOverLimit(
                    f"cannot {what}: the memory cgroups of {cgroups} closed or replaced "
                    "sandboxes of this family are still charged with pages its live "
                    f"sandboxes map (at most {MAX_REMAINS}); close some of its sandboxes")
            over = [t for t in tallies if t.over]
            if not over:
                return
            if not exact:
                exact = True  # the bounds say over: read everything exactly
                continue
            settling = any(isinstance(r, VolumeRemains) and r.deleted > start - SETTLE
                           for r in self.remains)
            if over[0].name != "disk" or not (settle and settling) \
                    or time.monotonic() > start + SETTLE:
                t = over[0]
                raise errors.FamilyOverLimit(
                    f"cannot {what}: the family holds {(t.retired + t.held) // MIB:,} MiB of "
                    f"{t.name}, more than the {t.budget // MIB:,} MiB its {len(live)} live "
                    f"sandbox(es) may; {t.retired // MIB:,} MiB of it belong to closed or "
                    f"replaced sandboxes and live ones still {_SHARE[t.name]}", t.name)
            await asyncio.sleep(SETTLE_STEP)


_SHARE = {"memory": "map those pages",
          "disk": "stack on those files (a file deleted or rewritten after a fork stays in "
                  "the layer its branches share until they close)"}


def _measure(remains: list[Remains], known: dict[Remains, int], live: list[Body],
             kept: list[Body], store: Store,
             exact: bool) -> tuple[dict[Remains, int], list[Tally]]:
    """(the charge of each remains read now, not in ``known`` — the drained ones, 0, are
    deleted; the family's memory and disk, each if its remains hold any: without them
    a family is within its limits). A sandbox's memory is its whole usage unless
    ``exact``: a bound on what it pins."""
    memory, disk = Tally("memory"), Tally("disk")
    read = {}
    for r in remains:
        charge = known.get(r)
        if charge is None:
            charge = read[r] = r.pinned()
            if not charge:
                r.remove()
        (memory if isinstance(r, ChargedRemains) else disk).retired += charge
    if memory.retired:
        for body in live:
            with contextlib.suppress(OSError):  # closed meanwhile: neither holds nor may
                memory.budget += body.cgroup.memory_limit()
        for body in live + kept:
            with contextlib.suppress(OSError):
                memory.held += body.cgroup.pinned_bytes() if exact else body.cgroup.memory_bytes()
    if disk.retired:
        for body in live + kept:
            with contextlib.suppress(OSError):
                disk.held += store.used(body.layers.volume) or 0
        for body in live:
            limit = body.layers.disk_bytes
            disk.budget = None if limit is None or disk.budget is None else disk.budget + limit
    return read, [t for t in (memory, disk) if t.retired]
