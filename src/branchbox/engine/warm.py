"""The warm pool: a few sandboxes kept started per image, so create is a hand-out.

Starting a family costs two interpreter start-ups (~150 ms here); a warm sandbox
takes a request's workspace, env, cwd and memory limit when handed out, and a
replacement starts in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from branchbox.engine.live import Live

log = logging.getLogger("branchbox.engine")


class WarmPool:
    """Mixed into Engine (uses its config, _spawn and teardown)."""

    def _take_warm(self, image: str) -> Live | None:
        """A started sandbox of ``image`` if one is ready (and a replacement starts)."""
        pool = self._warm.setdefault(image, [])
        sb = None
        while pool and sb is None:
            candidate = pool.pop()
            if candidate.body.channel.closed.is_set():  # died while waiting: free it
                self._retire(candidate.body)
                task = asyncio.get_running_loop().create_task(candidate.family.family.kill())
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            else:
                sb = candidate
        self._refill(image)
        return sb

    def _refill(self, image: str) -> None:
        if self.config.warm_pool <= 0 or self._refilling.get(image):
            return
        task = asyncio.get_running_loop().create_task(self._fill(image))
        self._refilling[image] = task
        task.add_done_callback(lambda _: self._refilling.pop(image, None))

    async def _fill(self, image: str) -> None:
        pool = self._warm.setdefault(image, [])
        meta = {"cwd": "/root", "memory_mb": None, "timeout": None, "workspace": None}
        try:
            while len(pool) < self.config.warm_pool and not self._stopping:
                pool.append(await self._spawn(image, dict(meta), None, None))
        except Exception:  # noqa: BLE001 - a cold create reports the real error
            log.exception("could not keep a warm %s sandbox", image)

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
