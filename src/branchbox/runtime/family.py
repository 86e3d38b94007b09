"""Daemon side of starting a family (see ``agent.launching`` for the process side).

Launchers are forked by the zygote, a fresh interpreter (``-I -S``: no site, no
environment) the daemon starts once and again if it dies, or by an image's
template (:class:`Template`), which the zygote starts. A launcher inherits
nothing from the daemon but the fds it is sent. The kernel asks the writer of a
user namespace's id maps to be root in the parent namespace: for a zygote's
family that is the daemon itself; for a template's, the template's map writer
(the family's namespace is a child of the template's), and the daemon checks
what it wrote. Each family gets a host id range of its own (the caller
allocates it, see engine.idranges): ``uid_base``.. for ids 0.. inside.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from branchbox.agent import entry, huge_heap
from branchbox.runtime import procfs
from branchbox.runtime.channel import AgentChannel
from branchbox.runtime.procfs import start_time
from branchbox.storage.idmap import UID_COUNT, in_template

_SRC = str(Path(__file__).resolve().parents[2])
_BOOT = (
    "import sys; sys.path.insert(0, {src!r}); "
    "from branchbox.runtime.family_init import serve; serve()"
)


KILL_WAIT = 5.0
"""Seconds a launcher has to end its family on SIGTERM before it is SIGKILLed."""
MAKE_TIMEOUT = 10.0
"""Seconds a launcher has to answer a request for network namespaces."""
log = logging.getLogger("branchbox.runtime")


class SpawnError(RuntimeError):
    """The family or its first sandbox could not be started; the message says why."""


@dataclass
class Family:
    """A running family: its launcher (kill it and the whole family dies).

    The launcher is held by a pidfd, so a daemon that did not start it (a later one,
    re-attaching after a restart: the launcher outlives the daemon) holds it the same
    way. No launcher is the daemon's child: the zygote reaps those it forked, the
    host's init those of a zygote gone with an earlier daemon. ``on_exit`` runs once,
    after the launcher is gone: the owner of the family's id range lets go of it there
    (no process of the family runs in it any more).
    """

    pid: int
    pidfd: int
    started: int  # the launcher's start time: (pid, started) names it in records
    on_exit: Callable[[], None] | None = None
    # The launcher makes network namespaces of the family through it (family_init); a
    # family re-attached after a restart has none (its launcher may predate it).
    netns_maker: socket.socket | None = None
    _making: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def ident(self) -> tuple[int, int]:
        return self.pid, self.started

    async def make_namespaces(self, n: int) -> list[int]:
        """``n`` network namespaces owned by the family's user namespace (fds; fewer if
        the launcher could not make them all). OSError if it cannot be asked."""
        if self.netns_maker is None:
            raise OSError("this family's launcher makes no namespaces")
        async with self._making:
            job = asyncio.ensure_future(asyncio.to_thread(self._ask, self.netns_maker, n))
            try:
                return await asyncio.shield(job)
            except asyncio.CancelledError:  # the answer still comes: its fds are closed then
                job.add_done_callback(_close_made)
                raise

    @staticmethod
    def _ask(conn: socket.socket, n: int) -> list[int]:
        conn.send(b"%d" % n)
        data, fds, _, _ = socket.recv_fds(conn, 16, n)
        if not data:
            raise OSError("the launcher is gone")
        return fds

    @classmethod
    def adopt(cls, pid: int, started: int) -> Family | None:
        """The launcher an earlier daemon recorded, if that very process still runs."""
        try:
            pidfd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            return None
        try:  # checked after the pidfd is taken: it cannot be another process's since
            if start_time(pid) == started:
                return cls(pid, pidfd, started)
        except (OSError, ValueError, IndexError):
            pass
        os.close(pidfd)
        return None

    async def kill(self) -> None:
        """End the family: SIGTERM has the launcher kill the family's init and reap it,
        then exit; SIGKILL if it has not within :data:`KILL_WAIT`."""
        if self.pidfd < 0:
            return
        for signo in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signo)
            try:
                await asyncio.wait_for(_readable(self.pidfd), KILL_WAIT)
                break
            except TimeoutError:
                log.warning("family launcher %d still runs %g s after signal %d", self.pid,
                            KILL_WAIT, signo)
        os.close(self.pidfd)
        self.pidfd = -1
        if self.netns_maker is not None:
            self.netns_maker.close()
            self.netns_maker = None
        done, self.on_exit = self.on_exit, None
        if done is not None:
            done()


def _close_made(job: asyncio.Future) -> None:
    if not job.cancelled() and job.exception() is None:
        for fd in job.result():
            os.close(fd)


class _Forker:
    """What forks launchers on the daemon's request, one request at a time: the zygote or
    a template (``agent.launching.serve``)."""

    in_process = False  # its launchers' REPL serves in the forked interpreter (no exec)

    def __init__(self) -> None:
        self._lock = asyncio.Lock()  # requests wait their turn here, not in threads

    async def launch(self, spec: dict, fds: list[int]) -> tuple[int, int]:
        """Fork a launcher running ``spec``, handing it ``fds`` (which the caller still
        closes); its pid and a pidfd. A launch once sent completes even if the caller is
        cancelled, and its launcher is then killed: none is left unrecorded."""
        async with self._lock:
            job = asyncio.ensure_future(asyncio.to_thread(self._request, spec, fds))
            try:
                return await asyncio.shield(job)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    _, pidfd = await job
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    os.close(pidfd)
                raise

    def _request(self, spec: dict, fds: list[int]) -> tuple[int, int]:
        raise NotImplementedError

    def owner(self, uid_base: int) -> int:
        """The ids a launcher takes before its family's user namespace, to own it: the
        family's own (its host ids from the zygote, where the family's namespace is a
        child of the host's). The kernel counts what a user namespace's processes hold
        (namespaces, inotify instances, pending signals, message queues) against its
        owner in the parent namespace too: owned by root, every family drew on the
        host root's budgets, and one sandbox that took 96,365 UTS namespaces, all 128
        inotify instances or every POSIX timer left the host's root without any."""
        return uid_base

    async def write_id_maps(self, pid: int, uid_base: int) -> None:
        """Map the ids 0..65535 of launcher ``pid``'s new user namespace onto host range
        ``uid_base``.."""
        _write_id_maps(pid, f"0 {uid_base} {UID_COUNT}\n")


