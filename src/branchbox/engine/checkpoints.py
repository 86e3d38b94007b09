"""Checkpoints: instants of a sandbox (memory and files) to go back to or branch from.

A checkpoint is a fork of the sandbox's REPL that runs nothing
(``agent/checkpointing.py``, ``agent/bb_dormant.c``): its memory is the REPL's
pages shared copy-on-write, its files stack on a layer frozen at that instant
(as a fork's do), and it sits in its own cgroup waiting on a socket
(``runtime.dormant``), kept apart from the live sandboxes (no id a client can
run code in). Since it runs no Python, it copies no page of its own: it costs
the pages the sandbox changes after it. ``restore(cp)`` wakes it: it forks
once more, that process enters a new body as a fork child does, and the
sandbox's id is rebound to it exactly as ``merge_into`` rebinds it to a winner
(same id, same address, old body released); the checkpoint itself stays for
later restores and for ``fork``. A sandbox's checkpoints end with it (close,
or its id retired by a merge into its parent), but for snapshots, checkpoints
kept beyond it (engine.snapshots). They count against the family's limit of
checkpoints (``EngineConfig.max_checkpoints``), and each one's cgroup has the
sandbox's memory limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

from branchbox.agent.protocol import ChannelClosed
from branchbox.engine import answers, errors
from branchbox.engine.live import Body, FamilyHandle, Live
from branchbox.engine.pausing import PAUSED, refuse_paused
from branchbox.engine.records import SandboxRecord
from branchbox.engine.stopped import describe
from branchbox.runtime import procfs
from branchbox.runtime.cgroups import FreezeFailed, SandboxCgroup
from branchbox.runtime.channel import AgentChannel, AgentError
from branchbox.runtime.dormant import Dormant

log = logging.getLogger("branchbox.engine")

NAME_MAX = 128
CHECKPOINT = "checkpoint"  # the state of a checkpoint's record
SANDBOX_SETTINGS = ("cwd", "memory_mb", "disk_mb", "idle_timeout", "network")
"""What a snapshot keeps of its sandbox's settings, for the sandboxes started from it."""


