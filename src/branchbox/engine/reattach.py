"""A restarted daemon serves the sandboxes the earlier one left running (issue 13 part 1).

What outlives a daemon (``kill -9``, a crash, a stop with ``--keep``, an upgrade):

- every family: its launcher has no parent-death signal, so the family's PID
  namespace and every REPL, command and daemon in it keep running;
- every REPL's control socket: the fd keeper (runtime.fd_keeper) holds a
  duplicate of the daemon's end, so the agent never sees end-of-file;
- cgroups, layers, the bridge, each sandbox's link and address;
- the records (SQLite): each names its body (``instance``: the cgroup's and the
  kept socket's key), its layers (``meta.stack``), its launcher
  (``meta.launcher``, pid and start time), its lineage and its lifetime.

At start-up the new daemon takes the sockets back and re-attaches a record's
sandbox if its launcher is the very process recorded (pidfd, start time), its
cgroup is there, its socket is kept, and its REPL answers a ``ping`` within
:data:`PING_WAIT` on that socket (frames of the earlier daemon's requests are
dropped: runtime.channel's ``resumed``) with this daemon's protocol version (an
agent left by a daemon of another version would misread its requests). A stream
cut mid-frame by the kill does not parse, and a REPL that does not answer in time,
or not in this version, does not count: such a sandbox's processes are killed and
it comes back ``stopped`` (engine.stopped), its files kept. A fork the earlier
daemon was killed in, between its slots and its end, is ended in the REPL.
A workspace branch comes back with its host directory, commit base and version
(the versions committed so far are in SQLite, so first commit wins still holds
across a restart). Everything of the earlier daemon nobody re-attached to goes:
warm sandboxes, half-made fork children (their records are written only once
adopted), launchers of families left without sandboxes, links, leases.

Not kept across a restart: a call under way at the kill (its client gets a
broken connection; its output is dropped, the REPL finishes it on its own) and
the idle clock (it starts again). Paused sandboxes stay frozen while no daemon
runs (the thaw guard thaws only what was frozen for a moment); each is thawed
here for its ping, then frozen again. A checkpoint's process runs nothing
(engine.checkpoints): asked whether it is alive, it answers from where it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import socket
import time
from dataclasses import dataclass

from branchbox.agent import protocol
from branchbox.agent.protocol import ChannelClosed
from branchbox.engine import errors
from branchbox.engine.checkpoints import CHECKPOINT, Checkpoint, snapshot_name
from branchbox.engine.layers import LayerStack
from branchbox.engine.live import Body, FamilyHandle, Live
from branchbox.engine.pausing import PAUSED
from branchbox.engine.records import SandboxRecord
from branchbox.runtime import procfs
from branchbox.runtime.cgroups import FreezeFailed, SandboxCgroup
from branchbox.runtime.channel import AgentChannel, AgentError
from branchbox.runtime.dormant import Dormant
from branchbox.runtime.family import Family
from branchbox.runtime.fd_keeper import SIGNAL_LISTENER

log = logging.getLogger("branchbox.engine")

PING_WAIT = 5.0
"""Seconds a re-attached REPL has to answer before its sandbox is stopped instead."""
_ATTACHABLE = ("ready", PAUSED, CHECKPOINT)


@dataclass(eq=False)
class Survivor:
    record: SandboxRecord
    channel: AgentChannel | Dormant
    cgroup: SandboxCgroup
    family: Family


def _launcher(rec: SandboxRecord) -> tuple[int, int] | None:
    got = rec.meta.get("launcher")
    if isinstance(got, list) and len(got) == 2 and all(isinstance(v, int) for v in got):
        return got[0], got[1]
    return None


class Reattach:
    """Mixed into Engine (uses its records, keeper, network, layers and adoption)."""

    async def _find_survivors(self) -> dict[str, Survivor]:
        """The earlier daemon's sandboxes that still run and answer, by id. Kills the
        launchers no survivor needs; what else it left is reaped by the caller."""
        kept = await asyncio.to_thread(self.keeper.take)
        for key in [k for k in kept if k.startswith(SIGNAL_LISTENER)]:
            self.signal_guard.serve(kept.pop(key), key)  # deep branches' signal calls go on
        socks = {key: socket.socket(fileno=fd) for key, fd in kept.items()}
        group = self.config.cgroup_group
        cgroups = {cg.name: cg for cg in SandboxCgroup.leftovers(group)}
        launchers: dict[tuple[int, int], Family | None] = {
            ident: Family.adopt(*ident) for ident in self.records.launchers()}
        records = self.records.live()
        # A kill inside a merge, after the parent's record names the winner's body and
        # before the winner's is closed: the body is the parent's (the newer generation).
        owner: dict[str, SandboxRecord] = {}
        for rec in records:
            other = owner.get(rec.instance)
            if other is None or rec.meta.get("gen", 0) > other.meta.get("gen", 0):
                owner[rec.instance] = rec
        merged = [rec.id for rec in records if owner[rec.instance] is not rec]
        if merged:
            self.records.mark_closed(merged)
            records = [rec for rec in records if rec.id not in merged]
        parents = {rec.id for rec in records if rec.state != CHECKPOINT}
        candidates = []
        for rec in records:
            ident = _launcher(rec)
            family = launchers.get(ident) if ident is not None else None
            sock = socks.pop(rec.instance, None)
            if (rec.state in _ATTACHABLE and family is not None and sock is not None
                    and rec.instance in cgroups and isinstance(rec.meta.get("stack"), dict)
                    and (not rec.meta.get("workspace") or "workspace" in rec.meta["stack"])
                    and (rec.state != CHECKPOINT or rec.parent_id in parents
                         or snapshot_name(rec))):
                candidates.append((rec, sock, cgroups[rec.instance], family))
            elif sock is not None:
                sock.close()
        for sock in socks.values():
            sock.close()
        answered = await asyncio.gather(*(self._answers(*c) for c in candidates))
        survivors = {s.record.id: s for s in answered if s is not None}
        # A checkpoint whose sandbox did not come back goes with it (a snapshot stays).
        for sid in [sid for sid, s in survivors.items()
                    if s.record.state == CHECKPOINT and s.record.parent_id not in survivors
                    and not snapshot_name(s.record)]:
            await survivors.pop(sid).channel.close()
        needed = {s.family.ident for s in survivors.values()}
        for ident, family in launchers.items():
            if family is not None and ident not in needed:
                await family.kill()  # its namespace, and whatever still ran there, dies
            if family is None or ident not in needed:
                self.records.drop_launcher(ident)
        self.keeper.drop(sorted({rec.instance for rec in records}
                                - {s.record.instance for s in survivors.values()}))
        return survivors

    @staticmethod
    async def _answers(rec: SandboxRecord, sock: socket.socket, cgroup: SandboxCgroup,
                       family: Family) -> Survivor | None:
        channel = Dormant(sock) if rec.state == CHECKPOINT else AgentChannel(sock, resumed=True)
        try:
            if isinstance(channel, Dormant):  # a checkpoint's process: alive, or gone
                if not await asyncio.wait_for(channel.alive(), PING_WAIT):
                    raise ChannelClosed("its process is gone")
                channel.pid = int(rec.meta.get("pid") or 0)
                channel.host_pid = procfs.find_repl(cgroup.leaf_pids("repl"), channel.pid) or 0
                if not channel.host_pid:
                    raise ChannelClosed("its process is not in its cgroup")
            else:
                if rec.state == PAUSED:  # left frozen by the thaw guard
                    await asyncio.to_thread(cgroup.freeze, None, False)  # for the ping
                pong = await asyncio.wait_for(channel.call("ping"), PING_WAIT)
                version = pong.get("protocol") if isinstance(pong, dict) else None
                if version != protocol.VERSION:  # an agent of an older or newer daemon
                    shown = version if isinstance(version, int) else "unknown"  # hostile?
                    raise ChannelClosed(f"its agent speaks protocol {shown}, this daemon "
                                        f"{protocol.VERSION}")
                # A fork the earlier daemon was killed in never ended in the REPL: end
                # it (the REPL holds its signal handlers until then). Mostly none is
                # open, and the REPL says so.
                with contextlib.suppress(AgentError):
                    await asyncio.wait_for(channel.call("fork"), PING_WAIT)
            return Survivor(rec, channel, cgroup, family)
        except (TimeoutError, AgentError, ChannelClosed, OSError, FreezeFailed) as exc:
            log.warning("sandbox %s is not re-attached after the restart (%s): stopped", rec.id,
                        exc or "timeout")
            await channel.close()
            return None

    async def _reattach(self, survivors: dict[str, Survivor],
                        stacks: dict[str, LayerStack]) -> None:
        """Serve the survivors again (after the store, id slots and network are up)."""
        handles: dict[tuple[int, int], FamilyHandle] = {}
        by_policy: dict[str, tuple[dict, list[str]]] = {}  # one firewall change per policy
        lineage = self.records.lineage()
        top = max([0, *(at for _, at in lineage.values()),
                   *(s.record.meta.get("gen", 0) for s in survivors.values())])
        self._generations = itertools.count(top + 1)
        self._lineage.update(lineage)
        for sid, s in sorted(survivors.items(), key=lambda kv: kv[1].record.state == CHECKPOINT):
            rec, stack = s.record, stacks.get(sid)
            try:
                if stack is None:
                    raise errors.EngineError("its volumes or its id slot are gone")
                if rec.state == CHECKPOINT and rec.parent_id not in self.live \
                        and not snapshot_name(rec):
                    raise errors.EngineError("its sandbox did not come back")
                stack.base = await self._base_layers(rec.image)
                self._rebranch(stack, rec.meta["stack"].get("workspace"))
            except errors.EngineError as exc:
                log.warning("sandbox %s cannot be re-attached (%s): closed", sid, exc)
                if stack is not None:
                    self.layers.release(stack)
                await s.channel.close()
                await asyncio.to_thread(s.cgroup.remove)
                rec.meta = {**rec.meta, "lost": str(exc)}
                self.records.put(rec)
                self.records.mark_closed([sid])
                continue
            body = Body(rec.instance, stack, s.cgroup, s.channel)
            if rec.state == CHECKPOINT and not snapshot_name(rec):
                self._checkpoints[sid] = Checkpoint(rec, body)
                continue
            handle = handles.get(s.family.ident)
            if handle is None:
                handle = handles[s.family.ident] = FamilyHandle(s.family)
                s.family.on_exit = functools.partial(self._family_gone, s.family,
                                                     stack.ids)
                stack.ids.hold()  # the family's processes' hold
            handle.members.add(sid)
            if rec.state == CHECKPOINT:  # a snapshot: a member of its family
                cp = self._checkpoints[sid] = Checkpoint(rec, body, handle)
                self._snapshots[cp.snapshot] = cp
                continue
            sb = Live(rec, body, handle, generation=rec.meta.get("gen", 0),
                      forked_at=rec.meta.get("forked_at"))
            policy = rec.meta.get("network") or self.net.policy_of(None, None)
            by_policy.setdefault(json.dumps(policy, sort_keys=True), (policy, []))[1].append(
                body.key)
            if rec.state == PAUSED:
                with contextlib.suppress(FreezeFailed):
                    await self._hold_frozen(body)
            self._serve(sb)
            expires = rec.meta.get("expires")
            if rec.state != PAUSED and isinstance(expires, (int, float)):
                self._arm(sb, max(expires - time.time(), 1e-3))
            if idle := rec.meta.get("idle_timeout"):
                self._close_when_idle(sb, idle)
        for policy, keys in by_policy.values():
            self.net.apply(keys, policy)
        for s in survivors.values():  # a family none of whose sandboxes came back
            if s.family.ident not in handles and s.family.pidfd >= 0:
                await s.family.kill()
                self.records.drop_launcher(s.family.ident)
        if survivors:
            log.warning("re-attached to %d sandboxes and %d checkpoints of an earlier daemon",
                        len(self.live), len(self._checkpoints))

    def _rebranch(self, stack: LayerStack, desc: dict | None) -> None:
        """The workspace branch ``stack`` had (its layers are in its volume already): the
        same host directory, commit base and version (first commit wins still holds)."""
        if desc is None:
            return
        try:
            host = self._workspace_host(desc["host"])
        except errors.InvalidRequest as exc:
            raise errors.EngineError(f"its workspace is gone: {exc}") from None
        branch = self._workspace_branch(host, stack.ids)
        branch.since, branch.version = desc["since"], desc["version"]
        self.layers.join_workspace(stack, branch)