def _ask(conn: socket.socket, message: bytes, fds: list[int]) -> tuple[int, int]:
    """One launch request over ``conn``: the launcher's pid and pidfd."""
    socket.send_fds(conn, [message], fds)
    msg, got, _, _ = socket.recv_fds(conn, 4096, 1)
    if not msg:
        for fd in got:
            os.close(fd)
        raise EOFError("hung up")
    try:
        reply = json.loads(msg)
        if "error" in reply:
            raise SpawnError(str(reply["error"]))
        if len(got) != 1:
            raise SpawnError("no pidfd came with the launcher's pid")
        return int(reply["pid"]), got[0]
    except (ValueError, TypeError, KeyError) as exc:
        for fd in got:
            os.close(fd)
        raise SpawnError(f"a malformed answer to a launch: {exc}") from None
    except SpawnError:
        for fd in got:
            os.close(fd)
        raise


class Zygote(_Forker):
    """The daemon's end of the zygote (``family_init.serve``): started on first use, and
    again if it died. Closing it ends the zygote, not the families it started."""

    def __init__(self, log_path: Path) -> None:
        super().__init__()
        self._log_path = log_path
        self._proc: subprocess.Popen | None = None
        self._conn: socket.socket | None = None
        self._guard = threading.Lock()  # one request, or close, at a time

    @property
    def pid(self) -> int | None:
        """The running zygote's pid, if one runs."""
        return self._proc.pid if self._proc is not None else None

    def _request(self, spec: dict, fds: list[int]) -> tuple[int, int]:
        message = json.dumps({"spec": spec, "fds": fds}).encode()
        with self._guard:
            if self._proc is None or self._proc.poll() is not None:
                self._close()
                self._start()
            try:
                try:
                    return _ask(self._conn, message, fds)
                except ConnectionError:  # it died since: it never got the request; a new one does
                    self._close()
                    self._start()
                    return _ask(self._conn, message, fds)
            except (OSError, EOFError) as exc:  # one that does not answer is replaced next time
                self._close()
                raise SpawnError(f"the zygote did not answer: {exc} (see {self._log_path})"
                                 ) from None

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with theirs, open(self._log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _BOOT.format(src=_SRC),
                     str(theirs.fileno())],
                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=log,
                    stderr=log, start_new_session=True,  # no terminal's Ctrl-C reaches it
                    env=_launcher_env())
        except BaseException:
            ours.close()
            raise
        ours.settimeout(30)
        # A request is one datagram: room for a spec with the largest env a create takes.
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        self._conn = ours

    def close(self) -> None:
        """Hang up and reap the zygote (it exits on the hang-up; killed if it does not)."""
        with self._guard:
            self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


