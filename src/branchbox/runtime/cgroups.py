"""One cgroup per sandbox, on cgroup v1 (this machine) or v2 (most current hosts).

Layout, the same on both versions::

    branchbox/<sandbox id>/         limits: memory, pids, cpu
    branchbox/<sandbox id>/repl     the REPL process
    branchbox/<sandbox id>/cmds     Q's init and every command the sandbox runs

Two leaves because fork freezes the sandbox's background commands while the
REPL (which is serving the fork) keeps running, and cgroup v2 allows
processes only in leaves. Processes join by writing "0" to a ``cgroup.procs``
fd that the daemon opened: the kernel checks the opener's credentials, so a
process inside the user namespace can place itself, and only where the daemon
allowed it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from branchbox.agent import sysc
from branchbox.runtime import procfs

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
LEAVES = ("repl", "cmds")
# Socket buffers a sandbox may hold on cgroup v1 (below its memory limit): a few dozen
# busy connections' worth, a small share of the host's tcp_mem that every sandbox and
# the host itself draw on.
SOCKET_BUFFERS = 64 << 20
# How long freeze() waits for the kernel to report a cgroup frozen. Read at each call.
FREEZE_TIMEOUT = 2.0


class FreezeFailed(RuntimeError):
    """A cgroup did not reach the frozen state in time: some task in it cannot be frozen
    (it is stuck in the kernel, e.g. retrying a userfaultfd fault). The cgroup was put
    back to thawed, so the caller holds no half-frozen sandbox."""


class CgroupUnavailable(RuntimeError):
    """The host has neither a usable cgroup v2 nor the v1 controllers we need."""


def detect_version(root: Path = CGROUP_ROOT) -> int:
    """2 if the unified hierarchy has memory and pids, else 1 if v1 has them all."""
    controllers = root / "cgroup.controllers"
    if controllers.exists():
        have = set(controllers.read_text().split())
        if {"memory", "pids"} <= have:
            return 2
    missing = [c for c in V1_CONTROLLERS if not (root / c / "cgroup.procs").exists()]
    if not missing:
        return 1
    raise CgroupUnavailable(
        f"no usable cgroups under {root}: cgroup v2 lacks memory/pids controllers and "
        f"cgroup v1 lacks {', '.join(missing)}"
    )


HOST_PIDS_KEPT = 4  # of kernel.pid_max, the host keeps this fraction (1/4) for itself
HOST_MEMORY_KEPT = (2 << 30, 10, 4)  # max(2 GiB, 1/10) of RAM, never more than 1/4


def bound_all_sandboxes(root: Path = CGROUP_ROOT) -> dict[str, int | str]:
    """Bound what every sandbox of this host may take together, in the ``branchbox``
    cgroup all of theirs are under: processes to 3/4 of ``kernel.pid_max`` and memory to
    all of RAM but max(2 GiB, 1/10) (at most 1/4 of it). Each sandbox has its own limits
    (1,024 processes, 4 GiB by default), but nothing bounded their sum: a family of 31
    fork children reached the kernel's 32,768 pids and nothing on the host could fork,
    and four 2 GiB children on an 8 GiB host would leave its OOM killer to choose among
    the host's processes. Returns each bound set, or why it could not be (a start goes
    on without it: sandboxes that survived a restart may already hold more, EBUSY)."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    page = os.sysconf("SC_PAGE_SIZE")
    ram = page * os.sysconf("SC_PHYS_PAGES")
    least, tenth, quarter = HOST_MEMORY_KEPT
    kept = min(max(least, ram // tenth), ram // quarter)
    bounds = {"pids": pid_max - pid_max // HOST_PIDS_KEPT,
              "memory": (ram - kept) // page * page}  # as the kernel keeps it
    if detect_version(root) == 2:
        top = root / "branchbox"
        subtree = root / "cgroup.subtree_control"
        if {"memory", "pids"} - set(subtree.read_text().split()):
            subtree.write_text("+memory +pids +cpu")
        top.mkdir(exist_ok=True)
        files = {"pids": top / "pids.max", "memory": top / "memory.max"}
    else:
        for controller in ("pids", "memory"):
            (root / controller / "branchbox").mkdir(exist_ok=True)
        files = {"pids": root / "pids" / "branchbox" / "pids.max",
                 "memory": root / "memory" / "branchbox" / "memory.limit_in_bytes"}
    done: dict[str, int | str] = {}
    for name, path in files.items():
        try:
            path.write_text(str(bounds[name]))
            done[name] = bounds[name]
        except OSError as exc:
            done[name] = f"not set ({exc.strerror})"
    return done


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    pids: int
    cpu_weight: int = 100  # v2 scale 1..10000; mapped onto v1 shares


@dataclass
class SandboxCgroup:
    """The cgroup directories of one sandbox (one per v1 hierarchy, or one on v2)."""

    version: int
    dirs: list[Path]

    @staticmethod
    def _paths(group: str, name: str, root: Path) -> tuple[int, list[Path]]:
        version = detect_version(root)
        if version == 2:
            return version, [root / "branchbox" / group / name]
        return version, [root / c / "branchbox" / group / name for c in V1_CONTROLLERS]

    @classmethod
    def create(
        cls, group: str, name: str, limits: Limits, root: Path = CGROUP_ROOT
    ) -> SandboxCgroup:
        """Make ``branchbox/<group>/<name>`` with its two leaves and apply ``limits``."""
        version, dirs = cls._paths(group, name, root)
        if version == 2:
            # v2 hands controllers down one level at a time, from the root to us.
            level = root
            for part in ("branchbox", group, name):
                subtree = level / "cgroup.subtree_control"
                if "memory" not in subtree.read_text():
                    subtree.write_text("+memory +pids +cpu")
                level = level / part
                level.mkdir(exist_ok=level != dirs[0])
        else:
            for d in dirs:
                d.mkdir(parents=True)
        cg = cls(version, dirs)
        for d in cg._split_dirs():
            for leaf in LEAVES:
                (d / leaf).mkdir()
        cg.apply(limits)
        return cg

    @classmethod
    def leftovers(cls, group: str, root: Path = CGROUP_ROOT) -> list[SandboxCgroup]:
        """Cgroups an earlier daemon of ``group`` left behind (to kill and remove)."""
        version, dirs = cls._paths(group, "x", root)
        names = {
            p.name for d in dirs if d.parent.exists() for p in d.parent.iterdir() if p.is_dir()
        }
        found = []
        for name in sorted(names):
            found.append(cls(version, [d for d in cls._paths(group, name, root)[1] if d.exists()]))
        return found

    @staticmethod
    def remove_group(group: str, root: Path = CGROUP_ROOT) -> None:
        """Remove the (empty) group directories once the daemon stops."""
        for d in SandboxCgroup._paths(group, "x", root)[1]:
            with contextlib.suppress(OSError):
                d.parent.rmdir()

    @property
    def name(self) -> str:
        """The sandbox body's key: its directories' name ("" once removed)."""
        return self.dirs[0].name if self.dirs else ""

    def _file(self, controller: str, name: str) -> Path:
        if self.version == 2 and self.dirs:
            return self.dirs[0] / name
        # By name, not position: a leftover of a daemon killed while making it may have
        # some controllers' directories and not others.
        for d in self.dirs:
            if d.parts[-4] == controller:  # <root>/<controller>/branchbox/<group>/<name>
                return d / name
        raise FileNotFoundError(f"sandbox cgroup {self.name} has no {controller} directory")

    def apply(self, limits: Limits) -> None:
        if self.version == 2:
            self._file("memory", "memory.max").write_text(str(limits.memory_bytes))
            self._file("memory", "memory.swap.max").write_text("0")
            self._file("pids", "pids.max").write_text(str(limits.pids))
            self._file("cpu", "cpu.weight").write_text(str(limits.cpu_weight))
        else:
            self._file("memory", "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            with contextlib.suppress(OSError):  # absent when the host has no swap accounting
                self._file("memory", "memory.memsw.limit_in_bytes").write_text(
                    str(limits.memory_bytes)
                )
            # v1 charges socket buffers (TCP and UDP) to a cgroup only once this is set, and
            # then apart from memory.limit_in_bytes: without it one sandbox held 2.2 GiB of
            # TCP and 2.8 GiB of UDP buffers, the host's whole tcp_mem, in no limit (v2
            # charges them to memory.max). Absent on a kernel without kmem accounting.
            with contextlib.suppress(OSError):
                self._file("memory", "memory.kmem.tcp.limit_in_bytes").write_text(
                    str(min(limits.memory_bytes, SOCKET_BUFFERS)))
            self._file("pids", "pids.max").write_text(str(limits.pids))
            self._file("cpu", "cpu.shares").write_text(str(max(2, limits.cpu_weight * 1024 // 100)))

    def _split_dirs(self) -> list[Path]:
        """The directories that have the repl/cmds leaves: the one v2 directory, or on v1
        only the freezer's (the other controllers are per sandbox, not per leaf)."""
        if self.version == 2:
            return self.dirs
        return [d for d in self.dirs if d.parts[-4] == "freezer"]

    def join_fds(self, leaf: str) -> list[int]:
        """Write-only cgroup.procs fds that place a process; writing "0" moves the writer.

        On v1, processes of both leaves share the sandbox's memory/pids/cpu cgroups, which
        a command inherits from the REPL that starts it, so a command joins the freezer
        leaf alone: one move per command instead of four.
        """
        split = self._split_dirs()
        targets = [f"{d}/{leaf}/cgroup.procs" for d in split]
        if self.version == 1 and leaf == "repl":
            targets += [f"{d}/cgroup.procs" for d in self.dirs if d not in split]
        # Strings, not Path arithmetic: a fork makes these per child, on its path.
        return [os.open(t, os.O_WRONLY | os.O_CLOEXEC) for t in targets]

    def pids(self) -> list[int]:
        """Every process in the sandbox: in each hierarchy's directory and its leaves (a
        process that is joining is in some hierarchies before it is in all). Read with
        plain os calls: a kill and a remove read them again and again, in worker threads
        that share the daemon's GIL."""
        found: set[int] = set()
        for d in map(str, self.dirs):
            for where in (d, *(f"{d}/{leaf}" for leaf in LEAVES)):
                with contextlib.suppress(FileNotFoundError):
                    found.update(map(int, _read_all(where + "/cgroup.procs").split()))
        return sorted(found)

    def leaf_pids(self, leaf: str) -> list[int]:
        """The processes in one leaf: one file read, where :meth:`pids` reads every
        controller's (twelve on v1). The REPL alone sits in "repl"."""
        with contextlib.suppress(FileNotFoundError, IndexError):  # removed: no dirs
            return [int(p) for p in
                    _read_all(f"{self._split_dirs()[0]}/{leaf}/cgroup.procs").split()]
        return []

    def freeze(self, leaf: str | None = None, frozen: bool = True) -> None:
        """Freeze (or thaw) the whole sandbox or one leaf; returns once it took effect.

        Raises :class:`FreezeFailed` when freezing did not take effect within
        :data:`FREEZE_TIMEOUT` seconds, after thawing the target again: a caller that
        needs a frozen instant (fork's snapshot, commit's read) must not go on with
        some of the sandbox's tasks still running, and must not leave the rest frozen
        either. Thawing never raises (it is what cleanup paths do).
        """
        if not self.dirs:  # removed (the sandbox was closed meanwhile): nothing to do
            return
        if self._set_frozen(leaf, frozen) or not frozen:
            return
        self._set_frozen(leaf, False)
        where = f"the {leaf} leaf of " if leaf else ""
        raise FreezeFailed(f"{where}the sandbox did not freeze within {FREEZE_TIMEOUT:g} s "
                           "(a process in it cannot be frozen)")

    def _set_frozen(self, leaf: str | None, frozen: bool) -> bool:
        """Write the freezer state and wait for it; whether the kernel reported it in time.

        A thaw is not waited for on v1 (THAWED takes effect at once); on v2 a thawed
        leaf whose parent is frozen never reports "frozen 0", so its wait is the
        timeout's and its answer is ignored by :meth:`freeze`.
        """
        # Plain os calls, as in pids(): kills and forks freeze and thaw all the time.
        if self.version == 2:
            target = f"{self.dirs[0]}/{leaf}" if leaf else str(self.dirs[0])
            _write(target + "/cgroup.freeze", b"1" if frozen else b"0")
            want = b"frozen 1" if frozen else b"frozen 0"
            return _until(lambda: want in _read_all(target + "/cgroup.events"))
        base = str(self._file("freezer", ""))
        state = (f"{base}/{leaf}" if leaf else base) + "/freezer.state"
        _write(state, b"FROZEN" if frozen else b"THAWED")
        return not frozen or _until(lambda: _read_all(state).strip() == b"FROZEN")

    def thaw(self) -> None:
        """Thaw the sandbox and each of its leaves.

        The leaves too: on v1 a leaf frozen by itself (fork freezes the cmds leaf, and its
        daemon may die before thawing it) keeps its own state when its parent thaws.
        """
        for leaf in (None, *LEAVES):
            with contextlib.suppress(FileNotFoundError):
                self.freeze(leaf, frozen=False)

    def memory_bytes(self) -> int:
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        return int(self._file("memory", name).read_text())

    def pinned_bytes(self) -> int:
        """What the sandbox's cgroup holds that reclaim cannot free (see ``_pinned``)."""
        return _pinned(self.version, self._file("memory", ""))

    def held_bytes(self) -> int:
        """All the sandbox's cgroup holds but page cache (see ``_held``)."""
        return _held(self.version, self._file("memory", ""))

    def memory_limit(self) -> int:
        """The most memory the sandbox may hold (its limit, as the kernel has it)."""
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        text = self._file("memory", name).read_text().strip()
        return 1 << 62 if text == "max" else int(text)

    def memory_cache_bytes(self) -> int:
        """The page cache charged to the sandbox (part of :meth:`memory_bytes`): files it
        read or wrote, which the kernel takes back under pressure."""
        key = "file" if self.version == 2 else "total_cache"
        for line in self._file("memory", "memory.stat").read_text().splitlines():
            field, _, value = line.partition(" ")
            if field == key:
                return int(value)
        return 0

    def cpu_seconds(self) -> float:
        """CPU time the sandbox used. v2 counts all that ever ran in it; v1's cpu controller
        has no counter without cpuacct (a hierarchy of its own), so there it is the time of
        the processes alive now and of the children they reaped."""
        if self.version == 2:
            for line in self._file("cpu", "cpu.stat").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "usage_usec":
                    return int(value) / 1e6
            return 0.0
        # Every process of the sandbox is in each hierarchy: one is 3 reads instead of 12.
        return procfs.cpu_seconds(SandboxCgroup(self.version, self.dirs[:1]).pids())

    def oom_kills(self) -> int:
        """How many of the sandbox's processes the kernel killed for its memory limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in self._file("memory", name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def limit_reached(self) -> bool:
        """Whether the sandbox's memory ever reached its own limit (an OOM kill without
        it came from a bound above: every sandbox's together). On v1 its high-water
        mark within a large page of the limit: v1 counts no failed charge once a swap
        limit is set (``memory.failcnt`` stays 0 through an OOM kill)."""
        if self.version == 2:
            for line in self._file("memory", "memory.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value) > 0
            return False
        peak = int(self._file("memory", "memory.max_usage_in_bytes").read_text())
        return peak >= self.memory_limit() - (2 << 20)

    def set_oom_adj(self, adj: int) -> None:
        """Set the ``oom_score_adj`` of every process in the sandbox now (those they fork
        inherit it). Each through its /proc directory, opened first and checked to be in
        this cgroup still: a pid that exited and was reused by a host process is left
        alone (the directory of an exited process answers nothing)."""
        for pid in self.pids():
            try:
                proc = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                lines = _read_at(proc, "cgroup").splitlines()
                if not any(self.name in line.split(":", 2)[-1].split("/") for line in lines):
                    continue
                fd = os.open("oom_score_adj", os.O_WRONLY | os.O_CLOEXEC, dir_fd=proc)
                try:
                    os.write(fd, str(adj).encode())
                finally:
                    os.close(fd)
            except OSError:  # exited meanwhile
                continue
            finally:
                os.close(proc)

    def pids_current(self) -> int:
        return int(self._file("pids", "pids.current").read_text())

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL everything in the sandbox, including what is forking right now, and
        return once it has all exited (or ``timeout`` has passed)."""
        if not self.dirs:
            return
        self._least_cpu()
        if self.version == 2:
            (self.dirs[0] / "cgroup.kill").write_text("1")
            _wait_exited(_pidfds(self.pids()), time.monotonic() + timeout)
            return
        # Frozen processes cannot fork between our read of cgroup.procs and the kill.
        # A sandbox holding a task the freezer cannot stop is killed without that
        # guarantee: again and again until nothing is left or the timeout.
        with contextlib.suppress(FreezeFailed, FileNotFoundError):  # none: a partial leftover
            self.freeze()
        deadline = time.monotonic() + timeout
        pidfds = _pidfds(self.pids())
        _sigkill_fds(pidfds)
        self.thaw()  # frozen processes cannot die
        while pidfds and _wait_exited(pidfds, deadline):  # exited: out of the cgroup
            pidfds = _pidfds(self.pids())  # joined since the look (or forked, unfrozen)
            _sigkill_fds(pidfds)

    def _least_cpu(self) -> None:
        """The least CPU weight there is, for what is about to die: a killed process frees
        its memory as it exits (a second or more of kernel time for gigabytes), which
        must not hold up the live sandboxes (a restore or a merge goes on at once in the
        body that replaced this one)."""
        with contextlib.suppress(OSError):
            if self.version == 2:
                self._file("cpu", "cpu.weight").write_text("1")
            else:
                self._file("cpu", "cpu.shares").write_text("2")

    def remove(self, keep_charged: bool = False) -> ChargedRemains | None:
        """Kill what is left and delete the directories (idempotent).

        A process may join after the kill looked: a fork child enters its cgroups itself,
        through the fds it was handed (a fork that failed half-way is cleaned up while its
        first children start). An rmdir that finds one busy kills it too.

        With ``keep_charged``, the memory directory stays (and is returned) when pages
        no reclaim can free are still charged to it: the kernel charges a page to the
        cgroup that first touched it, for as long as the page lives, so a closed
        parent's heap that its fork children still map (or a replaced body's, that a
        checkpoint or a merge winner maps) stays charged here and to no live sandbox.
        A removed directory would hide those charges from everyone but its ancestors."""
        self.kill()

        def kill_late() -> None:
            _sigkill(self.pids())

        kept = None
        if keep_charged and self.dirs:
            with contextlib.suppress(OSError):  # a partial leftover: nothing to keep
                remains = ChargedRemains(self.version, self._file("memory", ""))
                kept = remains if remains.pinned() else None
        for d in self.dirs:
            for leaf in LEAVES:
                with contextlib.suppress(FileNotFoundError):
                    _rmdir_retry(d / leaf, kill_late)
            if kept is None or d != kept.path:
                with contextlib.suppress(FileNotFoundError):
                    _rmdir_retry(d, kill_late)
        self.dirs = []
        return kept


@dataclass(frozen=True, eq=False)  # one per removed body: by identity
class ChargedRemains:
    """The memory cgroup of a removed sandbox, kept while pages live on charged to it
    (:meth:`SandboxCgroup.remove`): what its family still holds beyond its live
    sandboxes' own cgroups."""

    version: int
    path: Path

    def pinned(self) -> int:
        return _pinned(self.version, self.path)

    def held(self) -> int:
        return _held(self.version, self.path)

    def remove(self) -> None:
        """Delete the directory (the kernel keeps what is still charged, unnamed)."""
        with contextlib.suppress(FileNotFoundError):
            _rmdir_retry(self.path, lambda: None)


class GroupMemory:
    """This daemon's group in the memory hierarchy (``branchbox/<group>``, every sandbox
    of this daemon under it): its bound, and what its sandboxes hold together."""

    def __init__(self, group: str, root: Path = CGROUP_ROOT) -> None:
        self.version = detect_version(root)
        self.path = (root / "branchbox" / group if self.version == 2
                     else root / "memory" / "branchbox" / group)

    def bound(self, limit: int) -> int:
        """Set the group's memory limit to ``limit`` (not above its parent's, the bound of
        every sandbox on the host); returns the limit in force (an EBUSY, sandboxes of
        an earlier daemon holding more, leaves the one before)."""
        if self.version == 2:  # controllers are handed down a level at a time
            subtree = self.path.parent / "cgroup.subtree_control"
            if "memory" not in subtree.read_text():
                subtree.write_text("+memory +pids +cpu")
        self.path.mkdir(parents=True, exist_ok=True)
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        with contextlib.suppress(OSError):
            (self.path / name).write_text(str(limit))
        text = (self.path / name).read_text().strip()
        parent = (self.path.parent / name).read_text().strip()
        return min(1 << 62 if t == "max" else int(t) for t in (text, parent))

    def usage(self) -> int:
        """Everything charged to the group, page cache included."""
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        return int(_read_all(f"{self.path}/{name}"))

    def held(self) -> int:
        """All the group holds but page cache (see ``_held``)."""
        return _held(self.version, self.path)

    def reclaim(self) -> None:
        """Have the kernel take back what it can of the group's memory (page cache, and
        the dentry and inode caches that v1 counts in its usage without saying how much
        of it they are), as it would at the group's limit; blocks while it does. On v2
        the held figure leaves reclaimable slabs out already: nothing to do."""
        if self.version == 1:
            (self.path / "memory.force_empty").write_text("0")


def thaw_leftovers(group: str, root: Path = CGROUP_ROOT, skip: set[str] = frozenset()) -> int:
    """Thaw every sandbox cgroup of ``group`` an earlier daemon left but those named in
    ``skip`` (frozen on purpose); return how many.

    A daemon killed inside a fork or a commit leaves that sandbox frozen. Thawing kills
    nothing, so a daemon that re-attaches to its predecessor's sandboxes can call this
    before anything else (runtime.thaw_guard calls it the moment a daemon dies).
    """
    leftovers = [cg for cg in SandboxCgroup.leftovers(group, root) if cg.name not in skip]
    for cg in leftovers:
        cg.thaw()
    return len(leftovers)


def favor_dynamic_moves(mountpoint: Path) -> Callable[[], None] | None:
    """Make moving processes between cgroups cheap while the daemon runs; returns the undo.

    Every move takes the kernel's global cgroup_threadgroup_rwsem for writing,
    which by default waits for an RCU grace period: 5-15 ms on this kind of
    machine, paid by every sandbox and every fork child as it joins its
    cgroup. A cgroup v1 hierarchy mounted with ``favordynmods`` switches that
    lock to its writer-friendly mode for the whole host (moves ~0.05 ms,
    fork/exit pay a little more) for as long as the hierarchy exists, so the
    daemon mounts a private, controller-less one. On cgroup v2 the option
    lives on the one shared mount; we leave the host's choice alone there.
    Returns None when the kernel does not offer the option.
    """
    if detect_version() != 1:
        return None
    mountpoint.mkdir(parents=True, exist_ok=True)
    name = "name=bb-" + hashlib.sha256(str(mountpoint).encode()).hexdigest()[:12]
    # A daemon killed with -9 never unmounted its hierarchy; mounting it again is EBUSY
    # (measured), so the mount it left is adopted, and unmounted by this daemon's undo.
    if not _cgroup_mounted_at(mountpoint, name):
        try:
            sysc.mount("cgroup", str(mountpoint), "cgroup", 0, f"none,{name},favordynmods")
        except OSError:
            return None

    def undo() -> None:
        while _cgroup_mounted_at(mountpoint, name):
            try:
                sysc.umount2(str(mountpoint), sysc.MNT_DETACH)
            except OSError:
                return

    return undo


def _cgroup_mounted_at(mountpoint: Path, name: str,
                       mountinfo: Path = Path("/proc/self/mountinfo")) -> bool:
    """Whether the v1 hierarchy ``name`` (``name=...``) is mounted at ``mountpoint``."""
    where = os.fsencode(os.path.realpath(mountpoint))
    for char, escaped in ((b"\\", b"\\134"), (b" ", b"\\040"), (b"\t", b"\\011"),
                          (b"\n", b"\\012")):
        where = where.replace(char, escaped)  # as mountinfo writes them
    for line in mountinfo.read_bytes().splitlines():
        fields = line.split(b" ")
        sep = fields.index(b"-")
        if (fields[4] == where and fields[sep + 1] == b"cgroup"
                and name.encode() in fields[sep + 3].split(b",")):
            return True
    return False


def _pinned(version: int, memory_dir: Path) -> int:
    """Bytes charged to a memory cgroup that no reclaim can free without swap: anonymous
    and shared memory (page cache of files is reclaimed under pressure)."""
    keys = (b"anon", b"shmem") if version == 2 else (b"total_rss", b"total_shmem")
    total = 0
    for line in _read_all(f"{memory_dir}/memory.stat").splitlines():
        key, _, value = line.partition(b" ")
        if key in keys:
            total += int(value)
    return total


def _held(version: int, memory_dir: Path) -> int:
    """Bytes charged to a memory cgroup but its page cache of files: anonymous and shared
    memory and the kernel's (page tables, sockets, slabs), which v1 counts only as part
    of the usage (a sandbox faulting in the zero page across a sparse mapping held 1.2
    GiB of page tables and 11 MiB of anonymous memory)."""
    if version == 2:
        usage, drop, keep = b"memory.current", (b"file", b"slab_reclaimable"), b"shmem"
    else:
        usage, drop, keep = b"memory.usage_in_bytes", (b"total_cache",), b"total_shmem"
    held = int(_read_all(f"{memory_dir}/{usage.decode()}"))
    for line in _read_all(f"{memory_dir}/memory.stat").splitlines():
        key, _, value = line.partition(b" ")
        if key in drop:
            held -= int(value)
        elif key == keep:  # in the cache, but nothing drops it without swap
            held += int(value)
    return max(held, 0)


def _read_at(dirfd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        return os.read(fd, 65536).decode(errors="replace")
    finally:
        os.close(fd)


def _read_all(path: str) -> bytes:
    """The whole file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _until(done: Callable[[], bool]) -> bool:
    """Whether ``done()`` came true within :data:`FREEZE_TIMEOUT` seconds, asked again
    after waits that double from 20 µs to 1 ms. A freeze usually takes effect within
    microseconds (its tasks need a CPU to stop on), and forks wait for it: a fixed
    0.5 ms poll made a fork wait ~0.5 ms longer than the kernel did."""
    deadline = time.monotonic() + FREEZE_TIMEOUT
    pause = 0.00002
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.001)
    return True


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _pidfds(pids: list[int]) -> list[int]:
    """Pidfds of those of ``pids`` still running: a kill through one, and the wait for
    its exit, reach that very process even if its pid is reused meanwhile."""
    fds = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds.append(os.pidfd_open(pid))
    return fds


def _sigkill_fds(pidfds: list[int]) -> None:
    for fd in pidfds:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)


def _wait_exited(pidfds: list[int], deadline: float) -> bool:
    """Wait (without polling the cgroup) until every process of ``pidfds`` has exited,
    or ``deadline``; whether they all did. Closes the fds."""
    waiting = select.poll()
    for fd in pidfds:
        waiting.register(fd, select.POLLIN)
    left = set(pidfds)
    try:
        while left and (wait := deadline - time.monotonic()) > 0:
            for fd, _ in waiting.poll(wait * 1000):
                waiting.unregister(fd)
                left.discard(fd)
        return not left
    finally:
        for fd in pidfds:
            os.close(fd)


def _sigkill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _rmdir_retry(path: Path, kill_late: Callable[[], None]) -> None:
    """rmdir a cgroup; the kernel says EBUSY for a moment after its last task exits, and
    for as long as a task that joined late lives (``kill_late`` ends those)."""
    for _ in range(200):
        try:
            path.rmdir()
            return
        except OSError as exc:
            if exc.errno != 16:  # EBUSY
                raise
            kill_late()
            time.sleep(0.005)
    path.rmdir()
