"""How a process becomes a sandbox: the exact privileged sequence, one step per call.

Both the first REPL of a family (spawned by ``runtime.family_init``) and every
fork child (``agent.forking``) go through these steps before any user code runs:
:func:`enter_sandbox` takes them all; a fork child takes steps 1-4
(:func:`enter_namespaces`) while the daemon still freezes its parent's layer, and
steps 5-8 (:func:`enter_root`) once its root tree came. The caller is uid 0 of
the family's user namespace, with its
capabilities, and its active PID namespace is the family namespace P. The
order matters:

1. join the sandbox's cgroups (fds opened by the daemon), so everything the
   sandbox later starts is limited and killable as one; and enter a Landlock
   domain of its own scoped for signals, so nothing in this branch can signal
   its parent or a sibling (which are other processes of the same family
   namespace P, with the same credentials): a fork child's domain nests in
   its parent's. Landlock nests at most 16 deep; past that a child shares its
   parent's domain and its line of descent gets, once, a second seccomp
   filter whose signal calls the daemon answers (``confine.supervise_signals``);
2. unshare mount, network, UTS and IPC namespaces (not PID: the REPL stays
   flat in P and never changes its pid_for_children, so P can belong to the
   host's user namespace, out of reach of sandbox root — see step 6); a fork
   child the daemon made a network namespace for ahead (plugged, addressed,
   owned by the family's user namespace) joins that one instead;
3. make every mount private, so nothing propagates back to the parent;
4. hostname = sandbox id, loopback up;
5. attach the root tree the daemon built (a detached overlay mount), and
   inside it any further trees (a workspace at its host path);
6. spawn ``bb-init`` (``bb_init.c``): it unshares the sandbox's command PID
   namespace Q, forks Q's init, which mounts the new /proc (a proc mount
   shows the PID namespace of the process that mounts it) — before the old
   root is detached, because inside a user namespace the kernel refuses a
   proc mount unless another proc mount is fully visible — and then starts
   every command of the sandbox in Q on the REPL's request;
7. a minimal /dev (tmpfs + binds of the harmless character devices, devpts),
   made while bb-init starts (it mounts only /proc, and opens the current root's
   /dev/null, not this one): then wait for bb-init's word that /proc is mounted;
8. pivot_root into the tree and detach the old root.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import stat
import struct

from . import confine, sysc

AGENT_DIR = "/.branchbox"  # the agent layer's directory inside every sandbox root
OLD_ROOT = AGENT_DIR + "/oldroot"  # where pivot_root parks the previous root
ATTACH = AGENT_DIR + "/root"  # where a fork child attaches its new tree before pivoting
# The character devices a sandbox's /dev binds, by minor number (major 1: mem devices).
_DEVICES = {"null": 3, "zero": 5, "full": 7, "random": 8, "urandom": 9}
_AT_EMPTY_PATH = 0x1000
_SIOCSIFFLAGS = 0x8914
_IFF_UP_LOOPBACK_RUNNING = 0x1 | 0x8 | 0x40


def _loopback_up() -> None:
    """Bring ``lo`` up in the fresh network namespace (it starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH14x", b"lo", _IFF_UP_LOOPBACK_RUNNING)
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, ifr)


def close_fds_except(keep: set[int]) -> None:
    """Close every fd from 3 up except ``keep`` (no /proc needed: it may show another ns)."""
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)


def reap_forever() -> None:
    """Be a PID namespace's init: reap every orphan, never return, hold no fds."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    while True:
        signal.sigwaitinfo({signal.SIGCHLD})
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def _mount_dev(root: str) -> None:
    dev = root + "/dev"
    sysc.mount("tmpfs", dev, "tmpfs", sysc.MS_NOSUID | sysc.MS_NOEXEC, "mode=755,size=65536k")
    for name, minor in _DEVICES.items():
        target = f"{dev}/{name}"
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o666))
        _bind_device(f"/dev/{name}", minor, target)
    os.mkdir(dev + "/pts")
    sysc.mount(
        "devpts",
        dev + "/pts",
        "devpts",
        sysc.MS_NOSUID | sysc.MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=620",
    )
    os.symlink("pts/ptmx", dev + "/ptmx")
    os.mkdir(dev + "/shm", 0o1777)
    sysc.mount(
        "tmpfs", dev + "/shm", "tmpfs", sysc.MS_NOSUID | sysc.MS_NODEV, "mode=1777,size=65536k"
    )
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{dev}/{name}")
    os.symlink("/proc/self/fd", dev + "/fd")


class SandboxChanged(OSError):
    """What a child's entry takes from its parent's sandbox is not what it must be: the
    parent's own code changed it (its /dev, say). The fork is refused as a conflict with
    the sandbox's state, not reported as the daemon's failure."""


def _bind_device(path: str, minor: int, target: str) -> None:
    """Bind the device node at ``path`` (in the current root) onto ``target``, if it is
    that character device; checked and bound through one fd, so nothing can swap it in
    between. mknod is refused in a user namespace; a bind of an existing node is not.
    The node is the parent's (or the host's, for a family's first sandbox): a parent's
    /dev is its own to change, and an ordinary file bound there would be one file that
    all its branches share."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISCHR(st.st_mode) or st.st_rdev != os.makedev(1, minor):
            raise SandboxChanged(errno.ENODEV, f"{path} is not the device it should be")
        tree = sysc.open_tree("", sysc.OPEN_TREE_CLONE | _AT_EMPTY_PATH | os.O_CLOEXEC, fd)
    finally:
        os.close(fd)
    try:
        sysc.move_mount_fd(tree, target)
    finally:
        os.close(tree)


