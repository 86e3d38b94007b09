"""Each family's own host id range (a *slot*), and the id-mapped views its layers need.

Why: per-user kernel budgets are counted per host uid (pipe buffers above all:
past ``pipe-user-pages-soft`` a user's new pipes get 8 KiB instead of 64). Were
all families one range, one family holding a thousand pipes would shrink every
other family's. So each family runs in a slot of its own (storage.idmap); its
fork children share it, as they share its user namespace.

What a family sees that it did not write must appear in its range:

- the image, stored in slot 0, is stacked as an id-mapped mount (slot 0 shown
  as the family's slot), made once per slot and image and then kept: a fork
  child's root stacks the same mount, so fork costs what it did;
- a workspace's host directory is an id-mapped mount of host ids 0.. shown as
  the family's range;
- the agent layer stays the host root's (nobody's inside), unmapped.

Frozen layers never cross families (snapshots of a family's own volumes,
stacked only under that family's forks), so they need no mapping.

A slot is free again once its family's processes are gone (the launcher was
reaped) and every layer of the family is gone too (every stack released, which
deletes the frozen layers only those stacks referenced): no file of the range
is then left in a layer any sandbox can see. Taken slots are recorded in SQLite:
a restarted daemon frees a recorded slot only after it has cleaned the store and
no live record of its family is left (:meth:`IdRanges.recover`). Daemons of
other data directories on the same host are kept out with an flock on
``/run/branchbox/ids/<slot>``, held while the slot is taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from branchbox.engine.host_image import HOST_ROOT
from branchbox.runtime import rootfs
from branchbox.storage.idmap import (
    SLOTS,
    UID_BASE,
    UID_COUNT,
    clashing_slots,
    host_claims,
    slot_base,
)

log = logging.getLogger("branchbox.engine")

LOCK_DIR = Path("/run/branchbox/ids")


class NoIdRange(RuntimeError):
    """Every family slot is taken (by this daemon's families or another daemon's)."""


@dataclass(eq=False)
class _SlotMaps:
    """The id-mapping namespaces and image mounts of one slot, made on first use and
    kept for the daemon's life: slots are reused lowest first, so a daemon makes as
    many as it ever had families at once, and a reused slot costs no process start."""

    base: int
    image_userns: int = -1  # maps the images' storage range (slot 0) onto this slot
    host_userns: int = -1  # maps host ids 0.. onto this slot (workspaces)
    lowers: dict[Path, Path | int] = field(default_factory=dict)

    def close(self) -> None:
        fds = [self.image_userns, self.host_userns]
        fds += [v for v in self.lowers.values() if isinstance(v, int)]
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        self.image_userns = self.host_userns = -1
        self.lowers.clear()


class IdRange:
    """One family's host ids: ``base``.. ``base + 65535`` (its root is ``base``).

    Held by the family's processes (one hold, dropped when the launcher is reaped)
    and by every layer stack of the family; the last drop frees the slot.
    """

    def __init__(self, ranges: IdRanges, slot: int, family: str, maps: _SlotMaps) -> None:
        self.slot, self.family, self.base = slot, family, maps.base
        self._ranges, self._maps = ranges, maps
        self.holds = 1

    def hold(self) -> None:
        if self.holds <= 0:
            raise RuntimeError(f"id slot {self.slot} was freed already")
        self.holds += 1

    def drop(self) -> None:
        self.holds -= 1
        if self.holds == 0:
            self._ranges._free(self)

    def lower(self, path: Path) -> Path | int:
        """What an overlay stacks for base layer ``path``: a layer stored in the images'
        range, or the host's root, as an id-mapped mount shown in this family's range (one
        per slot and layer, shared by every root stacked on it), anything else as it is."""
        got = self._maps.lowers.get(path)
        if got is None:
            got = path
            if path == HOST_ROOT:  # image "host": host ids 0.. shown as the family's
                got = self.host_tree(path)
            elif UID_BASE <= os.stat(path).st_uid < UID_BASE + UID_COUNT:
                got = rootfs.idmapped_tree(path, self._ranges.userns(self._maps, "image"))
            self._maps.lowers[path] = got
        return got

    def host_tree(self, path: Path) -> int:
        """A new id-mapped mount of host directory ``path`` whose host ids 0.. appear as
        this family's (a workspace's bottom layer); the caller closes it."""
        return rootfs.idmapped_tree(path, self._ranges.userns(self._maps, "host"))


class IdRanges:
    """Hands out family slots 1..SLOTS-1, lowest free first, skipping slots whose range
    the host has handed out itself (storage.idmap.host_claims)."""

    def __init__(self, records, *, lock_dir: Path = LOCK_DIR,
                 claims: list[tuple[int, int]] | None = None) -> None:
        self.records = records
        self.lock_dir = lock_dir
        lock_dir.mkdir(parents=True, exist_ok=True)
        lock_dir.chmod(0o700)
        self.skipped = clashing_slots(host_claims() if claims is None else claims)
        if 0 in self.skipped:
            log.warning("host ids %d..%d (where images are stored) overlap ids the host "
                        "has handed out (/etc/passwd, group, subuid, subgid)",
                        UID_BASE, UID_BASE + UID_COUNT - 1)
        self._maps: dict[int, _SlotMaps] = {}
        self._locks: dict[int, int] = {}  # slot -> fd of the lock file this daemon holds
        # Slots recorded by an earlier daemon stay taken until recover() says otherwise.
        self.taken: dict[int, IdRange | None] = dict.fromkeys(records.slots())

    def recover(self, keep: set[str]) -> None:
        """After start-up has cleaned the store: free the recorded slots of families not
        in ``keep`` (nothing of them is left), keep the others' (a family that survived
        the restart still runs there, and its layers hold files of its range)."""
        for slot, family in self.records.slots().items():
            if isinstance(self.taken.get(slot), IdRange):
                continue  # handed out by this daemon: its own family holds it
            if family in keep:
                if not self._lock(slot):
                    log.error("id slot %d of surviving family %s is held by another "
                              "daemon", slot, family)
                self.taken[slot] = None
            else:
                self.records.free_slot(slot)
                self.taken.pop(slot, None)

    def adopt(self, slot: int, family: str) -> IdRange | None:
        """The range of a slot :meth:`recover` kept for ``family`` (whose stopped sandboxes'
        files are owned by it), held once for the caller; None if it was not kept."""
        if slot not in self.taken or self.records.slots().get(slot) != family:
            return None
        ids = self.taken[slot]
        if isinstance(ids, IdRange):
            ids.hold()
            return ids
        maps = self._maps.get(slot)
        if maps is None:
            maps = self._maps[slot] = _SlotMaps(slot_base(slot))
        ids = self.taken[slot] = IdRange(self, slot, family, maps)
        return ids

    def allocate(self, family: str) -> IdRange:
        """A free slot for new family ``family`` (recorded before it is used)."""
        for slot in range(1, SLOTS):
            if slot in self.taken or slot in self.skipped or not self._lock(slot):
                continue
            maps = self._maps.get(slot)
            if maps is None:
                maps = self._maps[slot] = _SlotMaps(slot_base(slot))
            try:
                self.records.take_slot(slot, family)
            except BaseException:
                self._unlock(slot)
                raise
            ids = self.taken[slot] = IdRange(self, slot, family, maps)
            return ids
        raise NoIdRange(f"all {SLOTS - 1} host id ranges for families are taken")

    def family_slots(self) -> set[int]:
        """Every slot a family may be given: what a template's user namespace maps."""
        return set(range(1, SLOTS)) - self.skipped

    def userns(self, maps: _SlotMaps, kind: str) -> int:
        """The slot's id-mapping user namespace of ``kind`` ("image" or "host")."""
        if kind == "image":
            if maps.image_userns < 0:
                maps.image_userns = rootfs.idmap_userns(UID_BASE, maps.base)
            return maps.image_userns
        if maps.host_userns < 0:
            maps.host_userns = rootfs.idmap_userns(0, maps.base)
        return maps.host_userns

    def forget(self, path: Path) -> None:
        """Let go of every slot's id-mapped view of layer ``path`` (being deleted): an open
        view would keep the deleted layer's files alive for the daemon's life."""
        for maps in self._maps.values():
            view = maps.lowers.pop(path, None)
            if isinstance(view, int):
                os.close(view)

    def _free(self, ids: IdRange) -> None:
        if self.taken.get(ids.slot) is not ids:
            return
        del self.taken[ids.slot]
        with contextlib.suppress(Exception):  # a closed database at shutdown: recover frees it
            self.records.free_slot(ids.slot)
        self._unlock(ids.slot)

    def _lock(self, slot: int) -> bool:
        fd = os.open(self.lock_dir / str(slot), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._locks[slot] = fd
        return True

    def _unlock(self, slot: int) -> None:
        fd = self._locks.pop(slot, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Let go of every mapping and lock (the daemon stops)."""
        for maps in self._maps.values():
            maps.close()
        self._maps.clear()
        for slot in list(self._locks):
            self._unlock(slot)