START_VARIABLES = ("PYTHON", "LC_", "LANG", "LD_", "MALLOC_", "MIMALLOC_", "GLIBC_",
                   huge_heap.MARKER)
"""Prefixes of the environment variables an interpreter (or its loader and allocator)
reads at its start, before any of the agent's code runs: a template's REPL, forked,
never reads them again, so a template serves only environments that agree with its own
on these (:meth:`Template.serves`); any other create starts its interpreter anew."""


def start_variables(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(START_VARIABLES)}


class Template(_Forker):
    """An image's template (``agent.launching.template``): the image's python3, started
    once with the agent loaded, forking the launchers of that image's families; their
    REPL serves in the forked interpreter, so a create starts no interpreter. Its user
    namespace's map writer writes each family's id maps (:meth:`write_id_maps`).

    Held by pidfd: ``pid`` is the map writer (what the zygote forked); the template's
    REPL is its child, killed by it when the daemon hangs up or the writer ends."""

    in_process = True

    def __init__(self, pid: int, pidfd: int, conn: socket.socket, maps: socket.socket,
                 env: dict[str, str]) -> None:
        super().__init__()
        self.pid, self.pidfd = pid, pidfd
        self.repl = 0  # the template's REPL: the map writer's child (start_template checks)
        self._conn, self._maps = conn, maps
        self.start_env = start_variables(env)
        self.started = time.monotonic()
        self.launches = 0
        self.userns = 0  # Z's inode (start_template reads it once Z exists)
        self._guard = threading.Lock()
        self.broken = False  # it failed a request: no more are sent to it

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a REPL forked from here is what one started with ``env`` would be."""
        return not self.broken and start_variables(env) == self.start_env

    def owner(self, uid_base: int) -> int:
        return in_template(uid_base)  # the family's ids as the template's namespace sees them

    def _request(self, spec: dict, fds: list[int]) -> tuple[int, int]:
        message = json.dumps({"spec": spec, "fds": fds}).encode()
        with self._guard:
            self.launches += 1
            try:
                pid, pidfd = _ask(self._conn, message, fds)
            except (OSError, EOFError) as exc:
                self.broken = True
                raise SpawnError(f"the image's template did not answer: {exc}") from None
        # Its answer is believed only for a child of its own: the daemon is about to record
        # that process, and signal it, as host root.
        try:
            ours = procfs.pidfd_pid(pidfd) == pid and procfs.parent(pid) == self.repl
        except (OSError, ValueError, IndexError):
            ours = False
        if not ours:
            os.close(pidfd)
            self.broken = True
            raise SpawnError(f"the image's template answered with pid {pid}, not a launcher "
                             "of its own")
        return pid, pidfd

    async def write_id_maps(self, pid: int, uid_base: int) -> None:
        """Have the map writer give launcher ``pid``'s user namespace (a child of the
        template's) host range ``uid_base``.., then check that it did, from the host."""
        try:
            nested = procfs.parent_userns(pid) == self.userns
        except OSError:
            nested = False
        if not nested:
            self.broken = True
            raise SpawnError(f"launcher {pid}'s user namespace is not a child of its template's")
        inside = in_template(uid_base)
        request = json.dumps({"pid": pid, "map": f"0 {inside} {UID_COUNT}\n"}).encode()
        answer = await asyncio.to_thread(self._map, request)
        if answer != b"ok":
            self.broken = True
            raise SpawnError(f"the image's template could not map the family's ids: "
                             f"{answer.decode(errors='replace')}")
        want = [0, uid_base, UID_COUNT]
        for name in ("uid_map", "gid_map"):
            got = [list(map(int, line.split()))
                   for line in Path(f"/proc/{pid}/{name}").read_text().splitlines()]
            if got != [want]:
                raise SpawnError(f"the template wrote {name} {got}, not {want}")

    def _hang_up(self) -> None:
        with self._guard:  # after a request in hand
            self._conn.close()
            self._maps.close()

    def _map(self, request: bytes) -> bytes:
        with self._guard:
            try:
                self._maps.send(request)
                return self._maps.recv(4096) or b"hung up"
            except OSError as exc:
                return str(exc).encode()

    async def close(self) -> None:
        """Hang up: the map writer kills the template's REPL and exits (killed if it does
        not; the REPL then dies with it). Its families run on."""
        self.broken = True
        await asyncio.to_thread(self._hang_up)
        if self.pidfd < 0:
            return
        try:
            await asyncio.wait_for(_readable(self.pidfd), KILL_WAIT)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        os.close(self.pidfd)
        self.pidfd = -1


