"""The processes that start a family: the zygote, each family's launcher, its init and
first REPL.

The zygote is a fresh interpreter (never a fork of the threaded daemon; ``-I -S``,
nothing inherited but its socket) started once per daemon, with this module imported.
For every family it forks a launcher: the child is what a fresh ``python`` per family
used to be, a single-threaded interpreter holding only the fds it was sent, without
the ~20 ms (and ~15 ms of CPU) of start-up and imports a cold create used to queue on.
See ``runtime.family`` for the daemon's side.

Requests over a ``SOCK_SEQPACKET`` socketpair, one at a time::

    {"spec": {...}, "fds": [the daemon's fd numbers]} + those fds (SCM_RIGHTS)
        -> {"pid": N} + a pidfd of the launcher        or   {"error": "..."}

The zygote reaps its launchers and exits when the daemon's end hangs up; the
launchers run on (they outlive the daemon) and the host's init reaps them.

Process tree a family leaves behind (host view)::

    launcher (SIGTERM ends the family; it outlives the daemon)
      └─ family init  = PID 1 of the family PID namespace P; reaps orphans
           └─ first REPL = /usr/bin/python3 of the image running the agent
                └─ Q init = PID 1 of the sandbox's command namespace Q

Step by step: unshare the PID namespace P while still host root, so that P
belongs to the host's user namespace; unshare the user namespace; wait until
the daemon has written the uid/gid maps; take uid/gid 0 of the namespace
(only then do the capabilities apply to it); unshare a network namespace of
its own; fork P's init; that init forks the REPL, which enters its sandbox
(``agent.entry``) and execs the image's python3 on the agent. The launcher
then makes network namespaces owned by the family's user namespace on the
daemon's request, for fork children to join, until the family's init ends.

Why P belongs to the host: every REPL of a family is a process of P, and
sandbox root has every capability of the family's user namespace. Were P
owned by it, code in any branch could mount a proc of P and, through it, read
and write its siblings' and parent's files (``/proc/PID/root``), fds and
memory. Owned by the host, P cannot be mounted, nor entered with setns, from
inside; the REPLs never need to (``bb_init.c`` starts commands in Q for them).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys

from branchbox.agent import confine, entry, huge_heap, sysc

AGENT_BOOT = (
    "import sys; sys.path.insert(0, '/.branchbox'); "
    "from bbagent import forking; forking.boot({ctrl}, {spawner})"
)


def _first_repl(spec: dict, status_w: int) -> None:
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the agent installs its own
        os.setsid()  # its own session and group: a kill(0) in a branch reaches that branch
        # Before the entry: bb-init, which it spawns, starts every command of this sandbox,
        # and what bb-init runs under, they run under. (Installed after the entry, it left
        # the first sandbox's commands without a filter and without no_new_privs.)
        confine.confine()  # inherited by every fork child and command from here on
        mounts = [(fd, path) for fd, path in spec["mounts"]]
        spawner = entry.enter_sandbox(
            spec["tree_fd"], spec["attach"], spec["hostname"], spec["repl_cgroup_fds"],
            spec["cmds_cgroup_fds"], mounts,
        ).spawner  # a family's first sandbox is one Landlock domain deep: no listener
        os.makedirs(spec["cwd"], exist_ok=True)
        os.chdir(spec["cwd"])
        # Until here stdout/stderr were the daemon's log of this sandbox (entry errors
        # land there); user code must not be able to write to a host file, so no more.
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        keep = {spec["ctrl_fd"], spawner}
        for fd in keep:
            os.set_inheritable(fd, True)
        entry.close_fds_except(keep)
        code = AGENT_BOOT.format(ctrl=spec["ctrl_fd"], spawner=spawner)
        # argv[0] is the full path: Python finds its venv (the image's /opt/venv) from it,
        # not from a PATH the sandbox's env may have replaced.
        # Looked up inside the sandbox's root: the image decides whether it has mimalloc.
        os.execve(spec["python"], [spec["python"], "-c", code], huge_heap.repl_env(spec["env"]))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the daemon
        os.write(status_w, f"sandbox entry failed: {type(exc).__name__}: {exc}".encode())
        os._exit(1)


def _family_init(spec: dict, status_w: int) -> None:
    sysc.prctl(sysc.PR_SET_PDEATHSIG, signal.SIGKILL)
    sysc.set_process_name("bb-family")
    # The kernel drops a signal sent to a namespace's init from inside unless the init
    # handles it: Python's own handlers (SIGINT's KeyboardInterrupt) would let any branch
    # take the whole family down. SIG_DFL for all of them, so none is handled.
    for signo in signal.valid_signals():
        if signo not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(signo, signal.SIG_DFL)
    if os.fork() == 0:
        _first_repl(spec, status_w)
    os.closerange(0, 65536)
    entry.reap_forever()


REQUEST_MAX = 1 << 20  # bytes of one request (a spec with its env)
FDS_MAX = 250  # fds of one request (the kernel takes at most 253 in one SCM_RIGHTS)


def serve() -> None:
    """The zygote: fork a launcher per request until the daemon hangs up."""
    conn = socket.socket(fileno=int(sys.argv[1]))
    sysc.set_process_name("bb-zygote")
    signal.signal(signal.SIGCHLD, _reap)
    while True:
        msg, fds, _, _ = socket.recv_fds(conn, REQUEST_MAX, FDS_MAX)
        if not msg:
            return
        reply, pidfd = _fork_launcher(conn, json.loads(msg), fds)
        socket.send_fds(conn, [json.dumps(reply).encode()], [pidfd] if pidfd >= 0 else [])
        if pidfd >= 0:
            os.close(pidfd)


def _reap(signo: int, frame: object) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _fork_launcher(conn: socket.socket, request: dict, fds: list[int]) -> tuple[dict, int]:
    """Fork the launcher of ``request``; its pid and a pidfd, taken before anything can
    reap it (SIGCHLD is held until then), so the pidfd is that process for sure."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        pid = os.fork()
        if pid == 0:
            _launcher(conn, request, fds)
        return {"pid": pid}, os.pidfd_open(pid)
    except OSError as exc:
        return {"error": f"could not fork a launcher: {exc}"}, -1
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        for fd in fds:
            os.close(fd)


