"""Daemon side of starting a family (see ``family_init`` for the process side).

Launchers are forked by the zygote, a fresh interpreter (``-I -S``: no site, no
environment) the daemon starts once and again if it dies; a launcher inherits
nothing from the daemon but the fds it is sent. The daemon writes the user
namespace's id maps itself: it is root in the parent namespace, which is what the
kernel asks of the writer. Each family gets a host id range of its own (the caller
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from branchbox.agent import huge_heap
from branchbox.runtime.channel import AgentChannel
from branchbox.runtime.procfs import start_time
from branchbox.storage.idmap import UID_COUNT

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


class Zygote:
    """The daemon's end of the zygote (``family_init.serve``): started on first use, and
    again if it died; one request at a time. Closing it ends the zygote, not the
    families it started."""

    def __init__(self, log_path: Path) -> None:
        self._log_path = log_path
        self._proc: subprocess.Popen | None = None
        self._conn: socket.socket | None = None
        self._lock = asyncio.Lock()  # requests wait their turn here, not in threads
        self._guard = threading.Lock()  # one request, or close, at a time

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
                    socket.send_fds(self._conn, [message], fds)
                except ConnectionError:  # it died since: it never got the request; a new one does
                    self._close()
                    self._start()
                    socket.send_fds(self._conn, [message], fds)
                msg, got, _, _ = socket.recv_fds(self._conn, 4096, 1)
            except OSError as exc:  # a zygote that does not answer is replaced next time
                self._close()
                raise SpawnError(f"the zygote did not answer: {exc} (see {self._log_path})"
                                 ) from None
            if not msg:
                self._close()
                raise SpawnError(f"the zygote ended (see {self._log_path})")
        reply = json.loads(msg)
        if "error" in reply:
            raise SpawnError(reply["error"])
        return reply["pid"], got[0]

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


def _write_id_maps(pid: int, uid_base: int) -> None:
    """Map the family's ids 0..65535 onto its own host range ``uid_base``.."""
    mapping = f"0 {uid_base} {UID_COUNT}\n"
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


async def spawn_family(
    *,
    zygote: Zygote,
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
    timeout: float = 30.0,
    started: Callable[[Family], None] | None = None,
) -> tuple[Family, AgentChannel]:
    """Start a family whose first sandbox enters ``tree_fd``; returns it once the REPL answers.

    Consumes ``tree_fd``, the cgroup fds and the fds of ``mounts`` (more trees to
    attach in the root: (fd, path in the sandbox)). Sandbox root is host id ``uid_base``.
    ``started`` is called with the family as soon as its launcher runs: the launcher
    outlives a daemon killed from then on, so that is when it must be recorded.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    maker, launcher_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    maker.settimeout(MAKE_TIMEOUT)
    status_r, status_w = os.pipe()
    go_r, go_w = os.pipe()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    child_fds = [tree_fd, theirs.fileno(), status_w, go_r, log, launcher_end.fileno(),
                 *repl_cgroup_fds, *cmds_cgroup_fds, *(fd for fd, _ in mounts)]
    spec = {
        "tree_fd": tree_fd,
        "ctrl_fd": theirs.fileno(),
        "status_w": status_w,
        "go_r": go_r,
        "log_fd": log,
        "netns_fd": launcher_end.fileno(),
        "repl_cgroup_fds": repl_cgroup_fds,
        "cmds_cgroup_fds": cmds_cgroup_fds,
        "mounts": list(mounts),
        "attach": str(attach),
        "hostname": hostname,
        "env": env,
        "cwd": cwd,
        "python": python,
    }
    try:
        pid, pidfd = await zygote.launch(spec, child_fds)
    except BaseException:
        for fd in (status_r, go_w):
            os.close(fd)
        ours.close()
        maker.close()
        raise
    finally:
        for fd in child_fds:
            os.close(fd)
        theirs.detach()
        launcher_end.detach()
    try:
        family = Family(pid, pidfd, start_time(pid), netns_maker=maker)
    except (OSError, ValueError, IndexError):  # gone already (the zygote reaped it)
        family = Family(pid, pidfd, 0, netns_maker=maker)
    if started is not None:
        started(family)
    channel = ping = None
    try:
        if await _read_some(status_r, timeout) != b"u":
            raise SpawnError(f"the launcher died before making its user namespace (see {log_path})")
        _write_id_maps(pid, uid_base)
        os.write(go_w, b"g")
        channel = AgentChannel(ours)
        ping = asyncio.ensure_future(channel.call("ping"))
        # The status pipe reports an entry failure as text, success as EOF (every
        # writer closed or exec'd); the ping answers once the agent serves.
        failure = await _read_some(status_r, timeout)
        if failure:
            ping.cancel()
            raise SpawnError(failure.decode(errors="replace"))
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
        os.close(status_r)
        os.close(go_w)
