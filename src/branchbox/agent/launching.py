"""What starts a family, in the process that forks it: the daemon's zygote (a host
interpreter, ``runtime.family_init``) or an image's template (that image's python3
with the agent loaded, :func:`template`).

Either one serves the same requests, one at a time, over a ``SOCK_SEQPACKET`` socket::

    {"spec": {...}, "fds": [the daemon's fd numbers]} + those fds (SCM_RIGHTS)
        -> {"pid": N} + a pidfd of the launcher        or   {"error": "..."}

and forks a *launcher* per request. The launcher outlives the daemon; whoever forked
it reaps it, or the host's init once that forker is gone.

Process tree a family leaves behind (host view)::

    launcher (SIGTERM ends the family; it outlives the daemon)
      └─ family init  = PID 1 of the family PID namespace P; reaps orphans
           └─ first REPL = python3 of the image running the agent
                └─ Q init = PID 1 of the sandbox's command namespace Q

Step by step: unshare the PID namespace P while still in the forker's user
namespace, so that P belongs to that namespace, not the family's; unshare the
user namespace; wait until the daemon has had the uid/gid maps written; take
uid/gid 0 of the namespace (only then do the capabilities apply to it);
unshare a network namespace of its own; fork P's init; that init forks the
REPL, which enters its sandbox (``agent.entry``) and then either execs the
image's python3 on the agent (a zygote's launcher) or, already being that
interpreter with the agent loaded, serves right there (a template's: no
interpreter start, no imports). The launcher then makes network namespaces
owned by the family's user namespace on the daemon's request, for fork
children to join, until the family's init ends. Both the launcher and the
init exec the agent layer's static ``bb-init`` for that long wait (``--launcher``,
``--reap``; an fd of it comes from the daemon), so an idle family holds no
Python heap but its REPL's; where it cannot be exec'd, they wait in Python.

Why P must not belong to the family: every REPL of a family is a process of P,
and sandbox root has every capability of the family's user namespace. Were P
owned by it, code in any branch could mount a proc of P and, through it, read
and write its siblings' and parent's files (``/proc/PID/root``), fds and
memory. Owned by the host's user namespace (a zygote's family) or by the
template's (its families' parent namespace), P cannot be mounted, nor entered
with setns, from inside; the REPLs never need to (``bb_init.c`` starts
commands in Q for them).

A template (``runtime.family.Template`` on the daemon's side) is a process the
zygote starts per image: a user namespace Z mapping its own id slot and every
family slot, a map writer left in the host's mount namespace (the only place a
family's ``/proc/PID/uid_map`` can be written from: its parent namespace, Z),
and the image's python3 (only a built-in image's: its code, site included, runs
with authority over every family it starts) with the agent imported, forking a
launcher per create. A create from it is a fork, not an interpreter start; the
family's user namespace is a child of Z with the family's own slot (and owned by
it, not by Z's root), as distinct from its siblings' as a zygote's families are.
What a fork shares that an exec would not: the address space layout, the stack
canary and Python's hash secret, among the families of one template (the engine
retires a template after a while, ``engine.templates``).
"""

from __future__ import annotations

import array
import atexit
import contextlib
import gc
import json
import os
import resource
import select
import signal
import socket
import sys
import time

from . import confine, entry, huge_heap, sysc

AGENT_BOOT = (
    "import sys; sys.path.insert(0, '/.branchbox'); "
    "from bbagent import forking; forking.boot({ctrl}, {spawner})"
)
TEMPLATE_BOOT = (
    "import sys; sys.path.insert(0, '/.branchbox'); "
    "from bbagent import launching; launching.template({ctrl})"
)
REQUEST_MAX = 1 << 20  # bytes of one request (a spec with its env)
FDS_MAX = 250  # fds of one request (the kernel takes at most 253 in one SCM_RIGHTS)
MAP_MAX = 1 << 16  # bytes of one id map request to a template's map writer
NAMESPACES_MAX = 64  # made per request (the kernel passes 253 fds in one message)
_FD_NAMES = ("tree_fd", "ctrl_fd", "status_w", "go_r", "log_fd", "netns_fd", "maps_fd",
             "reaper_fd")


