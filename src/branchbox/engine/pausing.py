"""pause and resume: a whole sandbox frozen in its cgroup's freezer, and thawed again.

A paused sandbox runs nothing (REPL, commands, Q's init: no CPU) and keeps all
its memory and files; its lifetime timeout stops counting (the time left is
kept in its record's meta as ``timeout_left`` and re-armed by resume) and the
idle timeout treats it as in use. Calls that need its REPL are refused with a
409 until it is resumed, instead of waiting on a process that cannot answer.
A pause waits for a call already running on the REPL (a run, a fork, a merge:
up to the engine's busy wait, then 409), so no call is frozen half-way and no
run's deadline (the REPL's own timer, the daemon's, see engine.run_guard) runs
out while it is paused; background commands are frozen wherever they are.
Closing a paused sandbox works as for any other (the kill thaws).
"""

from __future__ import annotations

import asyncio
import time

from branchbox.engine import errors
from branchbox.engine.live import Body, Live
from branchbox.runtime.cgroups import FreezeFailed

PAUSED = "paused"


class Pausing:
    """Mixed into Engine (uses its live sandboxes, records and expiry)."""

    async def pause(self, sandbox_id: str) -> dict:
        """Freeze everything in the sandbox; idempotent. Returns its info."""
        sb = self.get(sandbox_id)
        if sb.record.state == PAUSED:
            return await self.report(sandbox_id)
        await self._acquire(sb, self.config.busy_wait)
        try:
            if self.live.get(sandbox_id) is not sb:  # closed or merged away meanwhile
                raise errors.SandboxNotFound()
            if sb.record.state != PAUSED:
                self._check_alive(sb)
                try:
                    await self._hold_frozen(sb.body)
                except FreezeFailed as exc:
                    raise errors.Conflict(f"pause failed: {exc}") from None
                self._stop_clock(sb)
                sb.record.state = PAUSED
                self.records.put(sb.record)
                self.events.publish("pause", sb.record)
        finally:
            self._unlock(sb)
        return await self.report(sandbox_id)

    async def resume(self, sandbox_id: str) -> dict:
        """Thaw the sandbox and restart its lifetime clock; idempotent. Returns its info."""
        sb = self.get(sandbox_id)
        if sb.record.state == PAUSED:
            self._let_thaw(sb.body)
            await asyncio.to_thread(sb.body.cgroup.freeze, None, False)
            sb.record.state = "ready"
            self._start_clock(sb)
            self.records.put(sb.record)
            self.events.publish("resume", sb.record)
        return await self.report(sandbox_id)

    async def _hold_frozen(self, body: Body) -> None:
        """Freeze the whole body, on purpose: a daemon that dies leaves it frozen (its
        thaw guard thaws only what was frozen for a moment: runtime.thaw_guard)."""
        await asyncio.to_thread(body.cgroup.freeze)
        body.held_frozen = True
        self._thaw_guard.hold_frozen(body.key)

    def _let_thaw(self, body: Body) -> None:
        if body.held_frozen:
            body.held_frozen = False
            self._thaw_guard.hold_frozen(body.key, frozen=False)

    @staticmethod
    def _stop_clock(sb: Live) -> None:
        """Keep the lifetime left instead of a running timer."""
        if sb.timer is not None:
            left = sb.timer.when() - asyncio.get_running_loop().time()
            sb.timer.cancel()
            sb.timer = None
            meta = {k: v for k, v in sb.record.meta.items() if k != "expires"}
            sb.record.meta = {**meta, "timeout_left": max(left, 0.0)}

    def _start_clock(self, sb: Live) -> None:
        sb.last_used = time.monotonic()  # idle counts from the resume
        left = sb.record.meta.get("timeout_left")
        if left is not None:
            sb.record.meta = {k: v for k, v in sb.record.meta.items() if k != "timeout_left"}
            self._arm(sb, left)


def refuse_paused(sb: Live) -> None:
    """A call that needs the REPL: 409 while the sandbox is paused."""
    if sb.record.state == PAUSED:
        raise errors.Conflict(f"sandbox {sb.id} is paused; resume it first")
