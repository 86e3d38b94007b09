"""The warm pool: a few sandboxes kept started per image, so create is a hand-out.

Starting a family costs two interpreter start-ups (~150 ms here); a warm sandbox
takes a request's workspace, env, cwd and memory limit when handed out, and a
replacement starts in the background.

When more creates come than the pool holds, they wait in line for the pool's
next sandboxes instead of each starting its own: the pool starts at most
:data:`SPAWN_PARALLEL` (one per CPU) at a time and hands them out first come,
first served. Before, 50 creates at once meant 50 cold starts competing for two
CPUs, so every one of them finished late (p50 6.4 s); in line, the first ones
finish in a start-up time or two and only the last wait long.

The pool follows bursts: an agent that starts a best-of-N once tends to again. After
a burst of creates of an image (those within :data:`BURST_WINDOW` of each other), the
pool keeps as many of it ready (at most ``warm_max``) for :data:`BURST_MEMORY`, then
shrinks back to its configured size. A later burst of that size is all hand-outs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

from branchbox.engine import errors
from branchbox.engine.image_build import STEP_PREFIX
from branchbox.engine.live import Live

log = logging.getLogger("branchbox.engine")

SPAWN_PARALLEL = max(1, os.cpu_count() or 1)
"""Sandboxes the pool starts at once: more only compete for the same CPUs."""
BURST_WINDOW = 2.0
"""Creates of one image this close together (seconds) are one burst."""
BURST_MEMORY = 120.0
"""Seconds the pool keeps a burst's size after the burst's last create."""
WARM_CWD = "/root"
"""A create's directory when it asks for none, and where a warm sandbox's REPL starts
(with the default environment): a create that asks for nothing else takes it as it is."""


@dataclass
class _Demand:
    """The recent creates of one image: their times (within the window) and the largest
    burst since ``since``."""

    times: deque[float] = field(default_factory=deque)
    burst: int = 0
    since: float = 0.0
    shrink: asyncio.TimerHandle | None = None


class WarmPool:
    """Mixed into Engine (uses its config, _spawn and teardown)."""

    def _warm_size(self, image: str) -> int:
        """How many sandboxes of ``image`` to keep ready: the configured size, or the
        largest recent burst's (at most ``warm_max``); none when the pool is off."""
        if self.config.warm_pool <= 0:
            return 0
        demand = self._demand.get(image)
        if demand is None or time.monotonic() - demand.since > BURST_MEMORY:
            return self.config.warm_pool
        return max(self.config.warm_pool, min(demand.burst, self.config.warm_max))

    def _count_create(self, image: str) -> None:
        """A create of ``image`` came: it may be part of a burst the pool should follow."""
        now = time.monotonic()
        demand = self._demand.setdefault(image, _Demand())
        demand.times.append(now)
        while now - demand.times[0] > BURST_WINDOW:
            demand.times.popleft()
        if now - demand.since > BURST_MEMORY:
            demand.burst = 0  # the last burst is forgotten: a new one is measured
        demand.burst, demand.since = max(demand.burst, len(demand.times)), now
        if demand.burst > self.config.warm_pool:  # back to size once it is over
            if demand.shrink is not None:
                demand.shrink.cancel()
            demand.shrink = asyncio.get_running_loop().call_later(
                BURST_MEMORY + 1, self._shrink_warm, image)

    def _shrink_warm(self, image: str) -> None:
        """Let the ready sandboxes of ``image`` beyond the pool's size go, oldest first."""
        pool = self._warm.get(image) or []
        while len(pool) > self._warm_size(image) and not self._stopping:
            self._discard_warm(pool.pop(0))

    def _discard_warm(self, sb: Live) -> None:
        self._retire(sb.body)
        self._track(asyncio.get_running_loop().create_task(sb.family.family.kill()))

    async def _take_warm(self, image: str) -> Live | None:
        """A started sandbox of ``image``: a ready one, else the next the pool starts (in
        order of asking); None if the pool does not keep this image (a cold start)."""
        self._count_create(image)
        pool = self._warm.setdefault(image, [])
        sb = None
        while pool and sb is None:
            candidate = pool.pop()
            if candidate.body.channel.closed.is_set():  # died while waiting: free it
                self._discard_warm(candidate)
            else:
                sb = candidate
        if sb is not None:
            self._refill(image)
            return sb
        waiter: asyncio.Future = asyncio.get_running_loop().create_future()
        waiters = self._warm_waiters.setdefault(image, deque())
        waiters.append(waiter)
        self._refill(image)
        filling = self._refilling.get(image)
        if filling is None or filling.done():  # not an image the pool keeps (or it stopped)
            waiters.remove(waiter)
            return None
        try:
            return await waiter
        except asyncio.CancelledError:  # the caller went away: its sandbox is the next one's
            if waiter.done() and not waiter.cancelled():
                self._hand_out(image, waiter.result())
            raise

    def _hand_out(self, image: str, sb: Live) -> None:
        """``sb`` to the longest-waiting create of ``image``, or into the pool."""
        waiters = self._warm_waiters.get(image) or deque()
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(sb)
                return
        pool = self._warm.setdefault(image, [])
        if len(pool) >= self._warm_size(image):  # started for a burst the pool forgot since
            self._discard_warm(sb)
        else:
            pool.append(sb)

    def _refill(self, image: str) -> None:
        if self._warm_size(image) <= 0 or self._refilling.get(image) or image.startswith(
                STEP_PREFIX):  # a build step's sandbox is made once
            return
        task = asyncio.get_running_loop().create_task(self._fill(image))
        self._refilling[image] = task
        task.add_done_callback(lambda _: self._refilling.pop(image, None))

    async def _fill(self, image: str) -> None:
        """Start sandboxes (SPAWN_PARALLEL at a time) until the waiting creates are served
        and the pool is full; a failed start fails the waiting creates with its error."""
        pool = self._warm.setdefault(image, [])
        waiters = self._warm_waiters.setdefault(image, deque())
        meta = {"cwd": WARM_CWD, "memory_mb": None, "timeout": None, "workspace": None}
        starting: set[asyncio.Task] = set()
        try:
            while not self._stopping:
                wanted = sum(not w.done() for w in waiters) + self._warm_size(image) - len(pool)
                while len(starting) < min(wanted, SPAWN_PARALLEL):
                    starting.add(asyncio.get_running_loop().create_task(
                        self._spawn(image, dict(meta), None, None)))
                if not starting:
                    return
                done, starting = await asyncio.wait(starting,
                                                    return_when=asyncio.FIRST_COMPLETED)
                self._hand_out_all(image, done)
        except Exception as exc:
            log.warning("could not start a warm %s sandbox: %s", image, exc)
            _fail(waiters, exc)  # each create waiting reports the real error
        finally:
            for task in starting:
                task.cancel()  # _spawn undoes what it made
            if starting:
                await asyncio.wait(starting)
            with contextlib.suppress(Exception):
                self._hand_out_all(image, starting)  # those that finished anyway
            _fail(waiters, errors.EngineError(f"the {image} sandboxes stopped being started "
                                              "(the daemon is stopping or the image removed)"))

    def _hand_out_all(self, image: str, tasks: set[asyncio.Task]) -> None:
        """Hand out what the finished spawns ``tasks`` started; then raise the first
        failure among them, if any (after keeping every sandbox that did start)."""
        failures = [t.exception() for t in tasks if not t.cancelled() and t.exception()]
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                self._hand_out(image, task.result())
        if failures:
            raise failures[0]

    async def settle(self) -> None:
        """Wait until the warm pool is refilled (background work; tests and benchmarks
        use it to measure or compare the store without a spawn in flight)."""
        while self._refilling:
            await asyncio.gather(*list(self._refilling.values()), return_exceptions=True)

    async def _drop_warm(self) -> None:
        for task in list(self._refilling.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for pool in self._warm.values():
            while pool:
                sb = pool.pop()
                await self._destroy_body(sb.body)
                await sb.family.family.kill()


def _fail(waiters: deque, exc: BaseException) -> None:
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_exception(exc)