def serve(conn: socket.socket, name: str) -> None:
    """Fork a launcher per request until the daemon hangs up.

    A request is read into one buffer, parsed only in the launcher, and wiped once the
    launcher is forked: it names a family's environment (its secrets, often), and a
    template's memory is every later family's (a fork, not an exec), so nothing of one
    request may stay in it. Only fd numbers and the reply pass through its heap."""
    sysc.set_process_name(name)
    signal.signal(signal.SIGCHLD, _reap)
    buffer = bytearray(REQUEST_MAX)
    view = memoryview(buffer)
    blank = bytes(REQUEST_MAX)
    while True:
        size, ancillary, flags, _ = conn.recvmsg_into([buffer], socket.CMSG_SPACE(
            FDS_MAX * array.array("i").itemsize))
        fds = _received_fds(ancillary)
        if not size and not fds:
            return
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            reply, pidfd = {"error": "the request is too large"}, -1
            for fd in fds:
                os.close(fd)
        else:
            reply, pidfd = _fork_launcher(conn, view[:size], fds)
        view[:size] = blank[:size]
        socket.send_fds(conn, [json.dumps(reply).encode()], [pidfd] if pidfd >= 0 else [])
        if pidfd >= 0:
            os.close(pidfd)


def _received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return list(fds)


def template(ctrl_fd: int) -> None:
    """An image's template (exec'd by :func:`_template`): load the whole agent now, once,
    so every REPL forked from here has it, say so (with its pid, which the daemon
    checks), then serve launches."""
    from . import main  # noqa: F401 - the imports every REPL would otherwise make

    # Every object alive now moves to the permanent generation: a collection in a
    # launcher, family init or REPL forked from here never walks (and so copies) the
    # pages they share with the template.
    gc.freeze()
    conn = socket.socket(fileno=ctrl_fd)
    conn.send(json.dumps({"ready": True, "pid": os.getpid()}).encode())
    serve(conn, "bb-template")
    os._exit(0)


def _reap(signo: int, frame: object) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _fork_launcher(conn: socket.socket, request: memoryview, fds: list[int]
                   ) -> tuple[dict, int]:
    """Fork the launcher of ``request`` (parsed there); its pid and a pidfd, taken before
    anything can reap it (SIGCHLD is held until then), so the pidfd is that process."""
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