def _launcher_env() -> dict[str, str]:
    """The daemon's environment a launcher needs: its choice of the REPL's heap, nothing
    else (not the API key: a launcher holds the sandbox's first moments)."""
    heap = os.environ.get(huge_heap.MARKER)
    return {} if heap is None else {huge_heap.MARKER: heap}


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def _read_some(fd: int, timeout: float) -> bytes:
    """Read what a pipe offers (b"" at EOF), waiting at most ``timeout`` seconds."""
    await asyncio.wait_for(_readable(fd), timeout)
    return os.read(fd, 4096)


def _write_id_maps(pid: int, mapping: str) -> None:
    """Write ``mapping`` (lines "inside outside count") as ``pid``'s user namespace's uid
    and gid maps; the daemon may, being root in its parent namespace."""
    Path(f"/proc/{pid}/uid_map").write_text(mapping)
    Path(f"/proc/{pid}/gid_map").write_text(mapping)


async def _abandon(family: Family, channel: AgentChannel | None, ping, ours) -> None:
    """Undo a spawn that failed half-way: kill the family, stop reading its channel."""
    if ping is not None:
        ping.cancel()
    await family.kill()
    if channel is not None:
        await channel.close()
    ours.close()


class _Start:
    """The pipes of a launcher's first moments, shared by families and templates: it
    reports ``u`` once its user namespace exists, waits for ``g`` (maps written), and
    then reports an entry failure as text, success as EOF (every writer closed or
    exec'd)."""

    def __init__(self, log_path: Path) -> None:
        self.status_r, self.status_w = os.pipe()
        self.go_r, self.go_w = os.pipe()
        self.log_path = log_path
        self.log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                           0o600)

    def spec(self) -> dict:
        """The launcher's ends, for its spec (and its fds: these same numbers)."""
        return {"status_w": self.status_w, "go_r": self.go_r, "log_fd": self.log}

    def fds(self) -> list[int]:
        return [self.status_w, self.go_r, self.log]

    def handed(self) -> None:
        """The launcher has its copies: close the daemon's of the launcher's ends."""
        for fd in (self.status_w, self.go_r, self.log):
            os.close(fd)

    async def mapped(self, timeout: float, write_maps) -> None:
        """Wait for the user namespace, have its maps written (``await write_maps()``),
        and let the launcher go on."""
        said = await _read_some(self.status_r, timeout)
        if said != b"u":
            raise SpawnError(said.decode(errors="replace") or f"the launcher died before "
                             f"making its user namespace (see {self.log_path})")
        await write_maps()
        os.write(self.go_w, b"g")

    async def entered(self, timeout: float) -> None:
        failure = await _read_some(self.status_r, timeout)
        if failure:
            raise SpawnError(failure.decode(errors="replace"))

    def close(self) -> None:
        os.close(self.status_r)
        os.close(self.go_w)


