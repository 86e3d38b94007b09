"""The child side of fork: the REPL process forks itself; each child enters its own sandbox.

The daemon sends one ``fork_slot`` per child (its control socket, network
namespace and cgroup fds, over SCM_RIGHTS), then ``fork`` to end the batch.
The REPL forks each child the moment its slot arrives, so a child sets itself
up while the daemon prepares the next; the REPL runs nothing else in between,
so every child starts from the same instant. The slots come while the daemon
still freezes the parent's layer: a child joins its cgroup and namespaces
meanwhile, then waits on its control socket for its ``root`` (the root tree,
built over that layer, and any further trees to attach). With the first slot
the REPL:

1. learns what its fds are and how many threads it has from the first slot
   itself: the daemon reads them from the host's /proc. The REPL cannot look
   itself: its /proc shows the command namespace Q, where it does not
   appear, and a proc of the family namespace P is what must stay out of
   every branch's reach (it would open its siblings' files and memory);
2. freezes the garbage collector's view of every live object (``gc.freeze``,
   so no collection ever writes to the shared pages).

Then, per slot, it ``fork()``s; its ``pid_for_children`` is always the family
namespace P (commands are born in Q through the spawner, see ``bb_init.c``),
so children are flat in P — a namespace per generation would stop at 32
levels and tie a child's life to its parent's.
Memory is shared copy-on-write by the kernel: nothing is serialized. Each
child enters its sandbox (``entry``), restores the working directory,
re-opens inherited files and directories in its own root at the same offsets
(so its writes never land in the parent's files), turns every other
inherited fd (sockets, pipes) into /dev/null, and serves its own control
socket.
"""

from __future__ import annotations

import _signal
import _thread
import contextlib
import ctypes
import functools
import gc
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

from . import entry, huge_heap, private_memory, protocol, sysc

_OPEN_FLAGS_KEPT = ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC | 0o2000000)  # and not O_CLOEXEC
_O_CLOEXEC = 0o2000000


class _Slot:
    """What the daemon sent for one child of a fork: its id and the fds it enters with.

    This module's classes are plain, not dataclasses: every REPL imports them at its
    start, and ``dataclasses`` (with ``inspect``, ``ast``...) was a sixth of that."""

    def __init__(self, sandbox_id: str, ctrl: int, netns: int | None,
                 repl_cgroup: list[int], cmds_cgroup: list[int]) -> None:
        self.sandbox_id = sandbox_id
        self.ctrl = ctrl
        self.netns = netns
        self.repl_cgroup = repl_cgroup
        self.cmds_cgroup = cmds_cgroup

    def fds(self) -> list[int]:
        return [self.ctrl, *([] if self.netns is None else [self.netns]),
                *self.repl_cgroup, *self.cmds_cgroup]


class _Batch:
    """What every child of one fork inherits, looked at once when its first slot arrives."""

    def __init__(self, started: float, reopen: list[tuple[int, str, int, int]],
                 close: list[int], listeners: list[_Listener], threads: int, cwd: str,
                 shared: list[private_memory.Shared], swap: bool) -> None:
        self.started = started
        self.reopen = reopen
        self.close = close  # every fd not re-opened, listeners too (they get /dev/null first)
        self.listeners = listeners
        self.threads = threads
        self.shared = shared
        self.swap = swap
        self.cwd = cwd
        self.pids: list[int] = []
        self.watched: set[int] = set()  # the agent's commands' pipes and pidfds: not the user's
        # The REPL's signal handlers, held from open_batch until the batch ends.
        self.signals: _HeldSignals | None = None

    @property
    def warning(self) -> str | None:
        if self.threads <= 1:
            return None
        return (f"the REPL had {self.threads} threads at fork time; a fork child has only "
                "the thread that forked, so locks held by the others stay held")


class _State:
    def __init__(self) -> None:
        self.spawner = -1  # socket to bb-init, which starts this sandbox's commands in Q
        self.listener = -1  # a signal filter's listener, until the daemon has taken it
        self.batch: _Batch | None = None  # a fork in progress (first slot to "fork")
        self.warning: str | None = None
        # User code's after-fork hooks that one of our forks held back (None: run them
        # at once, as for a fork of user code's own), and the thread that forks.
        self.held_hooks: list[Callable[[], object]] | None = None
        self.forking_thread = -1
        self.child_signals: _HeldSignals | None = None  # a fork child's, until it is ready