@dataclass(eq=False)
class Checkpoint:
    record: SandboxRecord  # parent_id: the sandbox; meta: name and generation
    body: Body
    family: FamilyHandle | None = None  # a snapshot's: it is one of the family's members
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def snapshot(self) -> str | None:
        """The snapshot's name, if this checkpoint is one (engine.snapshots)."""
        return snapshot_name(self.record)

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def sandbox_id(self) -> str:
        assert self.record.parent_id is not None
        return self.record.parent_id

    def info(self) -> dict:
        """What a client sees, with the host processes holding the instant (for
        operators and the bench's memory figures: they map the sandbox's pages)."""
        resources: dict = {}
        with contextlib.suppress(OSError, ValueError):
            resources = {"memory_bytes": self.body.cgroup.memory_bytes(),
                         "host_pids": self.body.cgroup.pids()}
        return {"id": self.id, "name": self.record.meta.get("name"),
                "sandbox_id": self.sandbox_id, "created": self.record.created,
                "resources": resources}

    def snapshot_info(self) -> dict:
        """What a client sees of a snapshot: its name, where it came from, what holds it
        (``mapped_bytes``: the memory its process maps, the instant's; ``memory_bytes``
        is only what is charged to its cgroup, next to nothing: the pages stay charged
        to the sandbox that wrote them)."""
        info = self.info()
        resources = dict(info["resources"])
        with contextlib.suppress(OSError, ValueError, AttributeError):
            statm = Path(f"/proc/{self.body.channel.host_pid}/statm").read_text()
            resources["mapped_bytes"] = int(statm.split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return {"name": self.snapshot, "sandbox_id": info["sandbox_id"],
                "image": self.record.image, "created": info["created"],
                "resources": resources}


def snapshot_name(record: SandboxRecord) -> str | None:
    """The name of the snapshot ``record`` is, or None (a checkpoint or a sandbox)."""
    kept = record.meta.get("snapshot") if record.state == CHECKPOINT else None
    return kept.get("name") if isinstance(kept, dict) else None


def _check_name(name: object) -> None:
    if name is None:
        return
    if not isinstance(name, str) or not 1 <= len(name) <= NAME_MAX \
            or not name.isprintable():
        raise errors.InvalidRequest(
            f"a checkpoint name must be 1 to {NAME_MAX} printable characters")


class Checkpoints:
    """Mixed into Engine (uses its fork path, rebind, records and ``_checkpoints``)."""

    def _checkpoint_of(self, sandbox_id: str, checkpoint_id: str) -> Checkpoint:
        cp = self._checkpoints.get(checkpoint_id)
        if cp is None or cp.sandbox_id != sandbox_id or cp.snapshot:
            raise errors.SandboxNotFound(f"checkpoint {checkpoint_id!r} of {sandbox_id} not "
                                         "found")
        return cp

    def checkpoints(self, sandbox_id: str) -> list[Checkpoint]:
        """The sandbox's checkpoints, oldest first."""
        self.get(sandbox_id)
        return sorted((cp for cp in self._checkpoints.values()
                       if cp.sandbox_id == sandbox_id and not cp.snapshot),
                      key=lambda cp: cp.record.created)

    async def checkpoint(self, sandbox_id: str, name: str | None = None, *,
                         snapshot: str | None = None) -> Checkpoint:
        """This instant of the sandbox (REPL memory, files, env, cwd), kept by a process
        that runs nothing; with ``snapshot``, kept beyond the sandbox under that name, a
        member of its family (engine.snapshots)."""
        _check_name(name)
        sb = self.get(sandbox_id)
        family = [cp for cp in self._checkpoints.values()
                  if cp.record.family == sb.record.family]
        if len(family) >= self.config.max_checkpoints:
            raise errors.Conflict(
                f"the family of {sandbox_id} holds {len(family)} checkpoints, its limit; "
                "delete some first")
        await self._acquire(sb, self.config.busy_wait)
        # A snapshot of a paused sandbox (E2B pauses one to snapshot it): its REPL forks
        # the instant, so it is thawed for that while its lock keeps every call out.
        paused = snapshot is not None and sb.record.state == PAUSED
        try:
            if paused:
                await asyncio.to_thread(sb.body.cgroup.freeze, None, False)
            channel = self._check_alive(sb, paused_ok=paused)
            await self._check_room(sb, "checkpoint")
            try:
                body = await self._within_deadline(self._checkpoint_body(sb, channel))
            except FreezeFailed as exc:
                raise errors.Conflict(f"checkpoint failed: {exc}") from None
            except (AgentError, ChannelClosed) as exc:
                why = exc.message if isinstance(exc, AgentError) else "the REPL died"
                raise errors.EngineError(f"checkpoint failed: {why}") from None
            meta = {"name": name, "generation": sb.generation, "pid": body.channel.pid,
                    "stack": describe(body.layers), "launcher": list(sb.family.family.ident)}
            if snapshot is not None:  # what sandboxes started from it take (their limits)
                meta["snapshot"] = {"name": snapshot, "sandbox": {
                    k: sb.record.meta.get(k) for k in SANDBOX_SETTINGS}}
            record = SandboxRecord(
                id="cp_" + secrets.token_hex(16), family=sb.record.family, instance=body.key,
                image=sb.record.image, parent_id=sb.id, state=CHECKPOINT, meta=meta)
            cp = Checkpoint(record, body, sb.family if snapshot is not None else None)
            self._checkpoints[cp.id] = cp
            if cp.family is not None:
                cp.family.members.add(cp.id)
            self.records.put(record)
            self._keep_channels([body])
            self.events.publish("checkpoint", sb.record, checkpoint=cp.id, name=name)
            return cp
        finally:
            if paused and sb.record.state == PAUSED:  # not resumed meanwhile: frozen again
                with contextlib.suppress(FreezeFailed, OSError):
                    await asyncio.to_thread(sb.body.cgroup.freeze)
            self._unlock(sb)  # once the REPL is done with calls given up on

    async def _checkpoint_body(self, sb: Live, channel: AgentChannel) -> Body:
        """The body of a new checkpoint of ``sb``: a cgroup, the REPL forked into it
        (``agent.checkpointing``), and volumes over a layer frozen at the same instant."""
        limits = self._limits(sb.record.meta.get("memory_mb"))
        async with self._instant(sb.body, channel) as (lowers, inherit):
            cgroup = self.ready_cgroups.take(limits)
            try:
                dormant = await self._fork_dormant(channel, cgroup, inherit)
            except BaseException:
                await asyncio.to_thread(cgroup.remove)
                raise
            try:
                frozen = await asyncio.shield(lowers)
                stack = self.layers.new_stack(frozen, sb.body.layers.base,
                                              sb.body.layers.workspace, ids=sb.body.layers.ids)
            except BaseException:
                await dormant.close()
                await asyncio.to_thread(cgroup.remove)
                raise
        self.ready_cgroups.want(limits, 1)  # the next checkpoint's (or fork child's)
        self.layers.want_blank(frozen, 1)
        return Body(cgroup.name, stack, cgroup, dormant)

    @staticmethod
    async def _fork_dormant(channel: AgentChannel, cgroup: SandboxCgroup,
                            inherit: dict) -> Dormant:
        """The checkpoint's process, forked from the REPL (``channel``) into ``cgroup``,
        once it says it is in place. A ChannelClosed from the REPL's call is the REPL's;
        from the checkpoint's process, an AgentError."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        dormant = Dormant(ours)
        join: list[int] = []
        try:
            try:
                join = cgroup.join_fds("repl")
                forked = await channel.call("checkpoint", {"inherit": inherit,
                                                           "njoin": len(join)},
                                            fds=[theirs.fileno(), *join])
            finally:
                theirs.close()
                for fd in join:
                    os.close(fd)
            try:
                await dormant.ready()
            except ChannelClosed:
                raise AgentError("Internal", "the checkpoint's process died before it was "
                                 "ready (its memory limit?)") from None
            dormant.pid = answers.pid_in(forked, "a checkpoint")
            dormant.host_pid = procfs.find_repl(cgroup.leaf_pids("repl"), dormant.pid) or 0
            if not dormant.host_pid:
                raise AgentError("Internal", "the checkpoint's process is not in its cgroup")
        except BaseException:
            await dormant.close()
            raise
        return dormant

    async def _copy_checkpoint(self, cp: Checkpoint, sb: Live, n: int,
                               hostname: str | None = None) -> list[tuple[str, Body]]:
        """``n`` running bodies forked from the checkpoint (it is woken once per body and
        goes back to waiting: it stays the instant it was), named ``hostname`` if given."""
        dormant = cp.body.channel
        gone = errors.ReplGone(f"checkpoint {cp.id} is gone (its process was killed)")
        if dormant is None or dormant.gone:
            raise gone
        try:
            return await self._wake_bodies(cp.body, sb, n, hostname)
        except errors.EngineError:
            if dormant.gone:
                raise gone from None
            raise

    async def restore(self, sandbox_id: str, checkpoint_id: str) -> None:
        """The sandbox becomes the checkpoint's instant again: same id and address, its
        current body released as merge_into releases a parent's. Branches forked before
        are stale afterwards (a restore is a new generation, as a merge is). Never
        refused for the family's limits (engine.family_room): the checkpoint holds what
        it held, and the body let go holds less than it did; it is the checkpoint that
        pins more, and a checkpoint is refused past them."""
        sb = self.get(sandbox_id)
        cp = self._checkpoint_of(sandbox_id, checkpoint_id)
        await self._acquire(sb, self.config.busy_wait)
        try:
            async with cp.lock:
                refuse_paused(sb)
                if self.live.get(sandbox_id) is not sb or checkpoint_id not in self._checkpoints:
                    raise errors.SandboxNotFound()  # closed or deleted while we waited
                ((_, body),) = await self._copy_checkpoint(cp, sb, 1, hostname=sb.id)
            old = self._rebind(sb, body)
            self._record_rebind(sb)
            await self._take_over(sb, old, named=True)
            self.events.publish("restore", sb.record, checkpoint=checkpoint_id)
        finally:
            self._unlock(sb)  # once the REPL is done with calls given up on

    async def fork_checkpoint(self, sandbox_id: str, checkpoint_id: str, n: int) -> list[Live]:
        """``n`` new sandboxes from the checkpoint's instant, children of its sandbox."""
        self._check_n(n)
        sb = self.get(sandbox_id)
        cp = self._checkpoint_of(sandbox_id, checkpoint_id)
        async with cp.lock:
            if checkpoint_id not in self._checkpoints:
                raise errors.SandboxNotFound()
            await self._check_room(sb, "fork", n)
            made = await self._copy_checkpoint(cp, sb, n)
        if self.live.get(sandbox_id) is not sb:  # closed meanwhile: its family may be gone
            for _, body in made:
                await self._destroy_body(body)
            raise errors.SandboxNotFound()
        children = self._adopt_children(sb, made, cp.record.meta["generation"])
        self.events.publish("fork", sb.record, children=[c.id for c in children],
                            checkpoint=checkpoint_id)
        return children

    async def delete_checkpoint(self, sandbox_id: str, checkpoint_id: str) -> None:
        cp = self._checkpoint_of(sandbox_id, checkpoint_id)
        async with cp.lock:
            if self._checkpoints.pop(checkpoint_id, None) is None:
                return
            self.records.mark_closed([checkpoint_id])
            await self._destroy_body(cp.body)

    def _drop_checkpoints(self, sandbox_id: str) -> list[Body]:
        """Forget the sandbox's checkpoints; returns their bodies for the caller to
        destroy (close awaits them, a merge retires them in the background)."""
        gone = [cp for cp in self._checkpoints.values()
                if cp.sandbox_id == sandbox_id and not cp.snapshot]
        for cp in gone:
            del self._checkpoints[cp.id]
        if gone:
            self.records.mark_closed([cp.id for cp in gone])
        return [cp.body for cp in gone]

    async def _free_checkpoints(self, sandbox_id: str) -> None:
        """Destroy the sandbox's checkpoints now (its close); never raises, so the close
        goes on to the sandbox's own body whatever happened to one of them."""
        for body in self._drop_checkpoints(sandbox_id):
            try:
                await self._destroy_body(body)
            except Exception:  # noqa: BLE001 - logged; the family's kill ends its processes
                log.exception("a checkpoint of %s was not freed cleanly", sandbox_id)

    def _retire_checkpoints(self, sandbox_id: str) -> None:
        """Destroy the sandbox's checkpoints in the background (its id retired by a merge)."""
        for body in self._drop_checkpoints(sandbox_id):
            self._retire(body)