TEMPLATE_INOTIFY_INSTANCES = 8192
"""What the host's per-user inotify instance limit is raised to (if lower; 128 by
default): every family of a template draws on its owner's, up to 128 each
(``launching.FAMILY_SYSCTLS``), so 128 in all would serve one family."""


def widen_inotify_budget() -> str:
    """Raise ``fs.inotify.max_user_instances`` to TEMPLATE_INOTIFY_INSTANCES if lower;
    the limit now (or why it stays: a read-only /proc/sys). A host-wide setting (each
    user's own limit), as container hosts raise it for the same reason."""
    path = Path("/proc/sys/fs/inotify/max_user_instances")
    now = int(path.read_text())
    if now < TEMPLATE_INOTIFY_INSTANCES:
        try:
            path.write_text(str(TEMPLATE_INOTIFY_INSTANCES))
        except OSError as exc:
            return f"{now} (not raised: {exc.strerror})"
        now = TEMPLATE_INOTIFY_INSTANCES
    return str(now)


async def start_template(
    *,
    zygote: Zygote,
    tree_fd: int,
    id_map: str,
    owner: int,
    hostname: str,
    env: dict[str, str],
    attach: Path,
    log_path: Path,
    python: str,
    timeout: float = 30.0,
) -> Template:
    """Start an image's template whose REPL enters ``tree_fd`` (consumed): a read-only
    root of the image. ``id_map`` is its user namespace's (``storage.idmap.template_map``),
    which host id ``owner`` (its own slot's, never root) owns: the kernel counts what
    every family of the template holds against that id too (``Forker.owner``);
    ``env`` what its interpreter starts with, and so what the creates it serves set."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    maps, maps_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    start = _Start(log_path)
    child_fds = [tree_fd, theirs.fileno(), maps_theirs.fileno(), *start.fds()]
    spec = {"template": True, "owner": owner, "tree_fd": tree_fd, "ctrl_fd": theirs.fileno(),
            "maps_fd": maps_theirs.fileno(), **start.spec(), "attach": str(attach),
            "hostname": hostname, "env": env, "python": python}
    try:
        pid, pidfd = await zygote.launch(spec, child_fds)
    except BaseException:
        start.close()
        ours.close()
        maps.close()
        raise
    finally:
        os.close(tree_fd)
        theirs.close()
        maps_theirs.close()
        start.handed()
    template = Template(pid, pidfd, ours, maps, env)
    try:
        await start.mapped(timeout, lambda: asyncio.to_thread(_write_id_maps, pid, id_map))
        template.userns = os.stat(f"/proc/{pid}/ns/user").st_ino
        await start.entered(timeout)
        await asyncio.wait_for(_readable(ours.fileno()), timeout)
        try:
            hello = json.loads(ours.recv(256) or b"{}")
            template.repl = int(hello["pid"])
            ready = hello["ready"] is True and procfs.parent(template.repl) == pid
        except (ValueError, KeyError, TypeError, OSError, IndexError):
            ready = False
        if not ready:
            raise SpawnError(f"the image's template did not start (see {log_path})")
        ours.settimeout(30)
        # A request is one datagram: room for a spec with the largest env a create takes.
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        maps.settimeout(10)
        return template
    except BaseException as exc:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        await template.close()
        if isinstance(exc, TimeoutError):
            raise SpawnError(f"the image's template did not start within {timeout:.0f} s "
                             f"(see {log_path})") from None
        raise
    finally:
        start.close()


async def spawn_family(
    *,
    forker: _Forker,
    tree_fd: int,
    repl_cgroup_fds: list[int],
    cmds_cgroup_fds: list[int],
    mounts: list[tuple[int, str]] = (),
    hostname: str,
    uid_base: int,
    env: dict[str, str],
    cwd: str,
    attach: Path,
    log_path: Path,
    python: str = "/usr/bin/python3",
    reaper: Path | None = None,
    timeout: float = 30.0,
    started: Callable[[Family], None] | None = None,
) -> tuple[Family, AgentChannel]:
    """Start a family whose first sandbox enters ``tree_fd``; returns it once the REPL answers.

    ``forker`` is the zygote or a template of the sandbox's image (whose REPL is then a
    fork of the template's: ``attach`` is ignored, the agent layer has the place).
    Consumes ``tree_fd``, the cgroup fds and the fds of ``mounts`` (more trees to
    attach in the root: (fd, path in the sandbox)). Sandbox root is host id ``uid_base``.
    ``started`` is called with the family as soon as its launcher runs: the launcher
    outlives a daemon killed from then on, so that is when it must be recorded.
    ``reaper`` is the agent layer's ``bb-init``, which the family's init execs once it
    has forked the first REPL (without it, that init reaps in Python).
    """
    reaper_fd = os.open(reaper, os.O_RDONLY | os.O_CLOEXEC) if reaper is not None else -1
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    maker, launcher_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    maker.settimeout(MAKE_TIMEOUT)
    start = _Start(log_path)
    child_fds = [tree_fd, theirs.fileno(), launcher_end.fileno(), *repl_cgroup_fds,
                 *cmds_cgroup_fds, *(fd for fd, _ in mounts),
                 *([reaper_fd] if reaper_fd >= 0 else [])]
    spec = {
        "tree_fd": tree_fd,
        "ctrl_fd": theirs.fileno(),
        **start.spec(),
        "netns_fd": launcher_end.fileno(),
        "repl_cgroup_fds": repl_cgroup_fds,
        "cmds_cgroup_fds": cmds_cgroup_fds,
        "mounts": list(mounts),
        "attach": entry.ATTACH if forker.in_process else str(attach),
        "in_process": forker.in_process,
        "owner": forker.owner(uid_base),
        **({"reaper_fd": reaper_fd} if reaper_fd >= 0 else {}),
        "hostname": hostname,
        "env": env,
        "cwd": cwd,
        "python": python,
    }
    try:
        pid, pidfd = await forker.launch(spec, [*child_fds, *start.fds()])
    except BaseException:
        start.close()
        ours.close()
        maker.close()
        raise
    finally:
        for fd in child_fds:
            os.close(fd)
        start.handed()
        theirs.detach()
        launcher_end.detach()
    try:
        family = Family(pid, pidfd, start_time(pid), netns_maker=maker)
    except (OSError, ValueError, IndexError):  # gone already (its forker reaped it)
        family = Family(pid, pidfd, 0, netns_maker=maker)
    if started is not None:
        started(family)
    channel = ping = None
    try:
        await start.mapped(timeout, lambda: forker.write_id_maps(pid, uid_base))
        channel = AgentChannel(ours)
        ping = asyncio.ensure_future(channel.call("ping"))
        # The ping answers once the agent serves.
        try:
            await start.entered(timeout)
        except SpawnError:
            ping.cancel()
            raise
        try:
            await asyncio.wait_for(ping, timeout)
        except (TimeoutError, OSError, EOFError) as exc:
            raise SpawnError(
                f"the sandbox's agent did not answer ({exc or 'timeout'}; see {log_path})"
            ) from exc
        return family, channel
    except TimeoutError:
        await _abandon(family, channel, ping, ours)
        raise SpawnError(f"the sandbox did not start within {timeout:.0f} s (see {log_path})"
                         ) from None
    except BaseException:
        await _abandon(family, channel, ping, ours)
        raise
    finally:
        start.close()