class Entered:
    """What a process that entered its sandbox holds: the socket to its spawner, and the
    listener of a signal filter it had to add (to hand to the daemon), or None.

    A plain class, not a dataclass: every family's launcher imports this module, and
    ``dataclasses`` (with ``inspect``) is a third of its start-up."""

    __slots__ = ("listener", "spawner")

    def __init__(self, spawner: int, listener: int | None) -> None:
        self.spawner = spawner
        self.listener = listener


_SUPERVISED = False  # a signal filter is on this line of descent already (fork copies it)


def _own_signal_scope() -> int | None:
    """A Landlock signal domain nested in the parent's; past Landlock's depth, the daemon's
    signal filter (once per line of descent). Returns that filter's listener, if added."""
    global _SUPERVISED
    try:
        sysc.landlock_scope_signals()
        return None
    except OSError as exc:
        if exc.errno != errno.E2BIG:
            raise
    if _SUPERVISED:
        return None
    _SUPERVISED = True
    return confine.supervise_signals()


def enter_sandbox(
    tree_fd: int,
    attach: str,
    hostname: str,
    repl_cgroup_fds: list[int],
    cmds_cgroup_fds: list[int],
    mounts: list[tuple[int, str]] = (),
    netns: int | None = None,
) -> Entered:
    """Turn the calling process into a sandbox's REPL process; returns its spawner socket
    (close-on-exec), through which it starts commands in Q, and a signal listener if one
    was added.

    ``attach`` is an empty directory of the current root where the tree is
    attached before pivoting. Every fd given is consumed: ``tree_fd``,
    ``repl_cgroup_fds``, ``cmds_cgroup_fds`` (bb-init joins them, and every command
    it starts inherits them), ``mounts``, more detached trees (fd, absolute path
    in the sandbox) to attach inside the root — a workspace — and ``netns``, a
    network namespace to join instead of making one.
    """
    listener = enter_namespaces(hostname, repl_cgroup_fds, netns)
    return Entered(enter_root(tree_fd, attach, cmds_cgroup_fds, mounts), listener)


def enter_namespaces(hostname: str, repl_cgroup_fds: list[int],
                     netns: int | None = None) -> int | None:
    """Steps 1-4 (what needs no root tree): a fork child takes them while the daemon
    still freezes its parent's layer. Returns a signal listener if one was added.
    Consumes ``repl_cgroup_fds`` and ``netns``."""
    for fd in repl_cgroup_fds:  # 1
        os.write(fd, b"0")
        os.close(fd)
    listener = _own_signal_scope()
    sysc.unshare(
        sysc.CLONE_NEWNS
        | (sysc.CLONE_NEWNET if netns is None else 0)
        | sysc.CLONE_NEWUTS  # 2
        | sysc.CLONE_NEWIPC
    )
    if netns is not None:
        sysc.setns(netns, sysc.CLONE_NEWNET)
        os.close(netns)
    sysc.mount(None, "/", None, sysc.MS_REC | sysc.MS_PRIVATE)  # 3
    socket.sethostname(hostname)  # 4
    if netns is None:  # a namespace made ahead has it up already
        _loopback_up()
    return listener


def enter_root(tree_fd: int, attach: str, cmds_cgroup_fds: list[int],
               mounts: list[tuple[int, str]] = ()) -> int:
    """Steps 5-8, after :func:`enter_namespaces`; returns the spawner socket. Consumes
    ``tree_fd``, ``cmds_cgroup_fds`` and ``mounts``."""
    sysc.move_mount_fd(tree_fd, attach)  # 5
    os.close(tree_fd)
    for fd, path in mounts:
        sysc.move_mount_fd(fd, attach + path)
        os.close(fd)
    # Everything from here on starts inside the new root: a process forked now keeps
    # this directory, and pivot_root moves only roots and cwds equal to the old root.
    os.chdir(attach)
    ready_r, ready_w = os.pipe()  # 6
    spawner, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    init = attach + AGENT_DIR + "/bb-init"
    # bb-init is spawned (vfork + exec), never forked: a fork would copy the page tables
    # of this whole process, which may hold gigabytes. It gets its fds by number.
    handed = [ready_w, theirs.fileno(), *cmds_cgroup_fds]
    for fd in handed:
        os.set_inheritable(fd, True)
    try:
        os.posix_spawn(init, [init, attach + "/proc", *map(str, handed)], {})
    finally:
        for fd in handed:
            os.close(fd)
        theirs.detach()
    try:
        _mount_dev(attach)  # 7
        answer = os.read(ready_r, 4096)
    except BaseException:
        spawner.close()
        raise
    finally:
        os.close(ready_r)
    if answer != b"\0":
        spawner.close()
        raise OSError(answer.decode(errors="replace") or "bb-init died before mounting /proc")
    sysc.pivot_root(attach, attach + OLD_ROOT)  # 8
    os.chdir("/")
    sysc.umount2(OLD_ROOT, sysc.MNT_DETACH)
    return spawner.detach()
