"""The engine: live sandboxes, their families, and create / call / fork / merge / close.

Everything here runs on the daemon's event loop. Each sandbox is a *record*
(its public identity) bound to a *body* (the processes, cgroup and layers
that currently serve it); merge_into re-binds a parent's record to the
winner's body, which is why the two are kept apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import resource
import secrets
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from branchbox.agent.protocol import ChannelClosed
from branchbox.engine import errors
from branchbox.engine.config import EngineConfig
from branchbox.engine.layers import (
    FrozenLayer,
    Layers,
    LayerStack,
    WorkspaceBranch,
    WorkspaceLower,
)
from branchbox.engine.records import Records, SandboxRecord
from branchbox.runtime import rootfs
from branchbox.runtime.cgroups import Limits, SandboxCgroup, favor_dynamic_moves
from branchbox.runtime.channel import AgentChannel, AgentError
from branchbox.runtime.family import Family, spawn_family
from branchbox.storage import workspace_commit
from branchbox.storage.backend import choose_backend
from branchbox.storage.idmap import UID_BASE
from branchbox.storage.images import ImageNotFound, ensure_image
from branchbox.storage.layerdiff import diff_layers

log = logging.getLogger("branchbox.engine")

ID_RE = re.compile(r"^sbx_[0-9a-f]{32}$")
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm",
    "MPLBACKEND": "Agg",
}
# An empty directory where a new family's first sandbox attaches its root before
# pivot_root. Outside the data directory on purpose: the launcher resolves it as the
# sandbox's mapped root, which may not traverse a private data directory's parents.
ATTACH_DIR = Path("/run/branchbox/attach")
# Frozen layers a root may stack before a fork squashes them into one.
MAX_CHAIN = 16
DEFAULT_DIFF_PATHS = ("/root", "/tmp")
# Requests that never touch the REPL's interpreter state, so they skip its lock.
_LOCK_FREE_OPS = {"ping", "wait", "kill", "ps"}


def new_id() -> str:
    return "sbx_" + secrets.token_hex(16)


@dataclass(eq=False)
class FamilyHandle:
    family: Family
    members: set[str] = field(default_factory=set)


@dataclass(eq=False)
class Body:
    """What serves a sandbox right now: layers, cgroup, REPL channel."""

    key: str
    layers: LayerStack
    cgroup: SandboxCgroup
    channel: AgentChannel | None = None


@dataclass(eq=False)
class Live:
    record: SandboxRecord
    body: Body
    family: FamilyHandle
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    generation: int = 0  # bumped by every merge into this sandbox
    forked_at: int | None = None  # the parent's generation when this one was forked
    timer: asyncio.TimerHandle | None = None
    watcher: asyncio.Task | None = None
    last_fork: dict | None = None  # timings of the latest fork, seconds (for info and bench)
    last_used: float = field(default_factory=time.monotonic)  # for the idle timeout

    @property
    def id(self) -> str:
        return self.record.id


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.live: dict[str, Live] = {}
        self.store = None
        self.layers: Layers | None = None
        self.records: Records | None = None
        self._base_cache: dict[str, list[Path]] = {}
        # id -> (parent id, parent's generation at fork); kept after close so that a
        # descendant whose intermediate ancestors are closed can still be merged.
        self._lineage: dict[str, tuple[str, int]] = {}
        self._generations = itertools.count(1)
        self._unfavor = None
        self._background: set[asyncio.Task] = set()
        self._idmap_userns = -1
        self._workspace_lowers: dict[Path, WorkspaceLower] = {}
        self._workspace_versions: dict[Path, int] = {}
        self._warm: dict[str, list[Live]] = {}
        self._refilling: dict[str, asyncio.Task] = {}
        self._stopping = False

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        cfg = self.config
        for sub in ("run", "logs"):
            (cfg.data_dir / sub).mkdir(parents=True, exist_ok=True)
        cfg.data_dir.chmod(0o700)  # layers, logs and the socket are the daemon's alone
        ATTACH_DIR.mkdir(parents=True, exist_ok=True)
        _raise_fd_limit()
        self.records = Records(cfg.data_dir / "sandboxes.db")
        self._unfavor = favor_dynamic_moves(cfg.data_dir / "run" / "cgroup-favor")
        self._reap_leftovers()
        self.store = choose_backend(cfg.data_dir, cfg.storage)
        self.layers = Layers(self.store.backend, self.store.root)
        self._clear_volumes()
        self.agent_layer = rootfs.prepare_agent_layer(cfg.data_dir / "agent-layer")
        self._idmap_userns = rootfs.idmap_userns()
        for host in self.records.pending_commits():  # the daemon died inside a commit
            outcome = workspace_commit.recover(host)
            log.warning("commit into %s interrupted by a crash: %s", host, outcome)
            self.records.end_commit(host)
        log.info("storage: %s backend at %s", self.store.backend.name, self.store.root)
        self._refill("default")  # warm sandboxes for the first creates

    def _reap_leftovers(self) -> None:
        """Whatever an earlier daemon of this data directory left: kill, remove, mark closed."""
        for cg in SandboxCgroup.leftovers(self.config.cgroup_group):
            cg.remove()
        stale = [rec.id for rec in self.records.live()]
        if stale:
            log.warning("closing %d sandboxes left by an earlier daemon", len(stale))
            self.records.mark_closed(stale)

    def _clear_volumes(self) -> None:
        for path in sorted(self.layers.root.iterdir()):
            self.layers.backend.delete(path)

    async def stop(self) -> None:
        self._stopping = True
        await self._drop_warm()
        while self._background:  # expiries and teardowns under way
            await asyncio.gather(*list(self._background), return_exceptions=True)
        for sid in list(self.live):
            with contextlib.suppress(errors.EngineError):
                await self.close(sid)
        SandboxCgroup.remove_group(self.config.cgroup_group)
        if self._unfavor is not None:
            self._unfavor()
        if self._idmap_userns >= 0:
            os.close(self._idmap_userns)
        if self.store is not None:
            self.store.close()
        if self.records is not None:
            self.records.close()

    # ------------------------------------------------------------------- lookup
    def get(self, sandbox_id: str) -> Live:
        sb = self.live.get(sandbox_id)
        if sb is None:
            raise errors.SandboxNotFound()
        return sb

    def list(self) -> list[Live]:
        return list(self.live.values())

    def info(self, sandbox_id: str) -> dict:
        sb = self.get(sandbox_id)
        rec = sb.record
        usage: dict = {}
        with contextlib.suppress(OSError, ValueError):
            usage = {
                "memory_bytes": sb.body.cgroup.memory_bytes(),
                "pids": sb.body.cgroup.pids_current(),
                "host_pids": sb.body.cgroup.pids(),
            }
        children = [c.id for c in self.live.values() if c.record.parent_id == rec.id]
        return {
            "id": rec.id,
            "state": rec.state,
            "parent_id": rec.parent_id,
            "children": children,
            "family": rec.family,
            "image": rec.image,
            "created": rec.created,
            "hostname": rec.id,
            "address": "127.0.0.1 (loopback only)",
            "layers": len(sb.body.layers.frozen),
            "resources": usage,
            "last_fork": sb.last_fork,
        }

    # ------------------------------------------------------------------- create
    async def _base_layers(self, image: str) -> list[Path]:
        if image not in self._base_cache:
            try:
                rootfs_dir = await asyncio.to_thread(
                    ensure_image, image, self.config.image_cache, True
                )
            except ImageNotFound as exc:
                raise errors.InvalidRequest(str(exc)) from exc
            self._base_cache[image] = [self.agent_layer, rootfs_dir]
        return self._base_cache[image]

    def _limits(self, memory_mb: int | None) -> Limits:
        mb = memory_mb or self.config.memory_mb
        return Limits(memory_bytes=mb * 1024 * 1024, pids=self.config.pids_max)

    async def create(
        self,
        *,
        image: str = "default",
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        memory_mb: int | None = None,
        workspace: str | None = None,
        idle_timeout: float | None = None,
    ) -> Live:
        _check_env(env)
        branch = self._workspace_branch(workspace) if workspace is not None else None
        cwd = cwd or "/root"
        if not cwd.startswith("/") or ".." in cwd.split("/") or "\0" in cwd:
            raise errors.InvalidRequest(f"cwd must be an absolute path without '..': {cwd!r}")
        if memory_mb is not None and not 16 <= memory_mb <= 1 << 20:
            raise errors.InvalidRequest("memory_mb must be between 16 and 1048576")
        for name, value in (("timeout", timeout), ("idle_timeout", idle_timeout)):
            if value is not None and not 0 < value <= 7 * 86400:
                raise errors.InvalidRequest(f"{name} must be between 0 and 604800 seconds")
        meta = {"cwd": cwd, "memory_mb": memory_mb, "timeout": timeout,
                "workspace": str(branch.lower.host) if branch else None}
        sb = self._take_warm(image)
        if sb is not None:  # a warm sandbox: give it this request's settings
            if memory_mb is not None:
                sb.body.cgroup.apply(self._limits(memory_mb))
            sb.record.meta, sb.record.created = meta, time.time()
            try:
                if branch is not None:  # before configure: cwd may be inside it
                    await self._attach_workspace(sb.body, branch)
                await sb.body.channel.call("configure", {"env": env or {}, "cwd": cwd})
            except (AgentError, ChannelClosed, OSError) as exc:
                await self._destroy_body(sb.body)
                await sb.family.family.kill()
                raise errors.EngineError(f"a warm sandbox failed to start: {exc}") from None
        else:
            sb = await self._spawn(image, meta, env, branch)
        self._adopt(sb, timeout)
        if idle_timeout:
            self._close_when_idle(sb, idle_timeout)
        return sb

    async def _spawn(self, image: str, meta: dict, env: dict[str, str] | None,
                     branch: WorkspaceBranch | None) -> Live:
        """A new family and its first sandbox (not yet adopted: no timer, not listed)."""
        base = await self._base_layers(image)
        sid = new_id()
        key = secrets.token_hex(8)
        stack = self.layers.new_stack([], base, branch)
        cgroup = None
        try:
            cgroup = SandboxCgroup.create(self.config.cgroup_group, key,
                                          self._limits(meta["memory_mb"]))
            full_env = {**DEFAULT_ENV, "HOSTNAME": sid, **(env or {})}
            family, channel = await spawn_family(
                tree_fd=stack.tree(),
                repl_cgroup_fds=cgroup.join_fds("repl"),
                cmds_cgroup_fds=cgroup.join_fds("cmds"),
                mounts=stack.mounts(),
                hostname=sid,
                env=full_env,
                cwd=meta["cwd"],
                attach=ATTACH_DIR,
                log_path=self.config.data_dir / "logs" / f"{sid}.log",
                timeout=self.config.spawn_timeout,
            )
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            self.layers.release(stack)
            raise
        body = Body(key, stack, cgroup, channel)
        record = SandboxRecord(id=sid, family=sid, instance=key, image=image, meta=meta)
        return Live(record, body, FamilyHandle(family, {sid}))

    async def _attach_workspace(self, body: Body, branch: WorkspaceBranch) -> None:
        """Mount a workspace into a running sandbox: its layers join the sandbox's volume
        and the REPL attaches the detached overlay at the host path."""
        self.layers.add_workspace(body.layers, branch)
        ((tree, path),) = body.layers.mounts()
        try:
            await body.channel.call("attach", {"path": path}, fds=[tree])
        finally:
            os.close(tree)

    # --------------------------------------------------------------- warm pool
    def _take_warm(self, image: str) -> Live | None:
        """A pre-started sandbox of ``image`` if one is ready; starts a replacement.

        Starting a family costs two interpreter start-ups (~150 ms here); keeping a
        few ready makes create a matter of milliseconds. Warm sandboxes are plain
        defaults and take a request's workspace, env, cwd and memory limit on
        hand-out.
        """
        pool = self._warm.setdefault(image, [])
        sb = None
        while pool and sb is None:
            candidate = pool.pop()
            if not candidate.body.channel.closed.is_set():
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

    def _adopt(self, sb: Live, timeout: float | None) -> None:
        self.live[sb.id] = sb
        self.records.put(sb.record)
        sb.watcher = asyncio.get_running_loop().create_task(self._watch(sb, sb.body))
        if timeout:
            sb.timer = asyncio.get_running_loop().call_later(
                timeout, self._expire, sb.id
            )

    def _close_when_idle(self, sb: Live, idle: float) -> None:
        """Close ``sb`` once no request has used it for ``idle`` seconds (a run still going
        counts as use). A check that finds it closed or merged away just stops."""
        loop = asyncio.get_running_loop()
        sb.last_used = time.monotonic()  # a warm sandbox may have waited long in the pool

        def check() -> None:
            if self.live.get(sb.id) is not sb:
                return
            now = time.monotonic()
            if sb.lock.locked():
                sb.last_used = now
            if now - sb.last_used >= idle:
                self._expire(sb.id)
            else:
                loop.call_later(sb.last_used + idle - now, check)

        loop.call_later(idle, check)

    def _expire(self, sandbox_id: str) -> None:
        """A sandbox's timeout ran out: close it (stop() waits for closes under way)."""
        task = asyncio.get_running_loop().create_task(self._close_quietly(sandbox_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _close_quietly(self, sandbox_id: str) -> None:
        with contextlib.suppress(errors.EngineError):
            await self.close(sandbox_id)

    async def _watch(self, sb: Live, body: Body) -> None:
        """Mark the sandbox gone when its REPL's channel closes (the REPL died)."""
        await body.channel.closed.wait()
        if sb.body is body and self.live.get(sb.id) is sb:
            sb.record.state = "gone"
            self.records.put(sb.record)

    # -------------------------------------------------------------------- close
    async def close(self, sandbox_id: str) -> None:
        sb = self.live.pop(sandbox_id, None)
        if sb is None:
            raise errors.SandboxNotFound()
        if sb.timer:
            sb.timer.cancel()
        await self._destroy_body(sb.body)
        sb.record.state = "closed"
        self.records.mark_closed([sb.id])
        sb.family.members.discard(sb.id)
        if not sb.family.members:
            await sb.family.family.kill()

    def _retire(self, body: Body) -> None:
        """Destroy a body in the background (stop() waits for it)."""
        task = asyncio.get_running_loop().create_task(self._destroy_body(body))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _destroy_body(self, body: Body) -> None:
        """Kill, disconnect and free a body; each step runs even if an earlier one failed."""
        try:
            await asyncio.to_thread(body.cgroup.remove)
        finally:
            try:
                if body.channel is not None:
                    await body.channel.close()
            finally:
                self.layers.release(body.layers)

    # --------------------------------------------------------------------- calls
    async def _acquire(self, sb: Live, wait: float | None) -> None:
        sb.last_used = time.monotonic()  # runs, files, fork, merge: use, for the idle timeout
        try:
            await asyncio.wait_for(sb.lock.acquire(), wait)
        except TimeoutError:
            raise errors.Conflict(
                f"sandbox {sb.id} is busy: its REPL is still running a "
                f"call after {wait:.0f} s; retry later"
            ) from None

    def _check_alive(self, sb: Live) -> AgentChannel:
        if sb.record.state == "gone" or sb.body.channel.closed.is_set():
            raise errors.ReplGone(
                f"the REPL of sandbox {sb.id} is gone (it exited or was killed); close the sandbox"
            )
        return sb.body.channel

    async def stream(
        self, sandbox_id: str, op: str, args: dict | None = None, payload: bytes = b""
    ) -> AsyncIterator[tuple[dict, bytes]]:
        """Events of one agent request, translated into engine errors."""
        sb = self.get(sandbox_id)
        sb.last_used = time.monotonic()
        locked = op not in _LOCK_FREE_OPS
        if locked:
            await self._acquire(sb, None)
        try:
            channel = self._check_alive(sb)
            async for item in channel.stream(op, args, payload):
                yield item
        except AgentError as exc:
            raise errors.AGENT_ERRORS.get(exc.kind, errors.EngineError)(exc.message) from None
        except ChannelClosed:
            raise errors.ReplGone(
                f"the REPL of sandbox {sandbox_id} died during {op!r}; close the sandbox"
            ) from None
        finally:
            sb.last_used = time.monotonic()  # the end of a long run is use, for idle
            if locked:
                sb.lock.release()

    async def call(
        self, sandbox_id: str, op: str, args: dict | None = None, payload: bytes = b""
    ) -> dict:
        result: dict = {}
        async for header, _ in self.stream(sandbox_id, op, args, payload):
            if header.get("ev") == "done":
                result = header.get("result") or {}
        return result

    async def write_file(
        self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes], mode: int | None = None
    ) -> dict:
        """Stream an upload into the sandbox frame by frame (never whole in memory)."""
        sb = self.get(sandbox_id)
        await self._acquire(sb, None)
        try:
            channel = self._check_alive(sb)
            rid, queue = channel.open_request()
            header = {"op": "write", "rid": rid, "path": path, "more": True}
            if mode is not None:
                header["mode"] = mode
            pending = b""
            try:
                async for chunk in chunks:
                    pending += chunk
                    while len(pending) >= 1 << 20:
                        await channel.send(header, pending[: 1 << 20])
                        pending = pending[1 << 20 :]
                        if not queue.empty():  # an early failure (bad path): stop sending
                            break
            except BaseException:
                # The source failed (client gone, body too large): the agent drops the
                # partial upload and the old file stays as it was.
                channel.close_request(rid)
                await channel.send({**header, "more": False, "abort": True})
                raise
            await channel.send({**header, "more": False}, pending)
            result: dict = {}
            async for ev, _ in channel.events(rid, queue):
                if ev.get("ev") == "done":
                    result = ev.get("result") or {}
            return result
        except AgentError as exc:
            raise errors.AGENT_ERRORS.get(exc.kind, errors.EngineError)(exc.message) from None
        except ChannelClosed:
            raise errors.ReplGone(f"the REPL of sandbox {sandbox_id} died during a write") from None
        finally:
            sb.lock.release()

    # ---------------------------------------------------------------------- fork
    async def fork(self, sandbox_id: str, n: int) -> list[Live]:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.config.max_fork:
            raise errors.InvalidRequest(f"n must be between 1 and {self.config.max_fork}")
        parent = self.get(sandbox_id)
        await self._acquire(parent, self.config.busy_wait)
        try:
            channel = self._check_alive(parent)
            return await self._fork_locked(parent, channel, n)
        finally:
            parent.lock.release()

    async def _fork_locked(self, parent: Live, channel: AgentChannel, n: int) -> list[Live]:
        """Pipelined: the REPL forks child k as soon as its slot arrives, so child k sets
        itself up while the daemon prepares child k+1. All children still come from one
        instant: the REPL runs nothing else between the slots, and they share one frozen
        layer."""
        started = time.perf_counter()
        pbody = parent.body
        pbody.cgroup.freeze("cmds")
        made: list[tuple[str, Body]] = []
        fresh: list[FrozenLayer] = []
        pending: list = []  # each slot's answer, then each child's hello
        batch_open = False
        try:
            fresh.append(await asyncio.to_thread(self.layers.freeze, pbody.layers))
            lowers = [fresh[0], *pbody.layers.frozen]
            if len(lowers) > MAX_CHAIN:
                fresh.append(await asyncio.to_thread(self.layers.squash, lowers))
                lowers = [fresh[-1]]
            limits = self._limits(parent.record.meta.get("memory_mb"))
            for _ in range(n):
                sid, body = self._prepare_child(lowers, pbody.layers, limits)
                made.append((sid, body))
                batch_open = True
                answer, hello = await self._send_slot(channel, sid, body)
                pending += [answer, hello]
            batch_open = False
            forked = await channel.call("fork")
            try:
                await asyncio.wait_for(asyncio.gather(*pending), self.config.spawn_timeout)
            except TimeoutError:
                raise errors.EngineError("fork failed: the children did not report within "
                                         f"{self.config.spawn_timeout:.0f} s") from None
            parent.last_fork = {"n": n, "repl_paused": forked.get("paused"),
                                "total": time.perf_counter() - started}
        except BaseException as exc:
            for coro in pending:
                if asyncio.iscoroutine(coro):
                    coro.close()
            if batch_open:  # let the REPL leave its fork batch
                with contextlib.suppress(AgentError, ChannelClosed, OSError):
                    await channel.call("fork")
            for _, body in made:
                await self._destroy_body(body)
            if isinstance(exc, AgentError):
                raise errors.EngineError(f"fork failed: {exc.message}") from None
            if isinstance(exc, ChannelClosed):
                raise errors.EngineError(
                    "fork failed: a child died while entering its sandbox"
                ) from None
            raise
        finally:
            for layer in fresh:
                if layer.refs == 0:  # unused: squashed away, or the fork failed
                    self.layers.drop(layer)
            pbody.cgroup.freeze("cmds", frozen=False)
        children = []
        for sid, body in made:
            record = SandboxRecord(
                id=sid,
                family=parent.record.family,
                instance=body.key,
                image=parent.record.image,
                parent_id=parent.id,
                meta={**parent.record.meta, "timeout": None},
            )
            child = Live(record, body, parent.family, forked_at=parent.generation)
            self._lineage[sid] = (parent.id, parent.generation)
            parent.family.members.add(sid)
            self._adopt(child, None)
            children.append(child)
        return children


    def _prepare_child(self, lowers: list[FrozenLayer], parent: LayerStack,
                       limits: Limits) -> tuple[str, Body]:
        """A child's id, writable volume and cgroup; its channel is created at hand-over."""
        sid, key = new_id(), secrets.token_hex(8)
        stack = self.layers.new_stack(lowers, parent.base, parent.workspace)
        try:
            cgroup = SandboxCgroup.create(self.config.cgroup_group, key, limits)
        except BaseException:
            self.layers.release(stack)
            raise
        return sid, Body(key, stack, cgroup)

    async def _send_slot(self, channel: AgentChannel, sid: str, body: Body):
        """Hand the REPL a child's root, control socket, cgroup fds and extra mounts; it
        forks the child on receipt. Returns two awaitables: the REPL's answer, and the
        child's hello (request 0 on its own channel: ready, or why its set-up failed)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        body.channel = AgentChannel(ours)
        hello = _drain(body.channel.events(0, body.channel.expect(0)))  # before it can come
        repl_fds, cmds_fds = body.cgroup.join_fds("repl"), body.cgroup.join_fds("cmds")
        mounts = body.layers.mounts()
        fds = [body.layers.tree(), *repl_fds, *cmds_fds, *(fd for fd, _ in mounts)]
        try:
            rid, queue = channel.open_request()
            slot = {"op": "fork_slot", "rid": rid, "id": sid, "nrepl": len(repl_fds),
                    "ncmds": len(cmds_fds), "mounts": [path for _, path in mounts]}
            await channel.send(slot, fds=[fds[0], theirs.fileno(), *fds[1:]])
            return _drain(channel.events(rid, queue)), hello
        except BaseException:
            hello.close()
            raise
        finally:
            theirs.close()
            for fd in fds:
                os.close(fd)

    # ----------------------------------------------------------------- workspaces
    def _workspace_branch(self, workspace: str) -> WorkspaceBranch:
        """Validate a host directory and open it as a new branch's workspace."""
        if not isinstance(workspace, str) or not workspace.startswith("/") or "\0" in workspace:
            raise errors.InvalidRequest(f"workspace must be an absolute path: {workspace!r}")
        host = Path(os.path.realpath(workspace))
        if not host.is_dir():
            raise errors.InvalidRequest(f"workspace is not a directory on the host: {host}")
        forbidden = [Path("/"), *(Path(p) for p in ("/proc", "/sys", "/dev", "/run"))]
        data = self.config.data_dir.resolve()
        if host in forbidden or host.is_relative_to(data) or data.is_relative_to(host) \
                or any(host.is_relative_to(p) for p in forbidden[1:]):
            raise errors.InvalidRequest(f"{host} cannot be a workspace")
        lower = self._workspace_lowers.get(host)
        if lower is None or lower.users == 0:
            lower = WorkspaceLower(host, rootfs.idmapped_tree(host, self._idmap_userns))
            self._workspace_lowers[host] = lower
        return WorkspaceBranch(lower, since=time.time(),
                               version=self._workspace_versions.get(host, 0))

    async def commit(self, sandbox_id: str) -> dict:
        """Write the sandbox's workspace changes into the host directory, crash-atomically.

        First commit wins: a branch that started from an older version of the
        directory (a sibling committed first) gets StaleBranch and nothing changes.
        """
        sb = self.get(sandbox_id)
        branch = sb.body.layers.workspace
        if branch is None:
            raise errors.InvalidRequest(f"sandbox {sandbox_id} has no workspace")
        host = branch.lower.host
        await self._acquire(sb, self.config.busy_wait)
        try:
            current = self._workspace_versions.get(host, 0)
            if branch.version != current:
                raise errors.StaleBranch(
                    f"{host} changed since sandbox {sandbox_id} branched from it: another "
                    "sandbox committed first (first commit wins)")
            layers = sb.body.layers.workspace_dirs()
            sb.body.cgroup.freeze("cmds")  # no command writes while the delta is read
            self.records.begin_commit(host)
            try:
                done = await asyncio.to_thread(workspace_commit.commit, layers, host,
                                               since=branch.since, uid_shift=UID_BASE)
            except workspace_commit.WorkspaceConflict as exc:  # refused before any change
                self.records.end_commit(host)
                raise errors.Conflict(str(exc)) from None
            except Exception as exc:
                # It may have failed after its commit point: finish or undo it now, so the
                # directory is entirely old or entirely new before anyone looks.
                outcome = await asyncio.to_thread(workspace_commit.recover, host)
                self.records.end_commit(host)
                raise errors.EngineError(f"commit into {host} failed ({outcome}): "
                                         f"{type(exc).__name__}: {exc}") from None
            finally:
                sb.body.cgroup.freeze("cmds", frozen=False)
            self.records.end_commit(host)
            self._workspace_versions[host] = current + 1
            branch.version, branch.since = current + 1, time.time()
            return {"workspace": str(host), "changed": done.changed, "bytes": done.bytes,
                    "version": current + 1}
        finally:
            sb.lock.release()

    # --------------------------------------------------------------------- merge
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
            old = parent.body
            parent.body = winner.body
            parent.generation = next(self._generations)
            parent.record.instance = winner.body.key
            parent.record.state = "ready"
            self.live.pop(winner.id)
            if winner.timer:
                winner.timer.cancel()
            for sid, (up, generation) in list(self._lineage.items()):
                if up == winner.id:  # the winner's children are now the parent's
                    fresh = generation == winner.generation
                    self._lineage[sid] = (parent.id, parent.generation if fresh else -1)
                    if sid in self.live:
                        self.live[sid].record.parent_id = parent.id
            winner.family.members.discard(winner.id)
            self.records.mark_closed([winner.id])
            self.records.put(parent.record)
            parent.watcher = asyncio.get_running_loop().create_task(
                self._watch(parent, parent.body))
            with contextlib.suppress(errors.EngineError, AgentError, ChannelClosed):
                await parent.body.channel.call("sethostname", {"hostname": parent.id})
            self._retire(old)  # killed and freed in the background: merge returns now
        finally:
            winner.lock.release()
            parent.lock.release()

    # ---------------------------------------------------------------------- diff
    async def diff(self, sandbox_id: str, other_id: str,
                   paths: list[str] | None = None) -> dict[str, list[str]]:
        """Files added in ``other``, removed from it, and modified, read from the layers."""
        mine, other = self.get(sandbox_id), self.get(other_id)
        paths = list(paths or DEFAULT_DIFF_PATHS)
        for path in paths:
            if not isinstance(path, str) or not path.startswith("/") or "\0" in path \
                    or ".." in path.split("/"):
                raise errors.InvalidRequest(f"diff paths must be absolute without '..': {path!r}")
        try:
            return await asyncio.to_thread(diff_layers, mine.body.layers.layer_dirs(),
                                           other.body.layers.layer_dirs(), paths)
        except FileNotFoundError:  # a layer went away under the walk
            raise errors.Conflict("a sandbox was closed or merged while the diff was read; "
                                  "diff live sandboxes") from None


def _raise_fd_limit() -> None:
    """Every live sandbox holds a control socket in the daemon: a thousand children of
    one parent need more than the usual soft limit of 1024 fds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _drain(events: AsyncIterator) -> None:
    async for _ in events:
        pass


def _check_env(env: dict | None) -> None:
    if env is None:
        return
    if not isinstance(env, dict):
        raise errors.InvalidRequest("env must be an object of strings")
    for key, value in env.items():
        if (
            not isinstance(key, str)
            or not isinstance(value, str)
            or not key
            or "=" in key
            or "\0" in key
            or "\0" in value
        ):
            raise errors.InvalidRequest(f"invalid environment variable {key!r}")