def _launcher(conn: socket.socket, raw: memoryview, fds: list[int]) -> None:
    """In the fork child: become what a fresh launcher was, then start the family (or,
    asked by the daemon, a template)."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its own waitpid must see its init
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        conn.close()
        os.setsid()  # no controlling terminal a sandbox could reach
        request = json.loads(bytes(raw))
        spec = _renumbered(request["spec"], dict(zip(request["fds"], fds, strict=True)))
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd in (1, 2):  # the daemon's log of this sandbox, until the REPL's entry ends
            os.dup2(spec["log_fd"], fd)
        os.close(null)
        os.close(spec["log_fd"])
        if spec.get("template"):
            _template(spec)
        else:
            _launch(spec)
    finally:
        os._exit(1)


def _renumbered(spec: dict, fd: dict[int, int]) -> dict:
    """``spec`` with the daemon's fd numbers replaced by this process's (received anew)."""
    return {
        **spec,
        **{name: fd[spec[name]] for name in _FD_NAMES if name in spec},
        "repl_cgroup_fds": [fd[n] for n in spec.get("repl_cgroup_fds", ())],
        "cmds_cgroup_fds": [fd[n] for n in spec.get("cmds_cgroup_fds", ())],
        "mounts": [(fd[n], path) for n, path in spec.get("mounts", ())],
    }


# What one family may hold of the kernel's budgets counted per user namespace owner. A
# template's families all draw on its owner's (the kernel counts each level of nested
# namespaces against the owner of that level): these caps, in the template's namespace,
# keep one of them from taking all of it. Pending signals (POSIX timers too) and message
# queue bytes are counted against an rlimit the family's namespace keeps from its
# creation: its launcher's, lowered here to a share of the template's (its own hard
# limit, 96,365 signals and 819,200 bytes by default, which only CAP_SYS_RESOURCE
# could raise).
FAMILY_SYSCTLS = {"max_inotify_instances": 128, "max_inotify_watches": 65536,
                  "max_fanotify_groups": 128, "max_fanotify_marks": 8192,
                  **{f"max_{kind}_namespaces": 8192 for kind in (
                      "cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts")}}
FAMILY_RLIMITS = {resource.RLIMIT_SIGPENDING: 8192, resource.RLIMIT_MSGQUEUE: 204800}


def _limit(rlimits: dict[int, int]) -> None:
    """Lower these rlimits to their values (never above what they are)."""
    for which, value in rlimits.items():
        soft, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))


def _become(owner: int) -> None:
    """Take host (or template) ids ``owner`` before unsharing a user namespace: they own it."""
    os.setgroups([])
    os.setresgid(owner, owner, owner)
    os.setresuid(owner, owner, owner)


def _mapped(spec: dict) -> None:
    """Unshare the user namespace, wait for the daemon's word that its id maps are
    written, and become its root (only then do the capabilities apply to it)."""
    sysc.unshare(sysc.CLONE_NEWUSER)
    os.write(spec["status_w"], b"u")
    if os.read(spec["go_r"], 1) != b"g":
        os._exit(1)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    os.setgroups([])


def _launch(spec: dict) -> None:
    status_w = spec["status_w"]
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
        sysc.unshare(sysc.CLONE_NEWPID)  # first: P then belongs to the forker's namespace
        # The family's namespace is owned by the family's own ids, not by its forker's
        # root (the host's, or the template's), which so keeps no power over it (a parent
        # namespace's process whose euid owns a child namespace has every capability in
        # it); and the kernel counts what the family holds (processes, namespaces,
        # inotify instances, pending signals) under that owner, the family's own, not
        # under the root's shared with everything else.
        _limit(FAMILY_RLIMITS)
        _become(spec["owner"])
        _mapped(spec)
        sysc.unshare(sysc.CLONE_NEWNET)  # home: where it returns after making one
        home = sysc.netns_fd()
        armed_r, armed_w = os.pipe()
        init_pid = init[0] = os.fork()
    except BaseException as exc:  # noqa: BLE001
        os.write(status_w, f"family set-up failed: {type(exc).__name__}: {exc}".encode())
        os._exit(1)
    if init_pid == 0:
        os.close(home)
        os.close(spec["netns_fd"])
        os.close(armed_r)
        _family_init(spec, status_w, armed_w)
    # Until the init has its parent-death signal, this process must not die without
    # killing it (its SIGTERM handler does; the exec below resets that handler): an init
    # orphaned first would live on, reaping nothing, for good. Its word (or its end)
    # comes through the pipe.
    os.close(armed_w)
    os.read(armed_r, 1)
    os.close(armed_r)
    reaper = spec.get("reaper_fd")
    entry.close_fds_except({spec["netns_fd"], home, *([reaper] if reaper is not None else [])})
    if reaper is not None:  # the same loop in bb-init, without this Python heap (~2 MB)
        with contextlib.suppress(OSError):  # a data directory mounted noexec, say
            for fd in (spec["netns_fd"], home):
                os.set_inheritable(fd, True)
            os.execve(reaper, ["bb-init", "--launcher", str(init_pid), str(spec["netns_fd"]),
                               str(home)], {})
        os.close(reaper)
    _make_namespaces_until(init_pid, socket.socket(fileno=spec["netns_fd"]), home)
    os._exit(0)


def _family_init(spec: dict, status_w: int, armed_w: int) -> None:
    sysc.prctl(sysc.PR_SET_PDEATHSIG, signal.SIGKILL)
    os.write(armed_w, b"k")
    os.close(armed_w)
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
    reaper = spec.get("reaper_fd")
    if reaper is not None:  # bb-init --reap: this init's job without its Python heap
        entry.close_fds_except({reaper})
        with contextlib.suppress(OSError):  # else (noexec, say) it reaps in Python
            os.execve(reaper, ["bb-init", "--reap"], {})  # named bb-family again there
    os.closerange(0, 65536)
    entry.reap_forever()


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
        ).spawner  # a family's first sandbox is one or two Landlock domains deep (a
        # template's are nested in the template's): no listener
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
        entry.close_fds_except(keep)  # the status pipe too: its EOF says "entered"
        if spec.get("in_process"):
            _serve_here(spec, spawner)
        code = AGENT_BOOT.format(ctrl=spec["ctrl_fd"], spawner=spawner)
        # argv[0] is the full path: Python finds its venv (the image's /opt/venv) from it,
        # not from a PATH the sandbox's env may have replaced.
        # Looked up inside the sandbox's root: the image decides whether it has mimalloc.
        os.execve(spec["python"], [spec["python"], "-c", code], huge_heap.repl_env(spec["env"]))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the daemon
        with contextlib.suppress(OSError):
            os.write(status_w, f"sandbox entry failed: {type(exc).__name__}: {exc}".encode())
        os._exit(1)


def _serve_here(spec: dict, spawner: int) -> None:
    """A template's REPL: what an interpreter start reads from the sandbox that the
    template's start did not read the same (its environment, its time zone), read now;
    the signals an interpreter ignores at its start (its family init reset them),
    ignored again; then serve. The daemon starts a REPL this way only when the
    sandbox's environment sets what the interpreter reads at its start (``PYTHON*``,
    locale, loader, allocator: ``runtime.family.START_VARIABLES``) as the template's
    does; the template ran the image's ``site`` as a start in this image would."""
    sysc.set_process_name(os.path.basename(spec["python"]))  # what an exec would show
    for signo in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(signo, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(spec["env"])
    time.tzset()
    from .forking import boot

    try:
        boot(spec["ctrl_fd"], spawner)
    finally:  # as the interpreter's own end would: exit handlers, then flush
        atexit._run_exitfuncs()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)


