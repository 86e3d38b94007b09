"""Cgroups made ahead for fork children: a fork takes one instead of making it.

A sandbox's cgroup is six directories and four limit writes on cgroup v1
(~0.5 ms), made on the fork's path for every child. Nothing in it depends on
the fork instant but its limits, so after each fork as many as it had children
are made again for those limits (in a thread, off the event loop), and the next
fork takes them. Their names are fresh random keys, the keys of the bodies that
take them, as for a cgroup made on the path. One that an earlier daemon left
ready is an empty leftover, which the next start removes with the others.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from branchbox.runtime.cgroups import Limits, SandboxCgroup

log = logging.getLogger("branchbox.engine")
READY_MAX = 32  # cgroups kept ready per set of limits (a fork takes at most 32 children)


class ReadyCgroups:
    """The engine's cgroups made ahead, per set of limits."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.ready: dict[Limits, list[SandboxCgroup]] = {}
        self._making: asyncio.Task | None = None
        self._closed = False

    def take(self, limits: Limits) -> SandboxCgroup:
        """A cgroup with ``limits``: one made ahead, else one made now."""
        ready = self.ready.get(limits)
        if ready:
            return ready.pop()
        return SandboxCgroup.create(self.group, secrets.token_hex(8), limits)

    def want(self, limits: Limits, n: int) -> None:
        """Have ``n`` (at most READY_MAX) ready for ``limits``, made in a thread now; one
        batch at a time (a fork meanwhile takes what is there and makes the rest)."""
        missing = min(n, READY_MAX) - len(self.ready.get(limits, ()))
        if missing <= 0 or self._making is not None or self._closed:
            return
        self._making = asyncio.get_running_loop().create_task(self._make(limits, missing))

    async def _make(self, limits: Limits, n: int) -> None:
        try:
            made = await asyncio.to_thread(self._create, limits, n)
        finally:
            self._making = None
        if self._closed:
            await asyncio.to_thread(_remove, made)
        else:
            self.ready.setdefault(limits, []).extend(made)

    def _create(self, limits: Limits, n: int) -> list[SandboxCgroup]:
        """Up to ``n`` cgroups; a failure (no memory for one more, say) keeps those made
        and is logged: a fork then makes its children's on its path."""
        made: list[SandboxCgroup] = []
        try:
            for _ in range(n):
                made.append(SandboxCgroup.create(self.group, secrets.token_hex(8), limits))
        except OSError as exc:
            log.warning("cgroups made ahead: %s", exc)
        return made

    async def close(self) -> None:
        """Remove every cgroup made ahead (the daemon stops), once a batch under way is in."""
        self._closed = True
        if self._making is not None:
            await asyncio.gather(self._making, return_exceptions=True)
        ready = [cg for batch in self.ready.values() for cg in batch]
        self.ready.clear()
        await asyncio.to_thread(_remove, ready)


def _remove(cgroups: list[SandboxCgroup]) -> None:
    for cg in cgroups:
        cg.remove()
