"""Snapshots: a sandbox's instant (memory and files) that outlives the sandbox, for new
sandboxes to start from: E2B's ``create_snapshot()`` (with memory, its default) and
``Sandbox.create(snapshot_id)``.

A snapshot is a checkpoint (engine.checkpoints) under a name, kept when its sandbox
closes or is merged away. Its family (user and PID namespaces, id slot, launcher) is
kept with it: the snapshot is one of the family's members, as its sandboxes are, and
the family ends when the last of them goes. A sandbox started from a snapshot is a fork
of the checkpoint's process, a new root of that family (it has no parent to merge
into): the REPL's memory, env and cwd, the files, the limits and the idle timeout of
the sandbox at that instant, isolated from every other sandbox started from it as fork
siblings are. Nothing is written out: the instant is the checkpoint's process and a
frozen layer, so starting from it takes a fork's milliseconds, and a snapshot lasts
while the daemon does (a stop with ``--keep`` keeps them, as it keeps sandboxes; a
stop without ends them).

Podflare's spaces are snapshots too: a sandbox created ``persistent`` is kept as one
(``space-...``) when its idle timeout runs out, then closed, and the ``frozen`` event
names it; a resume starts a sandbox from it and deletes it.

Names share E2B's template namespace with images: a name is an image name, and taking
one that a saved image has is a conflict. Snapshotting under a snapshot's name replaces
it (E2B assigns a new build to the template). At most ``EngineConfig.max_snapshots``
exist at once; each also counts as its family's checkpoint and member.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

from branchbox.agent.protocol import ChannelClosed
from branchbox.engine import errors
from branchbox.engine.checkpoints import Checkpoint
from branchbox.engine.create_args import check_env, check_lifetimes
from branchbox.engine.live import Live
from branchbox.engine.records import SandboxRecord
from branchbox.runtime.channel import AgentError

log = logging.getLogger("branchbox.engine")

SPACE = "space-"
"""Podflare's spaces are snapshots so named: made at a persistent sandbox's idle timeout,
used up by a resume."""


class Snapshots:
    """Mixed into Engine (uses its checkpoints, fork path, adoption and ``_snapshots``)."""

    def snapshots(self) -> list[Checkpoint]:
        """Every snapshot, oldest first."""
        return sorted(self._snapshots.values(), key=lambda cp: cp.record.created)

    def is_snapshot(self, name: str) -> bool:
        return name in self._snapshots

    def _snapshot(self, name: str) -> Checkpoint:
        cp = self._snapshots.get(name)
        if cp is None:
            raise errors.SnapshotNotFound(f"no snapshot {name!r}")
        return cp

    async def snapshot(self, sandbox_id: str, name: str | None = None) -> Checkpoint:
        """This instant of the sandbox, kept as snapshot ``name`` (a new name if None)
        beyond the sandbox; an older snapshot of that name is replaced."""
        if name is not None and name.startswith(SPACE):
            raise errors.InvalidRequest(f"names starting {SPACE!r} are Podflare's spaces, "
                                        "made at a persistent sandbox's idle timeout")
        return await self._keep(sandbox_id,
                                f"snapshot-{secrets.token_hex(6)}" if name is None else name)

    async def _keep(self, sandbox_id: str, name: str) -> Checkpoint:
        """The sandbox's instant as snapshot (or space) ``name``, replacing one so named."""
        self._check_snapshot_name(name)
        sb = self.get(sandbox_id)
        if sb.record.meta.get("workspace"):
            raise errors.Conflict(
                "a sandbox with a workspace cannot be snapshotted: the sandboxes started "
                "from it would commit into its host directory")
        cp = await self.checkpoint(sandbox_id, snapshot=name)
        try:  # again: a save or another snapshot may have taken the name or the room
            self._check_snapshot_name(name)
        except errors.EngineError:
            await self._drop_snapshot(cp)
            raise
        old = self._snapshots.get(name)
        self._snapshots[name] = cp
        if old is not None:
            await self._drop_snapshot(old)
        return cp

    def _check_snapshot_name(self, name: str) -> None:
        """A snapshot's name is an image name no image has; past the daemon's number of
        snapshots, only an existing one's (which is replaced)."""
        if name in self._snapshots:
            return
        self.check_image_name(name)
        if len(self._snapshots) >= self.config.max_snapshots:
            raise errors.ResourceLimit(
                f"this server holds {len(self._snapshots)} snapshots, its limit "
                "(BRANCHBOX_MAX_SNAPSHOTS); delete some first")

    async def start_from_snapshot(self, name: str, *, env: dict[str, str] | None = None,
                                  timeout: float | None = None,
                                  idle_timeout: float | None = None,
                                  internet: bool | None = None, network: dict | None = None,
                                  persistent: bool = False) -> Live:
        """A new sandbox forked from snapshot ``name``'s instant: a root of its family
        with its sandbox's settings (``idle_timeout`` if given instead of its), ``env``
        added to the REPL's environment, closing ``timeout`` from now, with this network
        policy; ``persistent``: kept as a space at its idle timeout."""
        check_env(env)
        check_lifetimes(timeout=timeout, idle_timeout=idle_timeout)
        cp = self._snapshot(name)
        settings = {**cp.record.meta["snapshot"]["sandbox"], "timeout": timeout}
        if internet is not None or network is not None or not settings.get("network"):
            settings["network"] = await self.net.resolve(self.net.policy_of(internet, network))
        # else the snapshot's sandbox's policy, as a fork child has its parent's
        if idle_timeout is not None:
            settings["idle_timeout"] = idle_timeout
        if persistent:
            settings["persistent"] = True
        # Whose fork it is, for the fork path: the snapshot's settings and family.
        owner = Live(SandboxRecord(id=cp.sandbox_id, family=cp.record.family,
                                   instance=cp.body.key, image=cp.record.image,
                                   meta=settings), cp.body, cp.family)
        async with cp.lock:
            if self._snapshots.get(name) is not cp:
                raise errors.SnapshotNotFound(f"no snapshot {name!r}")  # deleted meanwhile
            await self._check_room(owner, "start a sandbox from a snapshot", 1)
            ((sid, body),) = await self._copy_checkpoint(cp, owner, 1)
            sb = Live(SandboxRecord(id=sid, family=cp.record.family, instance=body.key,
                                    image=cp.record.image, meta=settings), body, cp.family)
            cp.family.members.add(sid)  # before the lock goes: the family lives on
        try:
            if env:
                await sb.body.channel.call("configure", {"env": env})
        except (AgentError, ChannelClosed, OSError) as exc:
            await self._destroy_body(body)
            await self._leave_family(cp.family, sid, [])
            raise errors.EngineError(f"the sandbox failed to start: {exc}") from None
        self._adopt(sb, timeout)
        if idle := settings.get("idle_timeout"):
            self._close_when_idle(sb, idle)
        self.events.publish("create", sb.record, image=sb.record.image, snapshot=name)
        return sb

    async def resume_space(self, space: str, *, timeout: float | None = None,
                           idle_timeout: float | None = None, internet: bool | None = None,
                           persistent: bool = False) -> Live:
        """Podflare's resume: a sandbox started from the space, which it uses up."""
        _check_space(space)
        if space in self._resuming:  # a space is used up once: the first resume has it
            raise errors.SnapshotNotFound(f"space {space!r} is being resumed")
        self._resuming.add(space)
        try:
            sb = await self.start_from_snapshot(space, timeout=timeout,
                                                idle_timeout=idle_timeout, internet=internet,
                                                persistent=persistent)
            with contextlib.suppress(errors.SnapshotNotFound):  # deleted meanwhile
                await self.delete_snapshot(space)
        finally:
            self._resuming.discard(space)
        return sb

    async def delete_space(self, space: str) -> None:
        _check_space(space)
        await self.delete_snapshot(space)

    def _idle_out(self, sb: Live) -> None:
        """``sb``'s idle timeout ran out: a persistent sandbox (Podflare's) that is not a
        fork child is kept as a space first; every other one is closed."""
        if sb.record.meta.get("persistent") and sb.record.parent_id is None:
            self._track(asyncio.get_running_loop().create_task(self._freeze_into_space(sb)))
        else:
            self._expire(sb.id)

    async def _freeze_into_space(self, sb: Live) -> None:
        """Keep ``sb`` as a space (a snapshot named ``space-...``), then close it; the
        ``frozen`` event carries the space's id (Podflare's ``sandbox.frozen`` webhook),
        or why none was kept."""
        space = f"{SPACE}{secrets.token_hex(8)}"
        try:
            await self._keep(sb.id, space)
        except errors.EngineError as exc:
            log.warning("sandbox %s was not frozen into a space at its idle timeout: %s",
                        sb.id, exc)
            self.events.publish("frozen", sb.record, space_id=None, error=str(exc))
        else:
            self.events.publish("frozen", sb.record, space_id=space)
        await self._close_quietly(sb.id)

    async def delete_snapshot(self, name: str) -> None:
        await self._drop_snapshot(self._snapshot(name))

    async def _drop_snapshot(self, cp: Checkpoint) -> None:
        """Forget a snapshot and free its process and layers; the family ends with it if
        it was its last member."""
        async with cp.lock:
            if self._checkpoints.pop(cp.id, None) is None:
                return
            if self._snapshots.get(cp.snapshot) is cp:
                del self._snapshots[cp.snapshot]
            self.records.mark_closed([cp.id])
            left = []
            try:
                left = await self._destroy_body(cp.body,
                                                keep_charged=len(cp.family.members) > 1)
            finally:
                await self._leave_family(cp.family, cp.id, left)

    async def drop_kept(self, cp: Checkpoint) -> None:
        """End a checkpoint or a snapshot, whichever ``cp`` is (gone already: nothing)."""
        if cp.snapshot:
            await self._drop_snapshot(cp)
        else:
            with contextlib.suppress(errors.SandboxNotFound):
                await self.delete_checkpoint(cp.sandbox_id, cp.id)

    async def _drop_snapshots(self) -> None:
        """End every snapshot (a daemon's stop without --keep)."""
        for cp in list(self._snapshots.values()):
            with contextlib.suppress(errors.EngineError, OSError):
                await self._drop_snapshot(cp)


def _check_space(space: str) -> None:
    """Only spaces are reached through Podflare's routes (other snapshots are not)."""
    if not space.startswith(SPACE):
        raise errors.SnapshotNotFound(f"no space {space!r}")
