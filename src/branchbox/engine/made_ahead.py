"""What a fork makes per child, made ahead: a fork takes one instead of making it.

A child needs a cgroup (six directories and four limit writes on cgroup v1, ~0.5 ms)
and an empty writable volume (a btrfs subvolume, its disk limit and two directories,
~0.3 ms), each made on the fork's path for every child. Neither depends on the fork
instant, only on a key (the cgroup's limits, the volume's disk limit), so after each
fork as many as it had children are made again for that key (in a thread, off the
event loop), and the next fork takes them. At most :data:`READY_MAX` are kept ready
over all keys: a key not wanted for the longest loses its first, so clients that vary
their limits do not pile up cgroups and volumes nobody takes. What an earlier daemon
left ready is an empty leftover, which the next start removes with the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

log = logging.getLogger("branchbox.engine")
READY_MAX = 32  # kept ready over all keys (a fork takes at most 32 children)
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class MadeAhead(Generic[K, T]):
    """Things ``make(key)`` makes, kept ready per key; ``remove`` undoes one."""

    def __init__(self, what: str, make: Callable[[K], T], remove: Callable[[T], None],
                 most: int = READY_MAX) -> None:
        self.what = what
        self.make = make
        self.remove = remove
        self.most = most
        self.ready: OrderedDict[K, list[T]] = OrderedDict()  # least recently wanted first
        self._making: asyncio.Task | None = None
        self._closed = False

    def take(self, key: K) -> T:
        """One for ``key``: made ahead, else made now."""
        ready = self.ready.get(key)
        if ready:
            return ready.pop()
        return self.make(key)

    def want(self, key: K, n: int) -> None:
        """Have ``n`` (at most ``most``) ready for ``key``, made in a thread now; one batch
        at a time (a fork meanwhile takes what is there and makes the rest)."""
        if key in self.ready:
            self.ready.move_to_end(key)  # wanted now: the last to lose its own
        missing = min(n, self.most) - len(self.ready.get(key, ()))
        if missing <= 0 or self._making is not None or self._closed:
            return
        self._making = asyncio.get_running_loop().create_task(self._fill(key, missing))

    async def _fill(self, key: K, n: int) -> None:
        """Make ``n`` for ``key`` in a thread, then remove what is past ``most``; one fill
        at a time, and close() waits for the one under way."""
        try:
            made = await asyncio.to_thread(self._make_some, key, n)
            if self._closed:
                await asyncio.to_thread(self._remove_all, made)
            elif made:
                self.ready.setdefault(key, []).extend(made)
                self.ready.move_to_end(key)
                if extra := self._over_most():
                    await asyncio.to_thread(self._remove_all, extra)
        finally:
            self._making = None

    def _make_some(self, key: K, n: int) -> list[T]:
        """Up to ``n``; a failure (no memory or disk for one more, say) keeps those made
        and is logged: a fork then makes its children's on its path."""
        made: list[T] = []
        try:
            for _ in range(n):
                made.append(self.make(key))
        except OSError as exc:
            log.warning("%s made ahead: %s", self.what, exc)
        return made

    def _over_most(self) -> list[T]:
        """Taken out of the pool past ``most``, from the keys least recently wanted."""
        extra: list[T] = []
        over = sum(map(len, self.ready.values())) - self.most
        while over > 0:
            key, items = next(iter(self.ready.items()))
            cut = items[:over]
            del items[:over]
            if not items:
                del self.ready[key]
            extra += cut
            over -= len(cut)
        return extra

    def _remove_all(self, items: list[T]) -> None:
        """Remove each, whatever happens to the others (a failure is logged: the next
        start sweeps what is left)."""
        for item in items:
            try:
                self.remove(item)
            except OSError as exc:
                log.warning("%s made ahead, removing %s: %s", self.what, item, exc)

    async def close(self) -> None:
        """Remove everything made ahead (the daemon stops), once a batch under way is in."""
        self._closed = True
        if self._making is not None:
            await asyncio.gather(self._making, return_exceptions=True)
        ready = [item for batch in self.ready.values() for item in batch]
        self.ready.clear()
        await asyncio.to_thread(self._remove_all, ready)