def _template(spec: dict) -> None:
    """The launcher asked for a template: its user namespace Z (the daemon writes Z's
    maps), then a child that enters a sandbox root of the image (no confinement: its
    own launchers must still unshare user namespaces, and nothing in it runs user code)
    and execs the image's python3 as :func:`template`; this process stays behind in
    the host's mount namespace as Z's map writer."""
    try:
        sysc.set_process_name("bb-template-map")
        _become(spec["owner"])  # Z is then its own slot's, not the host root's
        _mapped(spec)
        for name, value in FAMILY_SYSCTLS.items():  # Z's, seen from a process in Z
            with open(f"/proc/sys/user/{name}", "w") as f:
                f.write(str(value))
        writer = os.getpid()
        pid = os.fork()
    except BaseException as exc:  # noqa: BLE001
        os.write(spec["status_w"], f"template set-up failed: {type(exc).__name__}: {exc}"
                 .encode())
        os._exit(1)
    if pid == 0:
        try:
            sysc.prctl(sysc.PR_SET_PDEATHSIG, signal.SIGKILL)  # it ends with its writer
            if os.getppid() != writer:
                os._exit(1)
            spawner = entry.enter_sandbox(spec["tree_fd"], spec["attach"], spec["hostname"],
                                          [], []).spawner
            os.chdir("/")
            keep = {spec["ctrl_fd"], spawner}
            for fd in keep:
                os.set_inheritable(fd, True)
            entry.close_fds_except(keep)
            code = TEMPLATE_BOOT.format(ctrl=spec["ctrl_fd"])
            os.execve(spec["python"], [spec["python"], "-c", code],
                      huge_heap.repl_env(spec["env"]))
        except BaseException as exc:  # noqa: BLE001
            with contextlib.suppress(OSError):
                os.write(spec["status_w"],
                         f"template entry failed: {type(exc).__name__}: {exc}".encode())
            os._exit(1)
    entry.close_fds_except({spec["maps_fd"]})
    try:  # what writing a map takes in Z (the kernel asks CAP_SYS_ADMIN over the family's
        # namespace too), nothing else: no kill, ptrace, chown... (it sees the host's pids)
        sysc.keep_only_capabilities({sysc.CAP_SETUID, sysc.CAP_SETGID, sysc.CAP_DAC_OVERRIDE,
                                     sysc.CAP_SYS_ADMIN})
    except OSError:
        os.kill(pid, signal.SIGKILL)
        os._exit(1)
    _write_maps_until_hangup(socket.socket(fileno=spec["maps_fd"]))
    os.kill(pid, signal.SIGKILL)  # the template's REPL ends with its writer: its launchers run on
    os.waitpid(pid, 0)
    os._exit(0)


def _write_maps_until_hangup(conn: socket.socket) -> None:
    """Z's map writer: write a family's uid and gid maps on the daemon's request. Only a
    process of Z (the family's parent user namespace) may, and only one that sees the
    family's launcher in its /proc; the template's REPL sees neither. A request is
    ``{"pid": N, "map": "inside outside count\\n"}``; the answer ``ok`` or the error."""
    while True:
        try:
            msg = conn.recv(MAP_MAX)
        except OSError:
            return
        if not msg:
            return
        try:
            request = json.loads(msg)
            pid, mapping = int(request["pid"]), str(request["map"])
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(mapping)
            answer = b"ok"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            answer = f"{type(exc).__name__}: {exc}".encode()
        try:
            conn.send(answer)
        except OSError:
            return


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
                    made.append(sysc.netns_fd())
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