STATE = _State()


def boot(ctrl_fd: int, spawner_fd: int) -> None:
    """Entry point of a family's first REPL, right after exec into the image's python3."""
    huge_heap.strip_environ()  # before any user code sees os.environ
    STATE.spawner = spawner_fd
    for fd in (ctrl_fd, spawner_fd):
        os.set_inheritable(fd, False)
    from .main import run

    run(ctrl_fd)


def spawner_fd() -> int:
    """The socket commands are started through, or -1 outside a sandbox (the agent run
    bare, as in its tests, starts them itself)."""
    return STATE.spawner


def take_warning() -> str | None:
    """The fork warning for this REPL's first execution, once."""
    warning, STATE.warning = STATE.warning, None
    return warning


def handle_fork_slot(agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """Fork one child now. fds = [control socket, network namespace to join (if
    ``req["netns"]``: made ahead by the daemon), *repl cgroup, *cmds cgroup]; its root
    comes later, on that socket (:func:`become_child`). The first slot of a fork opens
    the batch; "fork" closes it. The first slot also carries ``inherit``: the REPL's
    fds, shared mappings and thread count as the daemon read them from the host's
    /proc."""
    slot = slot_from(req, fds)
    if slot is None:
        agent.fail(req["rid"], "InvalidRequest", "fork_slot got the wrong number of fds")
        return
    parent = os.getpid()
    try:
        batch = STATE.batch
        if batch is None:
            batch = open_batch(agent, slot.fds(), req.get("inherit") or {})
            STATE.batch = batch
        pid = _fork_flat()  # born in P: pid_for_children is P outside command_spawning
        if pid == 0:
            become_child(agent, slot, batch)
            return  # the child goes back to the request loop, now on its own socket
        batch.pids.append(pid)
    finally:
        if os.getpid() == parent:  # whatever happened, the slot's fds are spent here
            for fd in slot.fds():
                os.close(fd)
    agent.done(req["rid"], {"pid": pid})


def slot_from(req: dict, fds: list[int]) -> _Slot | None:
    """A child's slot from a ``fork_slot`` request (or a checkpoint's wake, which carries
    the same) and its fds; None, every fd closed, if they do not match."""
    try:
        nrepl, ncmds = int(req["nrepl"]), int(req["ncmds"])
        first = 2 if req.get("netns") else 1
        sandbox_id = str(req["id"])
        valid = nrepl >= 0 and ncmds >= 0 and len(fds) == first + nrepl + ncmds
    except (KeyError, TypeError, ValueError):
        valid = False
    if not valid:
        for fd in fds:
            os.close(fd)
        return None
    repl_end = first + nrepl
    return _Slot(sandbox_id, fds[0], fds[1] if first == 2 else None, fds[first:repl_end],
                 fds[repl_end:])


def _root(ctrl: int) -> tuple[int, list[tuple[int, str]]]:
    """The child's root tree and further trees to attach (fd, path), from the daemon's
    ``root`` message on the control socket: it comes once the parent's layer is frozen.
    Raises if the socket ends or the message does not parse (every fd it came with is
    closed then)."""
    sock = socket.socket(fileno=ctrl)
    try:
        header, _, fds = protocol.recv(sock)
    finally:
        sock.detach()
    try:
        paths = [str(path) for path in header["mounts"]]
        valid = header.get("op") == "root" and len(fds) == 1 + len(paths)
    except (KeyError, TypeError):
        valid = False
    if not valid:
        for fd in fds:
            os.close(fd)
        raise OSError("the daemon's root message did not parse")
    return fds[0], list(zip(fds[1:], paths, strict=True))


def open_batch(agent, received: list[int], inherit: dict) -> _Batch:
    """What every child of this instant inherits (fds, listeners, shared memory, cwd),
    from ``inherit`` as the daemon read it; ``received`` are the request's own fds."""
    started = time.perf_counter()
    skip = {*agent.own_fds(), *inherited(), *received}
    reopen, close = plan_fds(inherit.get("fds") or [], skip)
    threads = int(inherit.get("threads") or 1)
    shared = private_memory.plan(inherit.get("shared") or [])
    # Objects alive now move to the permanent generation: the cyclic GC never walks
    # them again, in the children or here, so it never writes to (and so copies) the
    # pages they share. A full collection would otherwise copy the whole heap per child.
    gc.freeze()
    batch = _Batch(started, reopen, close, describe_listeners(close), threads, os.getcwd(),
                   shared, bool(inherit.get("swap")))
    batch.watched = agent.watched_fds()  # closed too, but no user code opened them
    batch.signals = _HeldSignals()  # the caller ends the batch: end_batch()
    return batch


def end_batch(agent, batch: _Batch) -> None:
    """In the parent, once its children are made: its signal handlers back, and those of
    the signals that came meanwhile run from the request loop, as they would have."""
    if batch.signals is not None:
        batch.signals.release(agent)
        batch.signals = None


def inherited() -> list[int]:
    """This REPL's own sandbox fds, which a child closes (it gets its own)."""
    return [STATE.spawner] if STATE.spawner >= 0 else []


def handle_drop_listener(agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """The daemon has taken this child's signal listener (pidfd_getfd): let go of it before
    any user code can run here, since whoever holds it answers the filter's calls."""
    if STATE.listener >= 0:
        os.close(STATE.listener)
        STATE.listener = -1
        _user_code_may_run(agent)
    agent.done(req["rid"], {})


def handle_fork(agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """End of a fork: how long the REPL was held, and how many threads it had."""
    batch, STATE.batch = STATE.batch, None
    if batch is None:
        agent.fail(req["rid"], "InvalidRequest", "fork without fork_slot")
        return
    agent.done(req["rid"], {"pids": batch.pids, "threads": batch.threads,
                            "paused": time.perf_counter() - batch.started})
    end_batch(agent, batch)


def plan_fds(entries: list, skip: set[int]) -> tuple[list[tuple[int, str, int, int]], list[int]]:
    """What a child must do with each inherited fd: (fds to re-open as (fd, path, flags,
    offset), fds to close). ``entries`` are ``[fd, kind, path, flags, offset]`` as the
    daemon read them ("file" for regular files, directories and character devices).

    Files, directories and devices are re-opened by path in the child's own root, so
    nothing the child does through them reaches the parent's tree. Everything else
    (sockets, pipes, pidfds, deleted files, anything without a path) is closed: a
    channel into the parent is not something a fork may inherit. Entries that do not
    name a live fd of this process are ignored.
    """
    reopen, close = [], []
    for entry_ in entries:
        try:
            fd, kind, path, flags, pos = entry_
            fd, flags, pos = int(fd), int(flags), int(pos)
            os.fstat(fd)
        except (TypeError, ValueError, OSError):
            continue
        if fd in skip or fd <= 2:  # 0-2 are the agent's (/dev/null between calls)
            continue
        if kind == "file" and isinstance(path, str) and path.startswith("/") \
                and not path.endswith(" (deleted)"):
            reopen.append((fd, path, flags, pos))
        else:
            close.append(fd)
    return reopen, close


def _reopen(reopen: list[tuple[int, str, int, int]], close: list[int]) -> None:
    """Point inherited fds at this child's own files; the others become /dev/null (not
    closed: a Python object may still hold the number, which must not be reused)."""
    for fd, path, flags, pos in reopen:
        try:
            new = os.open(path, flags & _OPEN_FLAGS_KEPT)
            if pos:
                os.lseek(new, pos, os.SEEK_SET)
        except OSError:
            new = os.open("/dev/null", os.O_RDONLY)  # never keep writing into the parent's file
        os.dup2(new, fd, inheritable=not flags & _O_CLOEXEC)
        os.close(new)
    for fd in close:
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, fd, inheritable=False)
        os.close(null)


# Options a listening socket keeps in a fork child (read from the parent's, set on the
# new one before bind). Buffer sizes are left out: the kernel reports them doubled.
_SOCKOPTS = [(socket.SOL_SOCKET, socket.SO_REUSEADDR), (socket.SOL_SOCKET, socket.SO_REUSEPORT),
             (socket.SOL_SOCKET, socket.SO_KEEPALIVE), (socket.SOL_SOCKET, socket.SO_BROADCAST),
             (socket.IPPROTO_TCP, socket.TCP_NODELAY),
             (socket.IPPROTO_TCP, getattr(socket, "TCP_DEFER_ACCEPT", 9))]
_V6ONLY = (socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)


class _Listener:
    """A listening TCP or bound (unconnected) UDP socket of the parent, read at the fork
    instant: what a child needs to listen the same way in its own network."""

    __slots__ = ("address", "blocking", "family", "fd", "inheritable", "kind", "options")

    def __init__(self, fd: int, family: int, kind: int, address: tuple,
                 options: list[tuple[int, int, int]], blocking: bool,
                 inheritable: bool) -> None:
        self.fd, self.family, self.kind, self.address = fd, family, kind, address
        self.options, self.blocking, self.inheritable = options, blocking, inheritable

    def __str__(self) -> str:
        proto = "tcp" if self.kind == socket.SOCK_STREAM else "udp"
        return f"{proto} {self.address[0]}:{self.address[1]} (fd {self.fd})"


def describe_listeners(fds: list[int]) -> list[_Listener]:
    """The listening TCP and bound UDP sockets among ``fds`` (IPv4 and IPv6), read in the
    parent, so that a child (or a checkpoint's, long after) re-creates them without
    their old socket. A socket bound to a specific non-loopback address (the parent's
    own) is described on the wildcard: a child's address is another."""
    found = []
    for fd in fds:
        try:
            blocking, inheritable = os.get_blocking(fd), os.get_inheritable(fd)
            old = socket.socket(fileno=fd)  # sets O_NONBLOCK if a default timeout is set
        except OSError:
            continue
        try:
            listener = _describe(old, fd, blocking, inheritable)
        except OSError:
            listener = None
        finally:
            old.detach()  # the number stays the parent's
            with contextlib.suppress(OSError):
                os.set_blocking(fd, blocking)  # as the parent had it
        if listener is not None:
            found.append(listener)
    return found


def _describe(old: socket.socket, fd: int, blocking: bool,
              inheritable: bool) -> _Listener | None:
    family, kind = old.family, old.type
    if family not in (socket.AF_INET, socket.AF_INET6) or \
            kind not in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        return None
    if kind == socket.SOCK_STREAM and not old.getsockopt(socket.SOL_SOCKET,
                                                         socket.SO_ACCEPTCONN):
        return None  # connected (or never listened): gone in the child
    if kind == socket.SOCK_DGRAM:
        try:
            old.getpeername()
            return None  # a connected UDP socket is a connection
        except OSError:
            pass
    address = old.getsockname()
    if address[1] == 0:
        return None
    host = address[0]
    if host not in ("0.0.0.0", "::") and not host.startswith("127.") and host != "::1":
        address = ("0.0.0.0" if family == socket.AF_INET else "::", *address[1:])
    options = []
    for level, name in [*_SOCKOPTS, *([_V6ONLY] if family == socket.AF_INET6 else [])]:
        with contextlib.suppress(OSError):
            options.append((level, name, old.getsockopt(level, name)))
    return _Listener(fd, family, kind, address, options, blocking, inheritable)


def relisten(listeners: list[_Listener]) -> list[_Listener]:
    """Re-create ``listeners`` in this fork child's own network namespace: same family,
    type, port, options, blocking mode and fd number, so the REPL's socket objects listen
    here. Returns those made; the fd of one that could not be stays as it was (the
    caller made it /dev/null)."""
    made = []
    for listener in listeners:
        with contextlib.suppress(OSError):
            _listen(listener)
            made.append(listener)
    return made


def _listen(listener: _Listener) -> None:
    new = socket.socket(listener.family, listener.kind)
    try:
        for level, name, value in listener.options:
            with contextlib.suppress(OSError):
                new.setsockopt(level, name, value)
        new.bind(listener.address)
        if listener.kind == socket.SOCK_STREAM:
            new.listen(socket.SOMAXCONN)
        new.setblocking(listener.blocking)
        os.dup2(new.fileno(), listener.fd, inheritable=listener.inheritable)
    finally:
        new.close()


def _child_warning(threads: str | None, relistened: list[_Listener], closed: list[int],
                   shared: list[private_memory.Shared], zeroed: list[str]) -> str | None:
    """The child's first-execution warning: threads lost, sockets re-created or gone,
    shared memory made its own."""
    parts = [threads] if threads else []
    writable = [m for m in shared if m.writable]  # read-only ones (glibc's caches): silent
    if writable:
        parts.append(f"{len(writable)} shared memory mappings (mmap of files, multiprocessing "
                     "and shared_memory blocks) are this fork child's own copies: writes no "
                     "longer reach the parent or siblings")
    if zeroed:
        parts.append("shared memory that could not be copied is zeros here: "
                     + ", ".join(zeroed))
    if relistened:
        parts.append("listening sockets re-created in this fork child's own network: "
                     + ", ".join(map(str, relistened)))
    if closed:
        parts.append("inherited sockets, pipes and other non-file fds are /dev/null in "
                     "this fork child (established connections do not follow a fork): fds "
                     + ", ".join(map(str, closed)))
    return "; ".join(parts) or None


def become_child(agent, slot: _Slot, batch: _Batch) -> None:
    """Turn this process, just forked (from the REPL, or from a checkpoint woken for
    a restore), into the REPL of the sandbox ``slot`` describes, then say hello."""
    try:
        if batch.signals is not None:  # what was noted so far came to the parent
            batch.signals.noted.clear()
        STATE.child_signals, batch.signals = batch.signals, None
        for fd in inherited():
            os.close(fd)
        # Its own session and process group: kill(0) or a ^C to the group reaches this
        # branch only, never the parent it was forked from.
        os.setsid()
        listener = entry.enter_namespaces(slot.sandbox_id, slot.repl_cgroup, slot.netns)
        STATE.listener = -1 if listener is None else listener
        tree, mounts = _root(slot.ctrl)
        STATE.spawner = entry.enter_root(tree, entry.ATTACH, slot.cmds_cgroup, mounts)
        STATE.batch = None
        os.chdir(batch.cwd)
        _reopen(batch.reopen, batch.close)
        # Whatever else is open was opened after the daemon read the REPL's fds, in the
        # parent's sandbox: by an os.register_at_fork hook (run in this process before
        # it entered its own) or a thread of the parent. It would be a channel back.
        entry.close_fds_except({slot.ctrl, STATE.spawner, STATE.listener, *agent.own_fds(),
                                *batch.close, *(fd for fd, *_ in batch.reopen)})
        relistened = relisten(batch.listeners)
        made = {listener.fd for listener in relistened}
        closed = [fd for fd in batch.close if fd not in made and fd not in batch.watched]
        zeroed = private_memory.make_private(batch.shared, batch.swap)
        STATE.warning = _child_warning(batch.warning, relistened, closed, batch.shared, zeroed)
        ctrl = socket.socket(fileno=slot.ctrl)
        agent.reset_after_fork(ctrl)
        hello = {"pid": os.getpid()}
        if STATE.listener >= 0:  # user code waits until the daemon has taken it
            hello["signal_listener"] = STATE.listener
        else:
            _user_code_may_run(agent)
        protocol.send(ctrl, {"rid": 0, "ev": "done", "result": hello})
    except BaseException as exc:  # noqa: BLE001 - the daemon must learn why; then we vanish
        with contextlib.suppress(OSError):
            protocol.send(
                socket.socket(fileno=slot.ctrl),
                {
                    "rid": 0,
                    "ev": "fail",
                    "error": {
                        "type": "Conflict" if isinstance(exc, entry.SandboxChanged)
                        else "Internal",
                        "message": f"fork child set-up: {type(exc).__name__}: {exc}",
                    },
                },
            )
        os._exit(70)


_api = ctypes.pythonapi
_CLONE_PARENT = 0x00008000


def _fork_flat() -> int:
    """fork(), except that the child's parent is our parent (CLONE_PARENT).

    Every REPL of a family is then a child of the family's init, which reaps
    it when it ends: a closed fork child never lingers as a zombie of a
    still-running parent REPL (nor in its cgroup).
    """
    return fork_with(lambda: sysc.clone_fork(_CLONE_PARENT | signal.SIGCHLD))


def fork_with(clone) -> int:
    """Run ``clone()``, a raw fork of this process returning pid, 0 in the child, or
    -errno, between the interpreter's own before/after-fork hooks, just as os.fork()
    runs them; the agent is single-threaded, so no libc lock can be held. The
    after-fork hooks of user code (:func:`hold_fork_hooks`) wait in the child until it
    is in its own sandbox (:func:`become_child`)."""
    STATE.held_hooks, STATE.forking_thread = [], _thread.get_ident()
    pid = -1
    try:
        _api.PyOS_BeforeFork()
        pid = clone()
        if pid == 0:
            _api.PyOS_AfterFork_Child()
        else:
            _api.PyOS_AfterFork_Parent()
    finally:
        if pid != 0:
            STATE.held_hooks = None
    if pid < 0:
        raise OSError(-pid, f"clone: {os.strerror(-pid)}")
    return pid


class _HeldSignals:
    """The REPL's Python signal handlers, held back while a fork makes its children.

    A Python handler runs in the main thread between any two bytecodes, and what can
    signal the REPL during a fork is not frozen with its commands (a thread of user
    code, a process the REPL started itself). One that ran between two slots would
    run between two children, which would then come from different instants, and
    could write files while the parent's layer is frozen. So while the batch is open
    each handler is one that notes the signal; at the batch's end the parent gets its
    handlers back and each noted signal's handler runs once, in order of arrival (a
    signal pending twice is delivered once anyway), from the request loop as one
    arriving between requests would; a child does the same with only what came to it
    after the fork, once it is ready for user code.
    """

    def __init__(self) -> None:
        self.handlers: dict[int, Callable] = {}
        self.noted: dict[int, None] = {}  # signal numbers, in order of first arrival
        # _signal's own calls: signal's wrappers make an enum of every number (~80 us a
        # fork, while the REPL is held).
        for signum in _signal.valid_signals():
            handler = _signal.getsignal(signum)
            if callable(handler):  # not SIG_DFL / SIG_IGN, nor one set outside Python
                self.handlers[signum] = handler
                _signal.signal(signum, self._note)

    def _note(self, signum: int, frame: object) -> None:
        self.noted.setdefault(signum)

    def release(self, agent) -> None:
        for signum, handler in self.handlers.items():
            _signal.signal(signum, handler)
        for signum in self.noted:
            agent.call_later(0, functools.partial(self.handlers[signum], signum, None))
        self.noted = {}


def hold_fork_hooks() -> None:
    """Make the ``after_in_child`` hooks that user code registers from now on (with
    ``os.register_at_fork``) wait, in the children of our forks, until the child is in
    its own sandbox; forks of user code's own still run them at once.

    The interpreter runs them inside the fork, when a child of ours is still in its
    parent's sandbox: a hook that wrote a file (a log handler reopening its file, say)
    wrote it into the parent, or into the layer its siblings share. Called once at the
    REPL's start, before any user code; what the agent imported before has no hooks.
    """
    real = os.register_at_fork
    unset = object()

    def register_at_fork(*, before=unset, after_in_child=unset, after_in_parent=unset):
        given = {name: hook for name, hook in (("before", before),
                                               ("after_in_child", after_in_child),
                                               ("after_in_parent", after_in_parent))
                 if hook is not unset}
        if callable(after_in_child):
            given["after_in_child"] = _held(after_in_child)
        real(**given)  # its own errors for arguments it refuses

    register_at_fork.__doc__ = real.__doc__
    os.register_at_fork = register_at_fork
    sys.modules["posix"].register_at_fork = register_at_fork


def _held(hook: Callable[[], object]) -> Callable[[], None]:
    def after_in_child() -> None:
        # Only in a child of our fork (its thread is the one that forked): a thread of
        # user code may fork meanwhile, and its child runs its hooks at once.
        if STATE.held_hooks is None or _thread.get_ident() != STATE.forking_thread:
            hook()
        else:
            STATE.held_hooks.append(hook)
    return after_in_child


def _user_code_may_run(agent) -> None:
    """In a fork child now in its own sandbox (and rid of any signal listener): its
    signal handlers back, then the after-fork hooks held back, in the order registered;
    what one raises is printed and ignored, as the interpreter does with its own."""
    signals, STATE.child_signals = STATE.child_signals, None
    if signals is not None:
        signals.release(agent)
    hooks, STATE.held_hooks = STATE.held_hooks or [], None
    for hook in hooks:
        try:
            hook()
        except BaseException:  # noqa: BLE001 - SystemExit too: the child goes on
            import traceback

            print(f"Exception ignored in fork hook {hook!r}:", file=sys.stderr)
            traceback.print_exc()