def _launcher(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the fork child: become what a fresh launcher was, then start the family."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its own waitpid must see its init
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        conn.close()
        os.setsid()  # no controlling terminal a sandbox could reach
        spec = _renumbered(request["spec"], dict(zip(request["fds"], fds, strict=True)))
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd in (1, 2):  # the daemon's log of this sandbox, until the REPL's entry ends
            os.dup2(spec["log_fd"], fd)
        os.close(null)
        os.close(spec["log_fd"])
        _launch(spec)
    finally:
        os._exit(1)


def _renumbered(spec: dict, fd: dict[int, int]) -> dict:
    """``spec`` with the daemon's fd numbers replaced by this process's (received anew)."""
    return {
        **spec,
        **{name: fd[spec[name]] for name in ("tree_fd", "ctrl_fd", "status_w", "go_r",
                                              "log_fd", "netns_fd")},
        "repl_cgroup_fds": [fd[n] for n in spec["repl_cgroup_fds"]],
        "cmds_cgroup_fds": [fd[n] for n in spec["cmds_cgroup_fds"]],
        "mounts": [(fd[n], path) for n, path in spec["mounts"]],
    }


def _launch(spec: dict) -> None:
    status_w, go_r = spec["status_w"], spec["go_r"]
    # No parent-death signal: the family outlives a daemon that dies or restarts, and the
    # next daemon re-attaches to it (engine.reattach) or ends it with SIGTERM.
    sysc.set_process_name("bb-launcher")
    init = [0]

    def end_family(signo: int, frame: object) -> None:
        """SIGTERM: kill the family's init (its namespace dies with it) and let the wait
        below reap it, so no init is left an orphan for the host's init to reap."""
        if not init[0]:
            os._exit(1)
        os.kill(init[0], signal.SIGKILL)

    signal.signal(signal.SIGTERM, end_family)
    try:
        sysc.unshare(sysc.CLONE_NEWPID)  # first: P then belongs to the host's user namespace
        sysc.unshare(sysc.CLONE_NEWUSER)
        os.write(status_w, b"u")
        if os.read(go_r, 1) != b"g":
            os._exit(1)
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        os.setgroups([])
        sysc.unshare(sysc.CLONE_NEWNET)  # home: where it returns after making one
        home = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        init_pid = init[0] = os.fork()
    except BaseException as exc:  # noqa: BLE001
        os.write(status_w, f"family set-up failed: {type(exc).__name__}: {exc}".encode())
        os._exit(1)
    if init_pid == 0:
        os.close(home)
        os.close(spec["netns_fd"])
        _family_init(spec, status_w)
    entry.close_fds_except({spec["netns_fd"], home})
    _make_namespaces_until(init_pid, socket.socket(fileno=spec["netns_fd"]), home)
    os._exit(0)


NAMESPACES_MAX = 64  # made per request (the kernel passes 253 fds in one message)


def _make_namespaces_until(init_pid: int, conn: socket.socket, home: int) -> None:
    """Until the family's init ends: make network namespaces on the daemon's request.

    Made here, they belong to the family's user namespace, so a fork child (root there)
    may join one; the daemon plugs and addresses them ahead of its forks
    (engine.networking). A request is a count; the answer, as many namespaces (fds)
    as could be made. The launcher goes back to its own namespace after each."""
    pidfd = os.pidfd_open(init_pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(conn, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == pidfd:
                os.waitpid(init_pid, 0)
                return
            try:
                count = min(int(conn.recv(16) or b"-1"), NAMESPACES_MAX)
            except (OSError, ValueError):
                count = -1
            if count < 0:  # the daemon hung up (or a daemon restarted: the next has none)
                poller.unregister(conn)
                conn.close()
                continue
            made: list[int] = []
            try:
                for _ in range(count):
                    sysc.unshare(sysc.CLONE_NEWNET)
                    made.append(os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                pass  # fewer: the daemon plugs what it got
            try:
                sysc.setns(home, sysc.CLONE_NEWNET)
                socket.send_fds(conn, [b"%d" % len(made)], made)
            except OSError:  # it makes no more (the daemon plugs children after their hello)
                poller.unregister(conn)
                conn.close()
            for fd in made:
                os.close(fd)
