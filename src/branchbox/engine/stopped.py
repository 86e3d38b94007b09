"""Sandboxes whose processes are gone but whose files are kept: ``stopped``, and ``start()``.

A sandbox's processes die with the host (a reboot), or are killed by a daemon
that could not re-attach to them after a restart (engine.reattach: a REPL that
did not answer). Its files need not go: every record says which
volumes its root is stacked from (``meta["stack"]``: writable volume, frozen
layers top first, disk limit, id slot; written whenever a body is bound to the
record). So a daemon that starts on the data directory keeps those volumes and
the family's id slot (the files are owned by its host id range), lists the
sandbox as ``stopped`` under the same id, and ``start_sandbox`` gives it a new
family and a fresh REPL on the same files: the stopped volume becomes a frozen
layer under a new writable one, as a fork child's does. Memory is lost, and
with it checkpoints (a checkpoint is memory). A workspace branch starts again
on the same host directory with its changes (they are in the volume, under
ws/), its commit base and its version, so first commit wins still holds.

What is not kept, closed at start-up with the reason in its record's meta
(``lost``): one whose volumes or id slot are missing, and one with a workspace
whose record predates the branch's description in ``meta["stack"]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from branchbox.agent.protocol import ChannelClosed
from branchbox.engine import errors
from branchbox.engine.layers import FrozenLayer, LayerStack
from branchbox.engine.records import SandboxRecord
from branchbox.runtime.channel import AgentError

log = logging.getLogger("branchbox.engine")

STOPPED = "stopped"
# Records in these states had processes an earlier daemon ran; their files can be kept.
_RUNNING_STATES = ("ready", "gone", "paused", STOPPED)


def describe(stack: LayerStack) -> dict:
    """What a record keeps of a body's root so a later daemon can stack it again (and,
    re-attaching to its processes, branch its workspace again: engine.reattach)."""
    desc = {"volume": stack.volume.name, "frozen": [layer.path.name for layer in stack.frozen],
            "disk_bytes": stack.disk_bytes, "slot": None if stack.ids is None else stack.ids.slot}
    if stack.workspace is not None:
        ws = stack.workspace
        desc["workspace"] = {"host": str(ws.lower.host), "since": ws.since,
                             "version": ws.version}
    return desc


def why_not_kept(rec: SandboxRecord) -> str | None:
    """Why an earlier daemon's sandbox cannot come back stopped, or None if it can."""
    if rec.state not in _RUNNING_STATES:
        return f"a {rec.state} sandbox holds memory only"
    if not isinstance(rec.meta.get("stack"), dict):
        return "its record does not say which volumes hold its files"
    if rec.meta.get("workspace") and "workspace" not in rec.meta["stack"]:
        return "its record does not describe its workspace branch"
    return None


@dataclass(eq=False)
class Stopped:
    record: SandboxRecord
    stack: LayerStack
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def id(self) -> str:
        return self.record.id


