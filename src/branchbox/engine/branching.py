"""fork, merge_into and diff: branching a live sandbox and choosing among branches.

fork follows DESIGN.md's "How fork works", pipelined: the REPL forks child k as
soon as its slot arrives, so child k sets itself up while the daemon prepares
child k+1. merge_into re-binds the parent's record to the winner's body; diff
reads the two sandboxes' overlay layers directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import posixpath
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from branchbox.agent.protocol import ChannelClosed
from branchbox.engine import answers, errors, lineage
from branchbox.engine.layers import (
    FrozenLayer,
    LayerStack,
)
from branchbox.engine.live import Body, Live
from branchbox.engine.node import new_id
from branchbox.engine.records import SandboxRecord
from branchbox.engine.run_guard import OWN_REQUEST_WAIT
from branchbox.engine.stopped import describe
from branchbox.runtime import procfs
from branchbox.runtime.cgroups import FreezeFailed, SandboxCgroup
from branchbox.runtime.channel import AgentChannel, AgentError
from branchbox.runtime.dormant import Dormant
from branchbox.runtime.fd_keeper import SIGNAL_LISTENER
from branchbox.storage import layerdiff

log = logging.getLogger("branchbox.engine")

# Frozen layers a root may stack before a fork squashes them into one.
MAX_CHAIN = 16
# Crash tests (tests/test_daemon_killed.py): the daemon SIGKILLs itself at the worst
# moment, what a kill -9 there does: "frozen", right after a fork froze the parent's
# commands; "adopted", once a fork's children are recorded; "merged", once a merge has
# recorded the parent's new body, before the winner's id is closed.
FORK_FAULT_ENV = "BRANCHBOX_FORK_FAULT"
DEFAULT_DIFF_PATHS = ("/root", "/tmp")
# Seconds a failed fork gives the REPL to leave its fork batch (it may be the reason),
# and a child gone before its root to say why.
_LEAVE_BATCH = 5.0
# What an agent's failure to fork a child keeps of its type (the rest is the engine's).
_FORK_FAILURES = ("Conflict", "ResourceLimit", "NoSpace")


class Branching:
    """Mixed into Engine (uses its live sandboxes, layers, locks and lineage)."""

    def _check_n(self, n: object) -> None:
        """400 unless ``n`` children is a count one fork may make (forks of a sandbox and
        of a checkpoint alike)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.config.max_fork:
            raise errors.InvalidRequest(f"n must be between 1 and {self.config.max_fork}")

    async def fork(self, sandbox_id: str, n: int) -> list[Live]:
        self._check_n(n)
        parent = self.get(sandbox_id)
        await self._acquire(parent, self.config.busy_wait)
        try:
            channel = self._check_alive(parent)
            return await self._fork_locked(parent, channel, n)
        except FreezeFailed as exc:  # no frozen instant to fork from: nothing was made
            raise errors.Conflict(f"fork failed: {exc}") from None
        finally:
            self._unlock(parent)  # once the REPL is done with the requests given up on

    async def _fork_locked(self, parent: Live, channel: AgentChannel, n: int) -> list[Live]:
        """``n`` children of ``parent`` (locked, alive), adopted as its fork children.

        A family over its disk limits may still fork, over one layer that holds only
        what the children see (its chain squashed), if that fits the parent's disk
        limit: files deleted or rewritten after earlier forks stay in the layers those
        forks froze, charged to the family until they go, and a fork→merge loop that
        rewrites a file each round got there for good. What the children would see
        past the limit is still refused (that is how a family grows)."""
        try:
            await self._check_room(parent, "fork", n, settle=False)
            within = None
        except errors.FamilyOverLimit as over:
            if over.resource != "disk" or parent.body.layers.disk_bytes is None:
                raise
            within = _Within(parent.body.layers.disk_bytes, over)
        made = await self._fork_bodies(parent.body, channel, parent, n, timings=parent,
                                       within=within)
        children = self._adopt_children(parent, made, parent.generation)
        self.events.publish("fork", parent.record, children=[c.id for c in children],
                            took=parent.last_fork["total"])
        return children

    async def _fork_bodies(self, pbody: Body, channel: AgentChannel, owner: Live, n: int,
                           *, timings: Live | None = None,
                           within: _Within | None = None) -> list[tuple[str, Body]]:
        """``n`` new bodies forked from ``pbody`` (whose REPL is ``channel``), each with a
        fresh id and its network under ``owner``'s policy; not adopted. The body's
        commands are frozen for the fork and thawed after it. ``timings`` gets the fork's
        timings as its ``last_fork``; ``within``: the children's lowers squashed into one
        layer, which must fit it."""
        clock = _Phases()
        return await self._within_deadline(self._fork_from_instant(
            pbody, channel, owner, n, clock, timings, within))

    async def _fork_from_instant(self, pbody: Body, channel: AgentChannel, owner: Live,
                                 n: int, clock: _Phases, timings: Live | None,
                                 within: _Within | None) -> list[tuple[str, Body]]:
        async with self._instant(pbody, channel, clock, within) as (lowers, inherit):
            slots = _ReplSlots(channel, inherit, pbody.repl_host)
            return await self._make_bodies(slots, lowers, pbody.layers, owner, n, clock=clock,
                                           timings=timings)

    async def _wake_bodies(self, checkpoint: Body, owner: Live, n: int,
                           hostname: str | None = None) -> list[tuple[str, Body]]:
        """``n`` new bodies forked from a checkpoint's process (its body's channel), over
        its frozen layers, under ``owner``'s network policy; not adopted. A body that
        will serve an existing id (a restore: ``owner``'s) is named ``hostname`` at once,
        and takes its address inside while it sets up (``SandboxNetwork.address_ahead``)."""
        stack = checkpoint.layers
        slots = _WakeSlots(checkpoint.channel)
        lowers = asyncio.get_running_loop().create_future()
        lowers.set_result(list(stack.frozen))
        return await self._within_deadline(self._make_bodies(
            slots, lowers, stack, owner, n, hostname=hostname))

    async def _within_deadline(self, making):
        """Await ``making`` (bodies being made) within the daemon's fork deadline: a
        sandbox is locked meanwhile (and its commands frozen, when its REPL is forked),
        whichever call (fork, checkpoint, a fork of a checkpoint, restore) makes them."""
        deadline = self.config.fork_deadline
        try:
            async with asyncio.timeout(deadline):
                return await making
        except TimeoutError:
            raise errors.SandboxTimeout(
                f"a fork did not finish within {deadline:g} s (the process forked did not "
                "answer); nothing was made") from None

    @contextlib.asynccontextmanager
    async def _instant(self, pbody: Body, channel: AgentChannel, clock: _Phases | None = None,
                       within: _Within | None = None
                       ) -> AsyncIterator[tuple[asyncio.Future, dict]]:
        """One instant of ``pbody`` to fork from: its commands frozen (until the block
        ends), its layer frozen into a new lower layer (squashed with the others when
        the chain is too long) while what its REPL holds is read from the host's /proc
        (fds, shared memory, threads: ``_inherit``). Yields (lowers, inherit), ``lowers``
        a future: on btrfs, whose snapshot is one atomic instant whatever runs, a caller
        may fork the REPL while the layer is being frozen (the REPL runs nothing else and
        the commands are frozen: it is the same instant). A fresh layer no body took is
        dropped after."""
        clock = clock or _Phases()
        # What the REPL holds is read while its commands freeze: they cannot change it.
        reading = None if pbody.repl_host is None else _reading(pbody.repl_host)
        pbody.cgroup.freeze("cmds")
        if os.environ.get(FORK_FAULT_ENV) == "frozen":
            os.kill(os.getpid(), signal.SIGKILL)
        fresh: list[FrozenLayer] = []
        lowers = asyncio.ensure_future(self._frozen_lowers(pbody, fresh, within))
        try:
            if self.layers.backend.name != "btrfs":  # a copy freezes the whole sandbox
                await asyncio.shield(lowers)
            if reading is None:  # a body keeps its REPL: look it up once
                repl = await channel.call("ping")
                pbody.repl_host = procfs.find_repl(pbody.cgroup.leaf_pids("repl"),
                                                   answers.pid_in(repl, "a ping"))
                reading = _reading(pbody.repl_host)
            inherit = await reading
            clock.mark("instant")  # commands frozen, what the REPL holds read from /proc
            yield lowers, inherit
        finally:
            interrupted = await _settled(lowers)  # a layer made meanwhile is in ``fresh``
            try:
                for layer in fresh:
                    if layer.refs == 0:  # unused: squashed away, or nothing was made
                        self.layers.drop(layer)
            finally:
                pbody.cgroup.freeze("cmds", frozen=False)
            if interrupted:
                raise asyncio.CancelledError

    async def _frozen_lowers(self, pbody: Body, fresh: list[FrozenLayer],
                             within: _Within | None = None) -> list[FrozenLayer]:
        """``pbody``'s lower layers for its children: its layer frozen now on top of its
        frozen ones, squashed into one past MAX_CHAIN (or with ``within``, which what
        the one layer holds must fit); each new layer goes in ``fresh``."""
        fresh.append(await self._freeze(pbody.layers, pbody.cgroup))
        lowers = [fresh[0], *pbody.layers.frozen]
        family = pbody.layers.ids.family
        if len(lowers) > MAX_CHAIN or (within is not None and len(lowers) > 1):
            fresh.append(await self.content.run(family, self.layers.squash, lowers))
            lowers = [fresh[-1]]
        if within is not None:
            seen = await self.content.run(family, self.layer_bytes, lowers[0].lowerdir)
            if seen > within.disk_bytes:
                raise errors.FamilyOverLimit(
                    f"{within.over}; what its children would see is {seen >> 20:,} MiB, more "
                    f"than the parent's {within.disk_bytes >> 20:,} MiB", "disk")
        return lowers

    async def _make_bodies(self, slots: _ReplSlots | _WakeSlots,
                           lowers: asyncio.Future[list[FrozenLayer]], stack: LayerStack,
                           owner: Live, n: int, *, clock: _Phases | None = None,
                           timings: Live | None = None,
                           hostname: str | None = None) -> list[tuple[str, Body]]:
        """``n`` new bodies over ``lowers`` (and ``stack``'s base and workspace), forked by
        ``slots`` (a REPL, or a checkpoint woken), each with a fresh id and its network
        under ``owner``'s policy: a namespace its family made ahead, or one plugged after
        the child's hello; not adopted.

        Pipelined: child k is forked as soon as its slot arrives, so it sets itself up
        while the daemon prepares child k+1; and the slots go before ``lowers`` (a fork's
        parent layer being frozen) are ready: each child joins its cgroup and namespaces
        meanwhile, then gets its root, a tree over them. All children still come from
        one instant: the forking process runs nothing else between the slots, and they
        share one set of frozen layers."""
        if hostname is not None and n != 1:
            raise ValueError("one hostname names one body")
        clock = clock or _Phases()
        meta = owner.record.meta
        family = owner.family.family if owner.family.family.netns_maker else None
        made: list[tuple[str, Body]] = []
        forked_children: list[_Forked] = []  # slots sent, roots not yet
        pending: list = []  # each slot's answer, then each child's hello
        net_steps: list[dict] = []  # per child: its network's steps (ns), networking.attach
        checks: list = []  # the hellos' wrappers: closed too if they never ran
        running: list[asyncio.Future] = []  # pending, once gathered
        ending: asyncio.Future | None = None  # the forking process's answer to their end
        limits = self._limits(meta.get("memory_mb"))
        try:
            forker = slots.forker()
            for _ in range(n):
                slots.start()  # a checkpoint's copy forks while its body is made
                child = _Forked(new_id(self.node), self.ready_cgroups.take(limits))
                forked_children.append(child)
                took = time.perf_counter_ns()
                netns = self.net.take_made(child.key, family.ident) if family else None
                took = time.perf_counter_ns() - took
                if hostname is not None and netns is not None:  # it will take owner's id
                    self.net.address_ahead(child.key, netns, owner.body.key)
                await self._send_slot(slots, hostname or child.sid, child, netns)
                if netns is not None:
                    net_steps.append({"take": took})
            if os.environ.get(FORK_FAULT_ENV) == "slots":  # the REPL's batch left open
                os.kill(os.getpid(), signal.SIGKILL)
            ending = asyncio.ensure_future(slots.end())  # the forks' end, answered meanwhile
            clock.mark("slots")  # children's cgroups made and slots sent: they are forking
            frozen = await asyncio.shield(lowers)  # a cancellation waits for it in _instant
            clock.mark("layer")  # the rest of the parent's layer snapshot
            for child in forked_children:
                body = self._child_body(child, frozen, stack)
                made.append((child.sid, body))
                try:
                    entered = await self._send_root(body, child.netns)
                except OSError:  # never forked, or gone: the forker's answer or the
                    with contextlib.suppress(TimeoutError):  # child's hello says why
                        await asyncio.wait_for(child.answer, _LEAVE_BATCH)
                        await asyncio.wait_for(child.hello, _LEAVE_BATCH)
                    raise errors.EngineError(
                        "fork failed: a child did not enter its sandbox") from None
                checked = _checked(child.hello, body, entered, forker)
                checks.append(checked)
                pending += [child.answer, checked if child.netns is not None
                            else self._networked(checked, body, net_steps)]
            forked = await ending
            clock.mark("roots")  # children's volumes made, roots sent, the batch over
            running = [asyncio.ensure_future(p) for p in pending]
            try:
                answers = await asyncio.wait_for(asyncio.gather(*running),
                                                 self.config.spawn_timeout)
            except TimeoutError:
                raise errors.EngineError("fork failed: the children did not report within "
                                         f"{self.config.spawn_timeout:.0f} s") from None
            clock.mark("children")  # the children entering their sandboxes, hellos, networks
            for (_, body), hello in zip(made, answers[1::2], strict=True):
                if hello.get("signal_listener") is not None:
                    await self._take_signal_listener(body, hello)
            policy_ns = time.perf_counter_ns()
            self.net.apply([body.key for _, body in made], meta.get("network")
                           or self.net.policy_of(None, None))
            policy_ns = time.perf_counter_ns() - policy_ns
            clock.mark("finish")  # signal listeners taken, egress policy applied
            if timings is not None:
                steps = {"policy": policy_ns}
                for child_steps in net_steps:
                    for step, ns in child_steps.items():
                        steps[step] = steps.get(step, 0) + ns
                timings.last_fork = {"n": n, "repl_paused": forked.get("paused"),
                                     "total": time.perf_counter() - clock.started,
                                     "network": sum(steps.values()) / 1e9,
                                     "network_steps": {k: v / 1e9 for k, v in steps.items()},
                                     "phases": clock.phases}
        except BaseException as exc:
            # The other children's hellos still run when one failed: stopped before their
            # channels close (or their readers fail unobserved); what never ran is closed.
            running += [ending] if ending is not None else []
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            for coro in [*pending, *checks,
                         *(c for child in forked_children for c in (child.answer, child.hello))]:
                if asyncio.iscoroutine(coro) and \
                        inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
                    coro.close()
            await slots.abandon()
            undo = [functools.partial(self._destroy_body, body) for _, body in made]
            undo += [functools.partial(self._drop_rootless, child)  # never given a root
                     for child in forked_children[len(made):]]
            for step in undo:  # each, whatever happened to the others
                try:
                    await step()
                except Exception as problem:  # noqa: BLE001 - logged, the rest undone
                    log.warning("a failed fork's child could not be undone: %s", problem)
            if isinstance(exc, AgentError):  # a Conflict: the parent changed what a child
                # needs; ResourceLimit, NoSpace: the forker could not fork (EAGAIN, ENOSPC)
                failed = errors.AGENT_ERRORS[exc.kind] if exc.kind in _FORK_FAILURES \
                    else errors.EngineError
                raise failed(f"fork failed: {exc.message}") from None
            if isinstance(exc, ChannelClosed):
                raise errors.EngineError(
                    "fork failed: a child died while entering its sandbox"
                ) from None
            raise
        self.net.refill_soon()  # leases for the next fork, after this one's answer
        self.ready_cgroups.want(limits, n)  # and cgroups
        self.layers.want_blank(frozen, n)  # and volumes
        if family is not None:  # and namespaces for the family's next one
            self.net.forked(family, n)
        return made

    def _adopt_children(self, parent: Live, made: list[tuple[str, Body]],
                        generation: int) -> list[Live]:
        """Fork bodies as live children of ``parent``, forked from its ``generation`` (a
        merge back into it is stale once that is not its generation any more)."""
        children = []
        for sid, body in made:
            record = SandboxRecord(
                id=sid,
                family=parent.record.family,
                instance=body.key,
                image=parent.record.image,
                parent_id=parent.id,
                meta=dict(parent.record.meta),
            )
            child = Live(record, body, parent.family, forked_at=generation)
            self._lineage[sid] = (parent.id, generation)
            parent.family.members.add(sid)
            children.append(child)
        self._adopt_children_of(parent, children)
        return children

    def _adopt_children_of(self, parent: Live, children: list[Live]) -> None:
        """Children live by their parent's policy: closed when the parent's timeout runs
        out (the same instant, not a fresh period) and after the parent's idle timeout
        without use, so a family whose client is gone is reclaimed. Recorded together: a
        daemon killed meanwhile leaves all of them or none (engine.reattach)."""
        loop = asyncio.get_running_loop()
        left = None if parent.timer is None else max(parent.timer.when() - loop.time(), 1e-3)
        self._adopt(children, left)
        if os.environ.get(FORK_FAULT_ENV) == "adopted":
            os.kill(os.getpid(), signal.SIGKILL)
        lineage.prune_if_grown(self._lineage, self.live, len(self.live))  # children live now
        if idle := parent.record.meta.get("idle_timeout"):
            for child in children:
                self._close_when_idle(child, idle)

    async def _networked(self, hello, body: Body, steps: list[dict]) -> dict:
        """The child's hello (checked), then at once its network (while the REPL forks the
        next child): a veth created into its namespace, its address and route."""
        result = await hello
        reply = await self.net.attach(body.key, body.cgroup, body.repl_host)
        steps.append(reply["steps"])
        return result

    def _child_body(self, child: _Forked, lowers: list[FrozenLayer],
                    parent: LayerStack) -> Body:
        """A forked child's body: its writable volume over ``lowers`` (made ahead if one is
        ready) and the cgroup and control channel its slot went with."""
        stack = self.layers.new_stack(lowers, parent.base, parent.workspace, ids=parent.ids)
        return Body(child.key, stack, child.cgroup, child.channel)

    async def _drop_rootless(self, child: _Forked) -> None:
        """Undo a child forked but never given its root: its network, its cgroup (which
        kills it, if it joined), its channel (it waits there for its root: end of file
        ends it)."""
        if child.channel is not None:  # first: whatever fails next, the child ends
            await child.channel.close()
        try:
            await self.net.release(child.key)
        finally:
            await asyncio.to_thread(child.cgroup.remove)

    async def _take_signal_listener(self, body: Body, hello: dict) -> None:
        """A child past Landlock's depth added a signal filter (see runtime.signal_guard):
        take its listener out of the child, then have the child let go of its copy, all
        before the child runs any user code."""
        fd = hello.get("signal_listener")
        if type(fd) is not int or not 0 <= fd < 1 << 20:
            raise errors.MalformedAnswer(f"a fork child's hello named {fd!r} as its signal "
                                         "listener, not a file descriptor")
        listener = await asyncio.to_thread(self.signal_guard.take, body.repl_host, fd)
        # Kept for a daemon that re-attaches after a restart (the keeper lets go of it once
        # no process is under its filter): without a listener the calls would fail.
        self.keeper.keep([(SIGNAL_LISTENER + body.key, listener)])
        self.signal_guard.serve(listener, SIGNAL_LISTENER + body.key)
        await body.channel.call("drop_listener")

    async def _send_slot(self, slots: _ReplSlots | _WakeSlots, hostname: str,
                         child: _Forked, netns: int | None) -> None:
        """Hand the forking process a child's hostname (its id), control socket, network
        namespace to join (made ahead; consumed) if any and cgroup fds; it forks the
        child on receipt. Sets the child's channel, the fork's answer and the child's
        hello (request 0 on its own channel: ready, or why its set-up failed)."""
        fds = [] if netns is None else [netns]  # all closed here, whatever happens
        theirs = None
        try:
            ours, theirs = slots.control()
            child.channel = AgentChannel(ours)
            child.hello = _result(child.channel.events(0, child.channel.expect(0)))
            if netns is not None:
                child.netns = os.fstat(netns).st_ino
            repl_fds = child.cgroup.join_fds("repl")
            fds += repl_fds
            cmds_fds = child.cgroup.join_fds("cmds")
            fds += cmds_fds
            slot = {"id": hostname, "nrepl": len(repl_fds), "ncmds": len(cmds_fds),
                    "netns": netns is not None}
            child.answer = await slots.send(slot, fds if theirs is None
                                            else [theirs.fileno(), *fds], child.channel)
        finally:
            if theirs is not None:
                theirs.close()
            for fd in fds:
                os.close(fd)

    @staticmethod
    async def _send_root(body: Body, netns: int | None) -> _Entered:
        """Send a forked child its root: the tree of its layers, and further trees to
        attach inside it (a workspace at its host path). Returns what the child must
        have entered once it says hello."""
        mounts = body.layers.mounts()
        fds = [fd for fd, _ in mounts]
        try:
            fds.insert(0, body.layers.tree())
            root = os.fstat(fds[0])
            await body.channel.send({"op": "root", "mounts": [path for _, path in mounts]},
                                    fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
        return _Entered((root.st_dev, root.st_ino), netns)

    def _fork_point(self, parent: Live, winner: Live) -> int:
        """The parent generation ``winner``'s line was forked at; raises if not a descendant."""
        node = winner.id
        while node in self._lineage:
            up, generation = self._lineage[node]
            if up == parent.id:
                return generation
            node = up
        raise errors.InvalidRequest(f"{winner.id} is not a descendant of {parent.id}")

    async def merge_into(self, sandbox_id: str, winner_id: str) -> None:
        """The parent's id takes over the winner's processes and files; the winner's id ends."""
        parent, winner = self.get(sandbox_id), self.get(winner_id)
        if parent is winner:
            raise errors.InvalidRequest("cannot merge a sandbox into itself")
        if self._fork_point(parent, winner) != parent.generation:
            raise errors.StaleBranch(
                f"{winner_id} is stale: {sandbox_id} changed by another merge after it was "
                "forked (first merge wins)")
        await self._acquire(parent, self.config.busy_wait)
        try:
            await self._acquire(winner, self.config.busy_wait)
        except BaseException:
            parent.lock.release()
            raise
        try:
            # Re-check under the locks: another merge or a close may have won meanwhile.
            if self.live.get(sandbox_id) is not parent or self.live.get(winner_id) is not winner:
                raise errors.SandboxNotFound()
            if self._fork_point(parent, winner) != parent.generation:
                raise errors.StaleBranch(
                    f"{winner_id} is stale: {sandbox_id} changed by another merge after it "
                    "was forked (first merge wins)")
            self._check_alive(winner)
            old = self._rebind(parent, winner.body)
            # Recorded before the winner's id is closed: a kill between the two leaves the
            # merge done (engine.reattach gives the body to the newer generation).
            self._record_rebind(parent)
            if os.environ.get(FORK_FAULT_ENV) == "merged":
                os.kill(os.getpid(), signal.SIGKILL)
            self.live.pop(winner.id)
            if winner.timer:
                winner.timer.cancel()
            for sid, (up, generation) in list(self._lineage.items()):
                if up == winner.id:  # the winner's children are now the parent's
                    fresh = generation == winner.generation
                    self._lineage[sid] = (parent.id, parent.generation if fresh else -1)
                    self.records.set_lineage(sid, *self._lineage[sid])
                    if sid in self.live:
                        self.live[sid].record.parent_id = parent.id
                        self.live[sid].record.meta["forked_at"] = self._lineage[sid][1]
            winner.family.members.discard(winner.id)
            self.records.mark_closed([winner.id])
            self._retire_checkpoints(winner.id)  # its id ends, and its instants with it
            self.events.publish("merge", parent.record, winner=winner_id)
            await self._take_over(parent, old)
        finally:
            winner.lock.release()
            parent.lock.release()

    def _rebind(self, sb: Live, body: Body) -> Body:
        """``sb``'s id is now served by ``body`` (merge's winner, restore's copy of a
        checkpoint), in a new generation: branches forked before are stale. Returns the
        old body for :meth:`_take_over`. No await, so callers rewrite lineage at once."""
        old, sb.body = sb.body, body
        sb.generation = next(self._generations)
        sb.record.instance = body.key
        sb.record.state = "ready"
        return old

    def _record_rebind(self, sb: Live) -> None:
        """Record that ``sb``'s id is served by its new body (layers, generation)."""
        sb.record.meta = {**sb.record.meta, "stack": describe(sb.body.layers),
                          "gen": sb.generation}
        self.records.put(sb.record)
        self._keep_channels([sb.body])

    async def _take_over(self, sb: Live, old: Body, *, named: bool = False) -> None:
        """Finish a rebind (recorded already): watch the new body, name it (unless it is
        ``named`` already), give it the id's address; the old body is killed and freed in
        the background (the caller returns now)."""
        self._watch_body(sb)
        if not named:
            with contextlib.suppress(errors.EngineError, AgentError, ChannelClosed,
                                     TimeoutError):
                await asyncio.wait_for(sb.body.channel.call("sethostname", {"hostname": sb.id}),
                                       OWN_REQUEST_WAIT)
        await self.net.hand_over(sb.body.key, old.key, sb.body.cgroup, sb.body.repl_host)
        self._retire(old, sb.family)

    # ---------------------------------------------------------------------- diff
    async def diff(self, sandbox_id: str, other_id: str,
                   paths: list[str] | None = None) -> dict[str, list[str]]:
        """Files added in ``other``, removed from it, and modified, read from the layers:
        under ``paths`` (default: /root, /tmp and, when both branch one workspace, its
        directory, diffed through the workspace's own layers over the host directory).

        Bounded (see storage.layerdiff): run on the diff executor, never the default one
        that close and fork use; a file not proven equal within the diff's byte and time
        budget is reported modified and listed under "unverified"; a tree too large to
        even list in time is a SandboxTimeout; a cancelled request stops the diff."""
        mine, other = self.get(sandbox_id), self.get(other_id)
        workspace = _shared_workspace(mine.body.layers, other.body.layers)
        paths = list(paths or (*DEFAULT_DIFF_PATHS, *([str(workspace)] if workspace else [])))
        for path in paths:
            if not isinstance(path, str) or not path.startswith("/") or "\0" in path \
                    or ".." in path.split("/"):
                raise errors.InvalidRequest(f"diff paths must be absolute without '..': {path!r}")
        in_root, in_workspace = _split_paths(paths, workspace)
        diffs = []
        budget = layerdiff.Budget()  # one for both parts
        try:
            if in_root:
                diffs.append(("", await layerdiff.diff_bounded(
                    mine.body.layers.layer_dirs(), other.body.layers.layer_dirs(), in_root,
                    budget)))
            if in_workspace:
                diffs.append((str(workspace), await layerdiff.diff_bounded(
                    [*mine.body.layers.workspace_dirs(), workspace],
                    [*other.body.layers.workspace_dirs(), workspace], in_workspace, budget)))
        except FileNotFoundError:  # a layer went away under the walk
            raise errors.Conflict("a sandbox was closed or merged while the diff was read; "
                                  "diff live sandboxes") from None
        except layerdiff.DiffTooLarge as exc:
            raise errors.SandboxTimeout(f"diff failed: {exc}; pass narrower paths") from None
        except layerdiff.DiffBusy as exc:
            raise errors.Conflict(f"diff refused: {exc}") from None
        merged: dict[str, list[str]] = {"added": [], "removed": [], "modified": []}
        for mount, found in diffs:
            for key, listed in found.items():
                merged.setdefault(key, []).extend(mount + path for path in listed)
        return {key: sorted(listed) for key, listed in merged.items()}


def _shared_workspace(mine: LayerStack, other: LayerStack) -> Path | None:
    """The host directory both sandboxes branch as their workspace, if they do."""
    if mine.workspace is None or other.workspace is None:
        return None
    host = mine.workspace.lower.host
    return host if host == other.workspace.lower.host else None


def _split_paths(paths: list[str], workspace: Path | None) -> tuple[list[str], list[str]]:
    """``paths`` to diff in the root's layers, and those (relative to the workspace's
    directory) to diff in the workspace's: a path above the directory is in both."""
    if workspace is None:
        return paths, []
    mount = posixpath.normpath(str(workspace))
    in_root: dict[str, None] = {}  # ordered sets
    in_workspace: dict[str, None] = {}
    for path in map(posixpath.normpath, paths):
        path = "/" + path.lstrip("/")  # normpath keeps a leading "//"
        if path == mount or path.startswith(mount + "/"):
            in_workspace[path[len(mount):] or "/"] = None
            continue
        in_root[path] = None
        if path == "/" or mount.startswith(path + "/"):
            in_workspace["/"] = None
    return list(in_root), list(in_workspace)


@dataclass(frozen=True)
class _Within:
    """A fork of a family over its disk limits: its children's one lower layer must hold
    at most ``disk_bytes``; ``over`` is the check's refusal."""

    disk_bytes: int
    over: errors.FamilyOverLimit


class _Forked:
    """A fork child between its slot and its body: its id, cgroup and channel, the
    inode of the network namespace made ahead for it (if any), the slot's answer (an
    awaitable) and its hello."""

    def __init__(self, sid: str, cgroup: SandboxCgroup) -> None:
        self.sid, self.cgroup = sid, cgroup
        self.channel: AgentChannel | None = None
        self.netns: int | None = None
        self.answer = self.hello = None

    @property
    def key(self) -> str:
        """Its body's key: its cgroup's name."""
        return self.cgroup.name


class _Entered:
    """What a fork child was handed, to find it in once it says hello: the root of its
    tree (device, inode) and the network namespace made ahead for it (inode), if any."""

    def __init__(self, root: tuple[int, int], netns: int | None) -> None:
        self.root, self.netns = root, netns


async def _checked(hello, body: Body, entered: _Entered, forker: dict[str, int]) -> dict:
    """The child's hello, once the child is found in its sandbox from outside, through the
    host's /proc: its REPL is in its cgroup, its root is the tree it was handed, its
    network namespace the one made for it (or one of its own, not its forker's), and its
    mount, IPC and UTS namespaces are not its forker's. The agent that makes a child
    runs in the same process as the parent's code, which can change it: a child that did
    not enter its sandbox is refused here, before anything (its network first) is made
    for it."""
    result = await hello
    host = procfs.find_repl(body.cgroup.leaf_pids("repl"),
                            answers.pid_in(result, "a fork child's hello"))
    refused = errors.EngineError("fork failed: a child did not enter its sandbox")
    if host is None:
        raise refused
    body.repl_host = host
    try:
        own = procfs.namespaces(host)
        root = procfs.root_of(host)
    except OSError:
        raise refused from None
    net_ok = own["net"] == entered.netns if entered.netns is not None \
        else own["net"] != forker["net"]
    if root != entered.root or not net_ok or \
            any(own[kind] == forker[kind] for kind in ("mnt", "ipc", "uts")):
        raise refused
    return result


class _Phases:
    """Where a fork's time went, phase by phase, in order (seconds)."""

    def __init__(self) -> None:
        self.started = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._last
        self._last = now


class _ReplSlots:
    """Fork slots sent to a REPL, which forks a child per slot (``agent.forking``); the
    first carries what the REPL holds (``inherit``), "fork" ends the batch."""

    def __init__(self, channel: AgentChannel, inherit: dict, repl_host: int) -> None:
        self.channel = channel
        self.inherit: dict | None = inherit
        self.repl_host = repl_host
        self.open = False

    def start(self) -> None:
        """The REPL forks each child on its slot: nothing to do ahead."""

    @staticmethod
    def control() -> tuple[socket.socket, socket.socket]:
        """A child's control socket: ours, and theirs for its slot."""
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    async def send(self, slot: dict, fds: list[int], channel: AgentChannel):
        self.open = True  # from here on the REPL may be in a batch, even if the send fails
        rid, queue = self.channel.open_request()
        header = {"op": "fork_slot", "rid": rid, **slot}
        if self.inherit is not None:
            header["inherit"], self.inherit = self.inherit, None
        await self.channel.send(header, fds=fds)
        return _drain(self.channel.events(rid, queue))

    async def end(self) -> dict:
        self.open = False
        return await self.channel.call("fork")

    def forker(self) -> dict[str, int]:
        """The namespaces of the REPL that forks (its children must have their own)."""
        try:
            return procfs.namespaces(self.repl_host)
        except OSError:
            raise errors.ReplGone("fork failed: the sandbox's REPL is gone") from None

    async def abandon(self) -> None:
        """Let the REPL leave its fork batch after a failure (if it answers at all)."""
        if self.open:
            with contextlib.suppress(AgentError, ChannelClosed, OSError, TimeoutError):
                await asyncio.wait_for(self.channel.call("fork"), _LEAVE_BATCH)


class _WakeSlots:
    """Fork slots sent to a checkpoint's process, which forks a child per slot
    (``runtime.dormant``); nothing opens or ends a batch there."""

    def __init__(self, dormant: Dormant) -> None:
        self.dormant = dormant
        self._woken: tuple[socket.socket, Any] | None = None  # (our end, the answer)

    def start(self) -> None:
        """Wake the checkpoint now, with only the child's control socket: its copy forks
        and comes back into Python (the page tables copied, the interpreter's after-fork
        hooks: ~1.5 ms) while the daemon makes the child's body, then waits on that
        socket for the rest of its slot (``agent.checkpointing``)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._woken = (ours, self.dormant.wake({"early": True}, [theirs.fileno()]))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()

    def control(self) -> tuple[socket.socket, None]:
        """The woken copy's control socket: ours (it has its own end already)."""
        assert self._woken is not None
        return self._woken[0], None

    async def send(self, slot: dict, fds: list[int], channel: AgentChannel):
        """The rest of the woken copy's slot, on its control socket; returns the wake's
        answer (its pid)."""
        assert self._woken is not None
        answer, self._woken = self._woken[1], None
        try:
            await channel.send(slot, fds=fds)
        except BaseException:
            answer.close()
            raise
        return answer

    async def end(self) -> dict:
        return {}

    def forker(self) -> dict[str, int]:
        """The namespaces of the checkpoint's process (its copies must have their own)."""
        try:
            return procfs.namespaces(self.dormant.host_pid)
        except OSError:
            self.dormant.lose()
            raise ChannelClosed("the checkpoint's process is gone") from None

    async def abandon(self) -> None:
        """A wake whose slot was never sent: closing our end ends the woken copy (it
        reads end of file where its slot should be)."""
        if self._woken is not None:
            ours, answer = self._woken
            self._woken = None
            answer.close()
            ours.close()


def _reading(repl_host: int) -> asyncio.Future:
    """``_inherit`` of the REPL, started in a thread now (not at the loop's next turn);
    nobody waits for it after a failure (it only reads), so its error is taken here."""
    reading = asyncio.get_running_loop().run_in_executor(None, _inherit, repl_host)
    reading.add_done_callback(lambda done: done.cancelled() or done.exception())
    return reading


async def _settled(task: asyncio.Future) -> bool:
    """Wait until ``task`` has ended, through cancellations (a thread it waits for runs
    on regardless); returns whether one came, for the caller to raise once it has
    cleaned up. Its exception is seen here: whoever needed it got it by awaiting it."""
    interrupted = False
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            interrupted = True
    if not task.cancelled():
        task.exception()
    return interrupted


async def _drain(events: AsyncIterator) -> None:
    async for _ in events:
        pass


async def _result(events: AsyncIterator) -> dict:
    """The result of a request's ``done`` (a fork child's hello)."""
    result: dict = {}
    async for header, _ in events:
        if header.get("ev") == "done":
            result = header.get("result") or {}
    return result


def _inherit(repl_host: int | None) -> dict:
    """What the REPL holds, for its fork children (runtime.procfs); a typed error when it
    cannot be read, since a child told nothing would keep the parent's files and memory."""
    try:
        if repl_host is not None:
            return procfs.describe(repl_host)
    except procfs.TooManyShared as exc:
        raise errors.Conflict(f"fork refused: {exc}") from None
    except OSError:
        pass
    raise errors.ReplGone("fork failed: the sandbox's REPL is gone")
