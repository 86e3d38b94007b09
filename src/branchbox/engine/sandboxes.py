"""The engine: live sandboxes and their families; start, stop, create, call, close.

Everything here runs on the daemon's event loop. Branching (fork, merge, diff),
workspaces and the warm pool are mixed in from modules of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import resource
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

from branchbox.agent.protocol import ChannelClosed
from branchbox.engine import answers, errors, listing, metrics
from branchbox.engine.branching import Branching
from branchbox.engine.checkpoints import Checkpoint, Checkpoints
from branchbox.engine.config import EngineConfig
from branchbox.engine.create_args import check_env, check_lifetimes
from branchbox.engine.events import EventBus
from branchbox.engine.fair_pool import FairPool
from branchbox.engine.family_room import Remains, VolumeRemains
from branchbox.engine.host_image import HOST, HostImage, HostImageUnavailable
from branchbox.engine.idranges import IdRange, IdRanges
from branchbox.engine.images import SavedImages
from branchbox.engine.layers import (
    FrozenLayer,
    Layers,
    LayerStack,
    WorkspaceLower,
)
from branchbox.engine.live import Body, FamilyHandle, Live
from branchbox.engine.made_ahead import MadeAhead
from branchbox.engine.memory_guard import MemoryGuard
from branchbox.engine.networking import SandboxNetwork
from branchbox.engine.node import new_id, node_tag
from branchbox.engine.pausing import Pausing, refuse_paused
from branchbox.engine.reattach import Reattach
from branchbox.engine.records import Records, SandboxRecord
from branchbox.engine.repl_end import repl_ended
from branchbox.engine.run_guard import (
    OWN_REQUEST_WAIT,
    PROMPT_OPS,
    RunDeadline,
    acquire,
    killed,
    release_when_quiet,
    until_gone,
)
from branchbox.engine.snapshots import Snapshots
from branchbox.engine.stopped import Stopped, StoppedSandboxes, describe
from branchbox.engine.templates import Templates
from branchbox.engine.warm import WARM_CWD, WarmPool
from branchbox.engine.workspaces import Workspaces
from branchbox.runtime import procfs, rootfs, smaps
from branchbox.runtime.cgroups import (
    GroupMemory,
    Limits,
    SandboxCgroup,
    bound_all_sandboxes,
    favor_dynamic_moves,
)
from branchbox.runtime.channel import INTERRUPTIBLE, AgentChannel, AgentError, interrupt_repl
from branchbox.runtime.family import (
    Family,
    SpawnError,
    Zygote,
    spawn_family,
    start_variables,
    widen_inotify_budget,
)
from branchbox.runtime.fd_keeper import FdKeeper, KeeperError
from branchbox.runtime.signal_guard import SignalGuard
from branchbox.runtime.thaw_guard import ThawGuard
from branchbox.storage import workspace_commit
from branchbox.storage.backend import choose_backend
from branchbox.storage.images import ImageNotFound, ensure_image

log = logging.getLogger("branchbox.engine")

# /opt/venv/bin first: the default image's virtualenv (storage/images.py), where `pip
# install` goes; its python is also the REPL's (Python finds its venv through PATH).
DEFAULT_ENV = {
    "PATH": "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm",
    "MPLBACKEND": "Agg",
}
# An empty directory where a new family's first sandbox attaches its root before
# pivot_root. Outside the data directory on purpose: the launcher resolves it as the
# sandbox's mapped root, which may not traverse a private data directory's parents.
ATTACH_DIR = Path("/run/branchbox/attach")
CONTENT_THREADS = 4  # content work (engine.fair_pool), I/O-bound: twice the CPUs here
CONTENT_PER_FAMILY = 2  # so two families' work always runs beside a third's backlog
# Requests that never touch the REPL's interpreter state, so they skip its lock.
# (follow streams a background command's output for as long as it runs.)
_LOCK_FREE_OPS = {"ping", "wait", "kill", "ps", "follow", "input", "close_stdin",
                  "resize", "watch", "watch_events", "unwatch"}


class Engine(WarmPool, Templates, Branching, Workspaces, SavedImages, Pausing, Checkpoints,
             Snapshots, StoppedSandboxes, Reattach):
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.live: dict[str, Live] = {}
        self.node = ""  # this node's tag, from its data directory at start (engine.node)
        self.store = None
        self.layers: Layers | None = None
        self.records: Records | None = None
        self._base_cache: dict[str, list[Path]] = {}
        # id -> (parent id, parent's generation at fork); kept after close so that a
        # descendant whose intermediate ancestors are closed can still be merged.
        self._lineage: dict[str, tuple[str, int]] = {}
        self._checkpoints: dict[str, Checkpoint] = {}  # by id; see engine.checkpoints
        self._snapshots: dict[str, Checkpoint] = {}  # by name, also in _checkpoints
        self._resuming: set[str] = set()  # Podflare spaces a resume is using up
        self.memory_guard: MemoryGuard | None = None
        self._stopped: dict[str, Stopped] = {}  # files kept, no processes (engine.stopped)
        self._generations = itertools.count(1)
        self._unfavor = None
        self._thaw_guard: ThawGuard | None = None
        self._background: set[asyncio.Task] = set()
        self.ids: IdRanges | None = None  # each family's own host id range
        self._workspace_lowers: dict[tuple[Path, int], WorkspaceLower] = {}
        self._workspace_versions: dict[Path, int] = {}  # commits so far, by host dir
        self._warm: dict[str, list[Live]] = {}
        self._warm_waiters: dict[str, deque[asyncio.Future]] = {}  # creates in line (warm.py)
        self._refilling: dict[str, asyncio.Task] = {}
        self._demand: dict = {}  # image -> its recent creates (warm.py)
        self._templates: dict = {}  # image -> its template (engine.templates)
        self._template_lock = asyncio.Lock()
        self._template_failed: dict[str, float] = {}  # image -> no new try before then
        self._retiring: dict[str, asyncio.Task] = {}  # image -> its template's replacement
        self._stopping = False
        self.net: SandboxNetwork | None = None
        self.host_image: HostImage | None = None
        self.keeper: FdKeeper | None = None  # holds control sockets across restarts
        self.zygote = Zygote(self.config.data_dir / "logs" / "zygote.log")  # forks launchers
        self.signal_guard = SignalGuard()
        self.ready_cgroups: MadeAhead[Limits, SandboxCgroup] = MadeAhead(  # fork children's
            "cgroups", self._new_cgroup, SandboxCgroup.remove)
        self.events = EventBus(self.config.events_kept)  # GET /v1/events and the /ui page
        # Squashes, captures, commits, copies: as long as a family's files (engine.fair_pool)
        self.content = FairPool(CONTENT_THREADS, CONTENT_PER_FAMILY)

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        cfg = self.config
        for sub in ("run", "logs"):
            (cfg.data_dir / sub).mkdir(parents=True, exist_ok=True)
        cfg.data_dir.chmod(0o700)  # layers, logs and the socket are the daemon's alone
        self.node = node_tag(cfg.data_dir)  # what this node's sandbox ids carry
        ATTACH_DIR.mkdir(parents=True, exist_ok=True)
        _raise_fd_limit()
        self.records = Records(cfg.data_dir / "sandboxes.db")
        self.ids = IdRanges(self.records)  # recorded slots stay taken until recover()
        self._workspace_versions = self.records.workspace_versions()
        self.keeper = await asyncio.to_thread(self._connect_keeper)
        # An earlier daemon's sandboxes still running (engine.reattach); the rest of what
        # it left is reaped, its files kept as stopped sandboxes (engine.stopped).
        survivors = await self._find_survivors()
        self.net = SandboxNetwork(self.records.db, cfg.cgroup_group[2:6], cfg.subnet,
                                  cfg.internet)
        await self.net.start({s.record.instance for s in survivors.values()})
        self._unfavor = favor_dynamic_moves(cfg.data_dir / "run" / "cgroup-favor")
        self._thaw_guard = ThawGuard(cfg.cgroup_group)  # nothing stays frozen if we die
        self._thaw_guard.watch()
        self._reap_leftovers({s.record.instance for s in survivors.values()})
        log.info("all sandboxes of this host together: at most %(pids)s processes, "
                 "%(memory)s bytes of memory", bound_all_sandboxes())
        limit = cfg.sandboxes_memory_mb
        self.memory_guard = MemoryGuard(self, GroupMemory(cfg.cgroup_group),
                                        None if limit is None else limit << 20)
        log.info("this daemon's sandboxes together: at most %d MiB of memory (the family "
                 "holding the most gives way from %d MiB)", self.memory_guard.bound >> 20,
                 self.memory_guard.line >> 20)
        self.memory_guard.start()
        log.info("inotify instances per host user: %s", widen_inotify_budget())
        self._mark_stopped(set(survivors))
        self.store = choose_backend(cfg.data_dir, cfg.storage)
        self.layers = Layers(
            self.store.backend, self.store.root,
            set_limit=self.store.set_limit if self.store.quota else None,
            disk_bytes=cfg.disk_mb << 20 if cfg.disk_mb > 0 else None)
        if self.store.quota:
            log.info("disk limits: %s, default %s", self.store.quota,
                     f"{cfg.disk_mb} MiB" if cfg.disk_mb > 0 else "none")
        else:
            log.warning("no per-sandbox disk limits: %s", self.store.no_quota)
        self.layers.clear(self._kept_volumes() | self._image_volumes())
        # Only stopped and re-attached sandboxes' files are left in the store: their
        # families keep their id slots, every other slot is free again.
        self.ids.recover({rec.family for rec in self.records.live()})
        stacks = self._stacks()
        self._load_stopped(stacks)
        self.agent_layer = rootfs.prepare_agent_layer(cfg.data_dir, in_use=bool(survivors))
        self.host_image = HostImage(cfg.host_deny, [cfg.data_dir, cfg.image_cache],
                                    self.store.root, self.agent_layer)
        await self._reattach(survivors, stacks)
        for host in self.records.pending_commits():  # the daemon died inside a commit
            outcome = workspace_commit.recover(host)
            log.warning("commit into %s interrupted by a crash: %s", host, outcome)
            self.records.end_commit(host)
        log.info("storage: %s backend at %s", self.store.backend.name, self.store.root)
        self._watch_keeper()  # from here on: the start asked it what it held
        self._refill("default")  # warm sandboxes for the first creates

    def _reap_leftovers(self, keep: set[str]) -> None:
        """Kill and remove the processes of an earlier daemon of this data directory that
        nobody re-attached to (cgroups not in ``keep``)."""
        for cg in SandboxCgroup.leftovers(self.config.cgroup_group):
            if cg.name not in keep:
                cg.remove()

    async def stop(self) -> None:
        self._stopping = True
        if self.memory_guard is not None:
            await self.memory_guard.stop()
        await self._drop_warm()
        while self._background:  # expiries and teardowns under way
            await asyncio.gather(*list(self._background), return_exceptions=True)
        await self.ready_cgroups.close()
        if self.layers is not None:
            await self.layers.blank.close()
        if self.config.keep:
            await self._leave_running()
            if self.net is not None:
                await self.net.detach()
        else:
            for sid in list(self.live):
                with contextlib.suppress(errors.EngineError):
                    await self.close(sid)
            await self._drop_snapshots()
            self._release_stopped()
            SandboxCgroup.remove_group(self.config.cgroup_group)
            if self.net is not None:
                await self.net.stop()
        await self._close_templates()
        await asyncio.to_thread(self.zygote.close)  # no family starts any more
        if self.keeper is not None:
            self._unwatch_keeper(self.keeper)
            if self.config.keep:
                self.keeper.close()
            else:
                self.keeper.quit()
        self.signal_guard.stop()
        if self._unfavor is not None:
            self._unfavor()
        if self._thaw_guard is not None:
            self._thaw_guard.stop()
        if self.ids is not None:
            self.ids.close()
        if self.host_image is not None:
            self.host_image.close()
        await self.content.close()
        if self.layers is not None:  # the volumes freed are deleted while it is mounted
            await asyncio.to_thread(self.layers.close)
        if self.store is not None:
            self.store.close()
        if self.records is not None:
            self.records.close()

    async def _freeze(self, stack: LayerStack, hold: SandboxCgroup | None = None
                      ) -> FrozenLayer:
        """``Layers.freeze`` off the event loop: a btrfs snapshot is O(1), on the default
        pool; a copy takes as long as the volume holds, on the content pool in the
        turn of ``stack``'s family."""
        if self.layers.backend.name == "btrfs":
            return await asyncio.to_thread(self.layers.freeze, stack, hold)
        return await self.content.run(stack.ids.family, self.layers.freeze, stack, hold)

    # ------------------------------------------------------------------- lookup
    def get(self, sandbox_id: str) -> Live:
        sb = self.live.get(sandbox_id)
        if sb is None:
            raise errors.SandboxNotFound()
        return sb

    def list(self) -> list[Live]:
        return list(self.live.values())

    def info(self, sandbox_id: str) -> dict:
        """What the sandbox is, its ``resources`` left empty: they are files to read, which
        :meth:`report` does off the event loop (E2B's answers show none of them)."""
        if (stopped := self.stopped_info(sandbox_id)) is not None:
            return stopped
        sb = self.get(sandbox_id)
        children = [c.id for c in self.live.values() if c.record.parent_id == sb.id]
        return self._describe(sb, children, {})

    async def report(self, sandbox_id: str) -> dict:
        """:meth:`info` with its resource use, read off the event loop (``smaps_rollup``
        walks the REPL's page tables: milliseconds for a large heap, and a burst of
        creates answers twenty of these at once)."""
        info = self.info(sandbox_id)
        if (sb := self.live.get(sandbox_id)) is not None:  # (a stopped one uses nothing)
            info["resources"] = await asyncio.to_thread(_usage, sb.body)
        return info

    async def metrics(self, sandbox_id: str) -> metrics.Sample:
        """One sample of what the sandbox uses (``engine/metrics``), its CPU share counted
        from the sandbox's previous sample."""
        sb = self.get(sandbox_id)
        body = sb.body
        try:
            reading = await asyncio.to_thread(metrics.read, body, self.store.used)
        except FileNotFoundError:  # its cgroup went with it: closed meanwhile
            raise errors.SandboxNotFound() from None
        limit = self._limits(sb.record.meta.get("memory_mb")).memory_bytes
        out = metrics.sample(body, reading, sb.cpu_mark, sb.record.created, limit)
        sb.cpu_mark = metrics.CpuMark(body.key, out.at, reading[0])
        return out

    async def infos(self) -> list[dict]:
        """The info of every live sandbox, then every stopped one (a list): the resource
        use of all read in one go off the event loop (it is ~0.7 ms of cgroup and /proc
        reads a sandbox, so a list of a thousand held every other call for most of a
        second), and children found in one pass, not one per sandbox."""
        live = list(self.live.values())
        stopped = [info for sid in self.stopped_ids()  # (both taken before the wait)
                   if (info := self.stopped_info(sid)) is not None]
        children: dict[str, list[str]] = {}
        for sb in live:
            if sb.record.parent_id is not None:
                children.setdefault(sb.record.parent_id, []).append(sb.id)
        usages = await asyncio.to_thread(lambda: [_usage(sb.body) for sb in live])
        rows = [self._describe(sb, children.get(sb.id, []), usage)
                for sb, usage in zip(live, usages, strict=True)
                if self.live.get(sb.id) is sb]  # not closed or merged meanwhile
        return rows + stopped

    def _describe(self, sb: Live, children: list[str], usage: dict) -> dict:
        rec = sb.record
        return {
            "id": rec.id,
            "state": rec.state,
            "parent_id": rec.parent_id,
            "children": children,
            "family": rec.family,
            "image": rec.image,
            "created": rec.created,
            "hostname": rec.id,
            "address": self.net.address(sb.body.key),
            "network": rec.meta.get("network"),
            "layers": len(sb.body.layers.frozen),
            "disk_mb": None if sb.body.layers.disk_bytes is None
            else sb.body.layers.disk_bytes >> 20,
            "resources": usage,
            "last_fork": sb.last_fork,
            "labels": rec.meta.get("labels") or {},
        }

    # ------------------------------------------------------------------- create
    async def _base_layers(self, image: str) -> list[Path]:
        if image == HOST and image not in self._base_cache:
            try:
                self._base_cache[image] = await asyncio.to_thread(self.host_image.layers)
            except HostImageUnavailable as exc:
                raise errors.InvalidRequest(str(exc)) from None
        if image not in self._base_cache and (saved := self._saved_lowers(image)) is not None:
            self._base_cache[image] = [self.agent_layer, *saved]  # sb.save_image's
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

    def _new_cgroup(self, limits: Limits) -> SandboxCgroup:
        """A fork child's cgroup; its name, a fresh random key, is its body's key."""
        return SandboxCgroup.create(self.config.cgroup_group, secrets.token_hex(8), limits)

    def _check_disk_mb(self, disk_mb: object) -> None:
        """A disk limit the store can enforce: an int of MiB from 16 up to the store's size
        (a bigger one would bound nothing); a store without quotas refuses any."""
        if disk_mb is None:
            return
        top = self.store.capacity() >> 20
        if isinstance(disk_mb, bool) or not isinstance(disk_mb, int) or not 16 <= disk_mb <= top:
            raise errors.InvalidRequest(
                f"disk_mb must be an integer between 16 and {top} (the store's size in MiB)")
        if not self.store.quota:
            raise errors.InvalidRequest(self.store.no_quota)

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
        disk_mb: int | None = None,
        internet: bool | None = None,
        network: dict | None = None,
        persistent: bool = False,
    ) -> Live:
        """A new sandbox of ``image``. ``persistent`` (Podflare's): at its idle timeout
        it is kept as a space (engine.snapshots) before it closes."""
        check_env(env)
        self.check_image(image)
        policy = await self.net.resolve(self.net.policy_of(internet, network))
        host = self._workspace_host(workspace) if workspace is not None else None
        image_env, workdir = self.image_defaults(image)  # a built image's ENV and WORKDIR
        env = {**image_env, **(env or {})} or None
        cwd = cwd or workdir or WARM_CWD  # where warm REPLs wait already
        if not cwd.startswith("/") or ".." in cwd.split("/") or "\0" in cwd:
            raise errors.InvalidRequest(f"cwd must be an absolute path without '..': {cwd!r}")
        if memory_mb is not None and not 16 <= memory_mb <= 1 << 20:
            raise errors.InvalidRequest("memory_mb must be between 16 and 1048576")
        check_lifetimes(timeout=timeout, idle_timeout=idle_timeout)
        self._check_disk_mb(disk_mb)
        meta = {"cwd": cwd, "memory_mb": memory_mb, "timeout": timeout, "disk_mb": disk_mb,
                "idle_timeout": idle_timeout,  # fork children inherit it
                "workspace": str(host) if host else None, "network": policy}
        if persistent:
            meta["persistent"] = True
        # A warm sandbox's interpreter started with the defaults: it serves a create whose
        # env leaves what an interpreter reads at its start alone (PYTHONPATH, say).
        warm = start_variables({**DEFAULT_ENV, **(env or {})}) == start_variables(DEFAULT_ENV)
        sb = await self._take_warm(image) if warm else None
        if sb is not None:  # a warm sandbox: give it this request's settings
            self.net.new_family(sb.family.family)  # as forks look now
            if memory_mb is not None:
                sb.body.cgroup.apply(self._limits(memory_mb))
            sb.record.meta, sb.record.created = meta, time.time()
            try:
                if disk_mb is not None:
                    self.layers.limit(sb.body.layers, disk_mb << 20)
                if host is not None:  # before configure: cwd may be inside it
                    await self._attach_workspace(
                        sb.body, self._workspace_branch(host, sb.body.layers.ids))
                if env or cwd != WARM_CWD:  # else the REPL is as it should be already
                    await sb.body.channel.call("configure", {"env": env or {}, "cwd": cwd})
            except (AgentError, ChannelClosed, OSError) as exc:
                await self._destroy_body(sb.body)
                await sb.family.family.kill()
                if isinstance(exc, AgentError) and exc.kind == "InvalidRequest":
                    raise errors.InvalidRequest(exc.message) from None  # e.g. cwd is a file
                raise errors.EngineError(f"a warm sandbox failed to start: {exc}") from None
        else:
            # Started in "/" and moved to its cwd by the agent, as a warm sandbox is: a cwd
            # that cannot be one (a file, a name too long) is then the agent's
            # InvalidRequest, not a failed sandbox entry (a 500).
            sb = await self._spawn(image, {**meta, "cwd": "/"}, env, host)
            sb.record.meta = meta
            try:
                await sb.body.channel.call("configure", {"env": {}, "cwd": cwd})
            except (AgentError, ChannelClosed, OSError) as exc:
                await self._destroy_body(sb.body)
                await sb.family.family.kill()
                if isinstance(exc, AgentError) and exc.kind == "InvalidRequest":
                    raise errors.InvalidRequest(exc.message) from None
                raise errors.EngineError(f"the sandbox failed to start: {exc}") from None
        self.net.apply([sb.body.key], policy)
        self._adopt(sb, timeout)
        if idle_timeout:
            self._close_when_idle(sb, idle_timeout)
        self.events.publish("create", sb.record, image=image)
        return sb

    async def _spawn(self, image: str, meta: dict, env: dict[str, str] | None,
                     workspace: Path | None, *, sid: str | None = None,
                     frozen: list[FrozenLayer] = (), ids: IdRange | None = None) -> Live:
        """A new family and its first sandbox (not yet adopted: no timer, not listed), in
        a host id range of its own, with host directory ``workspace`` (validated) if any.
        A stopped sandbox's start passes its id, its files as ``frozen`` layers and its
        family's id range."""
        base = await self._base_layers(image)
        sid = sid or new_id(self.node)
        key = secrets.token_hex(8)
        disk_mb = meta.get("disk_mb")
        if ids is None:
            ids = self.ids.allocate(sid)  # held by the family's processes, dropped at exit
        else:
            ids.hold()
        try:
            for path in base:  # a slot's first family maps the image (a process start)
                await asyncio.to_thread(ids.lower, path)
            branch = self._workspace_branch(workspace, ids) if workspace is not None else None
            stack = self.layers.new_stack(list(frozen), base, branch, ids=ids,
                                          disk_bytes=None if disk_mb is None else disk_mb << 20)
        except BaseException:
            ids.drop()
            raise
        cgroup = None
        launched: list[Family] = []

        def started(family: Family) -> None:
            launched.append(family)
            self.records.put_launcher(family.ident)
            family.on_exit = functools.partial(self._family_gone, family, ids)

        try:
            cgroup = SandboxCgroup.create(self.config.cgroup_group, key,
                                          self._limits(meta["memory_mb"]))
            full_env = {**DEFAULT_ENV, "HOSTNAME": sid, **(env or {})}

            for retry in (False, True):
                # A stopped sandbox's start runs the python3 of its own files (which it may
                # have upgraded), not the template's.
                forker = self.zygote if frozen else await self._forker_for(image, full_env)
                try:
                    family, channel = await spawn_family(
                        forker=forker,
                        tree_fd=stack.tree(),
                        repl_cgroup_fds=cgroup.join_fds("repl"),
                        cmds_cgroup_fds=cgroup.join_fds("cmds"),
                        mounts=stack.mounts(),
                        hostname=sid,
                        uid_base=ids.base,
                        env=full_env,
                        cwd=meta["cwd"],
                        python=self.image_python(image),
                        reaper=self.agent_layer / ".branchbox" / "bb-init",
                        attach=ATTACH_DIR,
                        log_path=self.config.data_dir / "logs" / f"{sid}.log",
                        timeout=self.config.spawn_timeout,
                        started=started,
                    )
                    break
                except SpawnError:
                    # A template that died since its last create started nothing: once,
                    # the next forker (a new template, or the zygote) starts the family.
                    if retry or launched or forker is self.zygote or not forker.broken:
                        raise
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            self.layers.release(stack)
            if not launched:  # else the family's kill let go of its range (on_exit)
                ids.drop()
            raise
        body = Body(key, stack, cgroup, channel)
        try:  # its own address on the bridge; no egress until create applies a policy
            repl = answers.pid_in(await channel.call("ping"), "a ping")
            body.repl_host = procfs.find_repl(cgroup.leaf_pids("repl"), repl)
            await self.net.attach(key, cgroup, body.repl_host)
            resolv = self.net.resolv_conf()
            if resolv is not None:
                await channel.call("write", {"path": "/etc/resolv.conf", "more": False}, resolv)
        except BaseException:
            await self._destroy_body(body)
            await family.kill()
            raise
        record = SandboxRecord(id=sid, family=sid, instance=key, image=image, meta=meta)
        self.net.new_family(family)  # namespaces for its first fork
        return Live(record, body, FamilyHandle(family, {sid}))

    def _family_gone(self, family: Family, ids: IdRange) -> None:
        """A family's launcher is gone: nothing of it runs in its id range any more, and
        its namespaces made ahead have nobody to join them."""
        self.records.drop_launcher(family.ident)
        self.net.drop_made(family.ident)
        ids.drop()

    def _adopt(self, made: Live | list[Live], timeout: float | None) -> None:
        """List made sandboxes, each closing ``timeout`` from now, and record (in one
        transaction: a fork's children all, or none) what a restarted daemon needs to
        re-attach to them: layers, launcher, lineage (engine.reattach); their sockets go
        to the keeper."""
        made = made if isinstance(made, list) else [made]
        for sb in made:
            meta = {k: v for k, v in sb.record.meta.items() if k != "expires"}  # a parent's
            sb.record.meta = {**meta, "stack": describe(sb.body.layers),
                              "launcher": list(sb.family.family.ident), "gen": sb.generation,
                              "forked_at": sb.forked_at}
            if timeout:
                self._arm(sb, timeout)
        self.records.put(*(sb.record for sb in made))
        self._keep_channels([sb.body for sb in made])
        for sb in made:
            self._serve(sb)

    def _serve(self, sb: Live) -> None:
        self.live[sb.id] = sb
        self._watch_body(sb)

    def _watch_body(self, sb: Live) -> None:
        """Watch the body now serving ``sb`` (its REPL's end) and interrupt what its
        callers give up on."""
        sb.watcher = asyncio.get_running_loop().create_task(self._watch(sb, sb.body))
        sb.body.channel.on_abandon = functools.partial(self._on_abandon, sb.body)

    def _connect_keeper(self) -> FdKeeper:
        return FdKeeper.connect(self.config.data_dir / "run" / "keeper",
                                on_lost=self._keeper_lost)

    def _watch_keeper(self) -> None:
        """Notice a keeper that died when it dies, not at the next sandbox made."""
        fd = self.keeper.fileno()

        def hung_up() -> None:
            asyncio.get_running_loop().remove_reader(fd)
            self.keeper.lost("it hung up")

        asyncio.get_running_loop().add_reader(fd, hung_up)

    def _keeper_lost(self) -> None:
        if not self._stopping:
            self._track(asyncio.get_running_loop().create_task(self._replace_keeper()))

    async def _replace_keeper(self) -> None:
        """The fd keeper died (killed, crashed): start another and hand it every control
        socket and signal listener the old one held, so a daemon killed later still
        leaves every sandbox running."""
        try:
            fresh = await asyncio.to_thread(self._connect_keeper)
        except KeeperError as exc:
            log.error("%s: no sandbox will outlive this daemon", exc)
            return
        lost, self.keeper = self.keeper, fresh
        self._unwatch_keeper(lost)
        lost.close()
        self._watch_keeper()
        bodies = [sb.body for sb in self.live.values()]
        self._keep_channels([*bodies, *(cp.body for cp in self._checkpoints.values())])
        self.signal_guard.listening(self.keeper.keep)
        log.warning("fd keeper replaced: handed it %d sandboxes again", len(bodies))

    @staticmethod
    def _unwatch_keeper(keeper: FdKeeper) -> None:
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(keeper.fileno())

    def _keep_channels(self, bodies: list[Body]) -> None:
        """Hand the keeper these bodies' control sockets (one message per 200)."""
        self.keeper.keep([(body.key, body.channel.sock.fileno()) for body in bodies
                          if body.channel.sock.fileno() >= 0])  # not one closed meanwhile

    def _arm(self, sb: Live, seconds: float) -> None:
        """``sb`` closes ``seconds`` from now; the instant is recorded (by the caller's
        next put) for a daemon that re-attaches to it after a restart."""
        if sb.timer is not None:
            sb.timer.cancel()
        sb.timer = asyncio.get_running_loop().call_later(seconds, self._expire, sb.id)
        sb.record.meta = {**sb.record.meta, "expires": time.time() + seconds}

    def set_timeout(self, sandbox_id: str, timeout: float) -> None:
        """The sandbox now closes ``timeout`` seconds from now, whatever its lifetime was
        (E2B's ``set_timeout``); a paused sandbox gets that much once resumed."""
        sb = self.get(sandbox_id)
        if isinstance(timeout, bool) or not 0 < timeout <= 7 * 86400:
            raise errors.InvalidRequest("timeout must be between 0 and 604800 seconds")
        if "timeout_left" in sb.record.meta:  # paused: the clock starts again on resume
            sb.record.meta = {**sb.record.meta, "timeout_left": timeout}
        else:
            self._arm(sb, timeout)
        self.records.put(sb.record)

    def expires_at(self, sandbox_id: str) -> float | None:
        """When (UNIX time) the sandbox's lifetime ends, or None if it has none running."""
        sb = self.get(sandbox_id)
        if sb.timer is None:
            return None
        return time.time() + sb.timer.when() - asyncio.get_running_loop().time()

    def set_labels(self, sandbox_id: str, labels: dict[str, str]) -> None:
        """Free-form string labels kept with the sandbox (E2B's metadata), inherited by
        fork children; ``info`` shows them."""
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise errors.InvalidRequest("labels must map strings to strings")
        sb = self.get(sandbox_id)
        sb.record.meta = {**sb.record.meta, "labels": dict(labels)}
        self.records.put(sb.record)

    def _on_abandon(self, body: Body, op: str | None, rid: int) -> None:
        """A request whose caller went away: a ``run_code``, a file read or a listing is
        interrupted, a foreground command is killed, so none runs on (holding the sandbox)
        for nobody; a follow of a background command just ends."""
        if op in INTERRUPTIBLE:
            interrupt_repl(body.cgroup, op)
        elif op in ("exec", "follow") and body.channel is not None:
            self._track(asyncio.get_running_loop().create_task(self._cancel(body.channel, rid)))

    @staticmethod
    async def _cancel(channel: AgentChannel, rid: int) -> None:
        with contextlib.suppress(AgentError, ChannelClosed, OSError, TimeoutError):
            await asyncio.wait_for(channel.call("cancel", {"target": rid}), OWN_REQUEST_WAIT)

    def _close_when_idle(self, sb: Live, idle: float) -> None:
        """Close ``sb`` once no request has used it for ``idle`` seconds (a run still going
        counts as use). A check that finds it closed or merged away just stops."""
        loop = asyncio.get_running_loop()
        sb.last_used = time.monotonic()  # a warm sandbox may have waited long in the pool

        def check() -> None:
            if self.live.get(sb.id) is not sb:
                return
            now = time.monotonic()
            if sb.lock.locked() or sb.record.state == "paused":
                sb.last_used = now
            if now - sb.last_used >= idle:
                self._idle_out(sb)
            else:
                loop.call_later(sb.last_used + idle - now, check)

        loop.call_later(idle, check)

    def _expire(self, sandbox_id: str) -> None:
        """A sandbox's timeout ran out: close it (stop() waits for closes under way)."""
        self._track(asyncio.get_running_loop().create_task(self._close_quietly(sandbox_id)))

    async def _close_quietly(self, sandbox_id: str) -> None:
        with contextlib.suppress(errors.EngineError):
            await self.close(sandbox_id)

    async def _watch(self, sb: Live, body: Body) -> None:
        """Mark the sandbox gone when its REPL's channel closes (the REPL died)."""
        await body.channel.closed.wait()
        if sb.body is body and self.live.get(sb.id) is sb:
            sb.record.state = "gone"
            self.records.put(sb.record)
            self.events.publish("gone", sb.record)

    # -------------------------------------------------------------------- close
    async def close(self, sandbox_id: str) -> None:
        if await self._close_stopped(sandbox_id):
            return
        sb = self.live.pop(sandbox_id, None)
        if sb is None:
            raise errors.SandboxNotFound()
        if sb.timer:
            sb.timer.cancel()
        left: list[Remains] = []
        try:
            await self._free_checkpoints(sandbox_id)
            left = await self._destroy_body(sb.body, keep_charged=len(sb.family.members) > 1)
        finally:  # even if a step failed (a broken channel): the family must not outlive it
            sb.record.state = "closed"
            self.records.mark_closed([sb.id])
            self.events.publish("close", sb.record)
            await self._leave_family(sb.family, sb.id, left)

    async def _leave_family(self, family: FamilyHandle, member: str,
                            left: list[Remains]) -> None:
        """``member`` (a sandbox, or a snapshot: engine.snapshots) is gone: what its body
        left charged stays on the family's account while others remain; the last one
        gone ends the family (its namespaces and whatever still runs in them)."""
        family.members.discard(member)
        self._leave_charged(family, left)
        if not family.members:
            await family.family.kill()
            family.room.free()

    def _retire(self, body: Body, family: FamilyHandle | None = None) -> None:
        """Destroy a body in the background (stop() waits for it); what it leaves charged
        (pages or files others share) stays on ``family``'s account, if given."""
        async def destroy() -> None:
            self._leave_charged(family, await self._destroy_body(body,
                                                                 keep_charged=bool(family)))
        self._track(asyncio.get_running_loop().create_task(destroy()))

    @staticmethod
    def _leave_charged(family: FamilyHandle | None, left: list[Remains]) -> None:
        """Put what a destroyed body left charged on its family's account, or let it go
        when there is no family left to hold it (engine.family_room)."""
        if family is not None and family.members:
            family.room.keep(*left)
        else:
            for remains in left:
                remains.remove()

    async def _check_room(self, sb: Live, what: str, adding: int = 0,
                          settle: bool = True) -> None:
        """Refuse ``what`` (a way for ``sb``'s family to grow, by ``adding`` sandboxes)
        past the family's number of sandboxes, or while it holds more memory or disk
        than its live sandboxes may (engine.family_room)."""
        if (count := len(sb.family.members) + adding) > self.config.max_family:
            raise errors.FamilyOverLimit(
                f"cannot {what}: the family would hold {count:,} sandboxes, past its limit "
                f"of {self.config.max_family:,} (BRANCHBOX_MAX_FAMILY)")
        if not sb.family.room.remains:
            return
        # A snapshot may hold what its sandbox did: it counts as a live one does.
        family = [cp for cp in self._checkpoints.values() if cp.record.family == sb.record.family]
        live = [m.body for sid in sb.family.members if (m := self.live.get(sid))]
        live += [cp.body for cp in family if cp.snapshot]
        kept = [cp.body for cp in family if not cp.snapshot]
        await sb.family.room.check(what, live, kept, self.store, settle)

    async def _destroy_body(self, body: Body, *, keep_charged: bool = False) -> list[Remains]:
        """Kill, disconnect and free a body; each step runs even if an earlier one failed.
        With ``keep_charged``, returns what others' pages and layers keep charged to its
        memory cgroup and volume (engine.family_room), for its family's account."""
        await self.net.release(body.key)  # first: it can no longer speak on the bridge
        self.keeper.drop([body.key])
        self._let_thaw(body)
        left: list[Remains] = []
        try:
            memory = await asyncio.to_thread(body.cgroup.remove, keep_charged)
            left += [memory] if memory is not None else []
        finally:
            try:
                if body.channel is not None:
                    await body.channel.close()
            finally:
                if keep_charged and body.layers.frozen_once:
                    with contextlib.suppress(OSError):  # no quota group: nothing counted
                        if group := self.store.charge_group(body.layers.volume):
                            left.append(VolumeRemains(group))
                self.layers.release(body.layers)
        return left

    async def update_network(self, sandbox_id: str, internet: bool | None = None,
                             network: dict | None = None) -> dict:
        """Change a sandbox's egress policy now (connections it has open included); fields
        not given keep their value. Its later fork children inherit the new one."""
        sb = self.get(sandbox_id)
        current = sb.record.meta.get("network") or self.net.policy_of(None, None)
        merged = {k: v for k, v in current.items() if k != "internet"}
        merged.update(network or {})
        policy = await self.net.resolve(self.net.policy_of(
            current["internet"] if internet is None else internet, merged))
        self.net.apply([sb.body.key], policy)
        sb.record.meta = {**sb.record.meta, "network": policy}
        self.records.put(sb.record)
        return policy

    # --------------------------------------------------------------------- calls
    async def _acquire(self, sb: Live, wait: float | None) -> None:
        sb.last_used = time.monotonic()  # runs, files, fork, merge: use, for the idle timeout
        try:
            await acquire(sb.lock, wait)
        except TimeoutError:
            raise errors.Conflict(
                f"sandbox {sb.id} is busy: its REPL is still running a "
                f"call after {wait:.0f} s; retry later"
            ) from None

    def _check_alive(self, sb: Live, *, paused_ok: bool = False) -> AgentChannel:
        if not paused_ok:
            refuse_paused(sb)
        if sb.record.state == "gone" or sb.body.channel.closed.is_set():
            raise errors.ReplGone(
                f"sandbox {sb.id}: {sb.body.stopped}" if sb.body.stopped else
                f"the REPL of sandbox {sb.id} is gone (it exited or was killed); close the sandbox")
        return sb.body.channel

    async def stream(
        self, sandbox_id: str, op: str, args: dict | None = None, payload: bytes = b""
    ) -> AsyncIterator[tuple[dict, bytes]]:
        """Events of one agent request, translated into engine errors."""
        sb = self.get(sandbox_id)
        sb.last_used = time.monotonic()
        locked = op not in _LOCK_FREE_OPS
        if locked:
            await self._acquire(sb, self.config.busy_wait)
        deadline = None
        try:
            channel = self._check_alive(sb)
            if op == "run_code":
                deadline = RunDeadline(sb.body, (args or {}).get("timeout"), self._track)
            events = until_gone(self.events.watch_run(sb.record, op, args,
                                                      channel.stream(op, args, payload)),
                                self.config.busy_wait if op in PROMPT_OPS else None)
            try:
                async for header, payload in events:
                    if header.get("ev") == "done":
                        header = {**header, "result": answers.checked(op, header.get("result"))}
                    yield header, payload
            finally:  # now, not when collected: an abandoned run is interrupted before unlock
                await events.aclose()
        except AgentError as exc:
            raise errors.AGENT_ERRORS.get(exc.kind, errors.EngineError)(exc.message) from None
        except (ChannelClosed, BrokenPipeError, ConnectionResetError):  # the REPL's end went
            # (a send to a REPL killed as the call began fails: a 500 before)
            if sb.body.stopped:
                await killed(sb.body)
                raise sb.body.stopped_as(f"sandbox {sandbox_id}: {sb.body.stopped}") from None
            raise self._repl_ended(sb, f"{op!r}") from None
        finally:
            if deadline is not None:
                deadline.cancel()
            sb.last_used = time.monotonic()  # the end of a long run is use, for idle
            if locked:
                self._unlock(sb)

    def _repl_ended(self, sb: Live, during: str) -> errors.EngineError:
        return repl_ended(sb, during, closed=self.live.get(sb.id) is not sb,
                          stopping=self._stopping)

    def _unlock(self, sb: Live) -> None:
        """Release ``sb``'s lock now, or once its REPL has finished the calls abandoned on
        it (engine.run_guard): until then the next caller is told the sandbox is busy."""
        if sb.body.channel is None or not sb.body.channel.orphans():
            sb.lock.release()
        else:
            self._track(asyncio.get_running_loop().create_task(
                release_when_quiet(sb.lock, sb.body)))

    def _track(self, task: asyncio.Task) -> None:
        """Keep a background task until it ends (stop() waits for them)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def call(
        self, sandbox_id: str, op: str, args: dict | None = None, payload: bytes = b""
    ) -> dict:
        result: dict = {}
        async for header, _ in self.stream(sandbox_id, op, args, payload):
            if header.get("ev") == "done":
                result = header.get("result") or {}
        return result

    async def list_dir(self, sandbox_id: str, path: str) -> AsyncIterator[list[dict]]:
        """The entries of directory ``path`` sorted by name, in batches (at least one,
        maybe empty), each checked as it comes: one directory of any size never holds
        the event loop (see ``agent.files.LIST_CHUNK``)."""
        listed = False
        async with contextlib.aclosing(self.stream(sandbox_id, "list", {"path": path})) as events:
            async for header, payload in events:  # closed at once if our caller stops
                if header.get("ev") == "chunk":
                    listed = True
                    yield listing.entries(payload)
                    await asyncio.sleep(0)  # batches already queued wait their turn
        if not listed:
            yield []

    async def write_file(
        self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes], mode: int | None = None
    ) -> dict:
        """Stream an upload into the sandbox frame by frame (never whole in memory)."""
        sb = self.get(sandbox_id)
        await self._acquire(sb, self.config.busy_wait)
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
            raise self._repl_ended(sb, "a write") from None
        finally:
            self._unlock(sb)

def _raise_fd_limit() -> None:
    """Every live sandbox holds a control socket in the daemon: a thousand children of
    one parent need more than the usual soft limit of 1024 fds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _usage(body: Body) -> dict:
    """What ``body`` uses now (files read only: safe off the event loop); {} for a body
    whose cgroup went away meanwhile (closed)."""
    cgroup = body.cgroup
    try:
        return {
            "memory_bytes": cgroup.memory_bytes(),
            "pids": cgroup.pids_current(),
            "cpu_seconds": cgroup.cpu_seconds(),
            "host_pids": cgroup.pids(),
            # > 0 when the REPL's heap is on 2 MiB pages (agent/huge_heap.py)
            "repl_anon_huge_bytes": smaps.rollup_kib(cgroup.leaf_pids("repl"),
                                                     ("AnonHugePages",)) << 10,
        }
    except (OSError, ValueError, IndexError):
        return {}