class StoppedSandboxes:
    """Mixed into Engine (uses its records, layers, id ranges and _spawn)."""

    def _mark_stopped(self, survivors: set[str]) -> None:
        """At start-up, once an earlier daemon's processes that were not re-attached to
        (``survivors``) are killed: every other sandbox whose files can be kept is
        ``stopped``; every other one is closed, with the reason."""
        lost = []
        for rec in self.records.live():
            if rec.id in survivors:
                continue
            reason = why_not_kept(rec)
            if reason is None:
                rec.state = STOPPED
            else:
                rec.meta = {**rec.meta, "lost": reason}
                lost.append(rec.id)
            self.records.put(rec)
        if lost:
            log.warning("closing %d sandboxes left by an earlier daemon (memory only, or "
                        "not kept: see their records' meta.lost)", len(lost))
            self.records.mark_closed(lost)

    def _kept_volumes(self) -> set[str]:
        """Names of the store's volumes that stopped and re-attached sandboxes stand on."""
        names: set[str] = set()
        for rec in self.records.live():
            stack = rec.meta["stack"]
            names.update([stack["volume"], *stack["frozen"]])
        return names

    def _stacks(self) -> dict[str, LayerStack]:
        """After the id slots are recovered: the layer stack of every sandbox an earlier
        daemon left, rebuilt from its record (frozen layers shared between sandboxes are
        one object, counted once per stack). Records whose volumes or slot are gone are
        closed."""
        frozen: dict[str, FrozenLayer] = {}
        slots: dict[int, object] = {}
        stacks: dict[str, LayerStack] = {}
        lost = []
        for rec in self.records.live():
            desc = rec.meta["stack"]
            names = [desc["volume"], *desc["frozen"]]
            ids = slots.get(desc["slot"])
            if ids is None and desc["slot"] is not None:
                ids = slots[desc["slot"]] = self.ids.adopt(desc["slot"], rec.family)
            if ids is None or not all((self.layers.root / n).is_dir() for n in names):
                rec.meta = {**rec.meta, "lost": "its volumes or its id slot are gone"}
                self.records.put(rec)
                lost.append(rec.id)
                continue
            layers = [frozen.setdefault(n, FrozenLayer(self.layers.root / n,
                                                       disk_bytes=desc["disk_bytes"]))
                      for n in desc["frozen"]]
            for layer in layers:
                layer.refs += 1
            ids.hold()
            stacks[rec.id] = LayerStack(self.layers.root / desc["volume"], layers, [],
                                        disk_bytes=desc["disk_bytes"], ids=ids)
        for ids in slots.values():
            ids.drop()  # adopt's own hold: the stacks hold the slot now
        if lost:
            self.records.mark_closed(lost)
        return stacks

    def _load_stopped(self, stacks: dict[str, LayerStack]) -> None:
        for rec in self.records.live():
            if rec.state == STOPPED and rec.id in stacks:
                self._stopped[rec.id] = Stopped(rec, stacks[rec.id])
        if self._stopped:
            log.warning("%d sandboxes of an earlier daemon are stopped (files kept; "
                        "start() gives each a fresh REPL)", len(self._stopped))

    def stopped_ids(self) -> list[str]:
        return list(self._stopped)

    def stopped_info(self, sandbox_id: str) -> dict | None:
        """A stopped sandbox's info (what ``info`` shows for it), or None."""
        st = self._stopped.get(sandbox_id)
        if st is None:
            return None
        rec = st.record
        return {"id": rec.id, "state": STOPPED, "parent_id": rec.parent_id, "children": [],
                "family": rec.family, "image": rec.image, "created": rec.created,
                "hostname": rec.id, "address": None, "network": rec.meta.get("network"),
                "layers": len(st.stack.frozen), "resources": {}}

    async def start_sandbox(self, sandbox_id: str) -> dict:
        """A stopped sandbox runs again: a new family and a fresh REPL on its files, same
        id (its address is a new one). A no-op for a running sandbox. Returns its info."""
        st = self._stopped.get(sandbox_id)
        if st is None:
            return await self.report(sandbox_id)  # running (or 404)
        async with st.lock:
            if self._stopped.get(sandbox_id) is not st:  # started or closed meanwhile
                return await self.report(sandbox_id)
            meta = st.record.meta
            branch = meta["stack"].get("workspace")
            host = None if branch is None else self._workspace_host(branch["host"])
            # The stopped volume is frozen as it is, under a new writable volume: the
            # failure of any later step leaves the stopped sandbox exactly as it was.
            top = await self._freeze(st.stack)
            try:
                sb = await self._spawn(st.record.image, {**meta, "cwd": "/", "disk_mb": None},
                                       None, host, sid=st.id, frozen=[top, *st.stack.frozen],
                                       ids=st.stack.ids)
            finally:
                if top.refs == 0:
                    self.layers.drop(top)
            if branch is not None:  # the same branch: first commit wins across the stop
                sb.body.layers.workspace.since = branch["since"]
                sb.body.layers.workspace.version = branch["version"]
            with contextlib.suppress(AgentError, ChannelClosed, OSError):  # cwd may be gone
                await sb.body.channel.call("configure", {"env": {}, "cwd": meta.get("cwd")})
            del self._stopped[sandbox_id]
            self.layers.release(st.stack)
            st.record.instance, st.record.state = sb.body.key, "ready"
            sb.record = st.record
            self.net.apply([sb.body.key], meta.get("network") or self.net.policy_of(None, None))
            self._adopt(sb, meta.get("timeout"))
            self.events.publish("start", sb.record, image=sb.record.image)
        return await self.report(sandbox_id)

    async def _close_stopped(self, sandbox_id: str) -> bool:
        """Close a stopped sandbox (its files go); False if it is not a stopped one."""
        st = self._stopped.get(sandbox_id)
        if st is None:
            return False
        async with st.lock:
            if self._stopped.pop(sandbox_id, None) is None:
                raise errors.SandboxNotFound()
            self.records.mark_closed([sandbox_id])
            self.layers.release(st.stack)
        return True

    async def _leave_running(self) -> None:
        """A daemon's stop with --keep: every sandbox keeps running, for the next daemon
        to re-attach to (engine.reattach); this one only lets go of its ends."""
        for sandbox_id in list(self.live):
            sb = self.live.pop(sandbox_id)
            if sb.timer:
                sb.timer.cancel()
            await sb.body.channel.close()  # the keeper holds a copy: the REPL sees no EOF
        for cp in self._checkpoints.values():
            await cp.body.channel.close()

    def _release_stopped(self) -> None:
        """A daemon's stop without --keep: stopped sandboxes end with the rest."""
        for sandbox_id in list(self._stopped):
            st = self._stopped.pop(sandbox_id)
            self.records.mark_closed([sandbox_id])
            self.layers.release(st.stack)

