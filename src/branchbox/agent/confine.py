"""The seccomp filter and no_new_privs every sandbox process runs under.

Installed once, by a family's first REPL before it enters its sandbox (so
before it spawns bb-init, which starts every command); fork children, bb-init
and commands inherit it (filters survive fork and exec), so it is never
stacked twice. It is a deny-list: sandbox root must
keep what a root shell inside a container can do (mount inside its own
namespaces, unshare — the REPL itself needs those to set up fork children),
and loses what only reaches the kernel or other processes' memory: ptrace
and its relatives, kernel modules and kexec, BPF, perf events, keyrings,
file handles (open_by_handle_at can escape a mount), and setns into anything
but a network namespace (commands are born in their namespaces by bb-init).

Mount flags the daemon set (nodev, nosuid, ro) must hold: the trees it hands
a sandbox are attached inside the sandbox's own mount namespace, where the
kernel does not lock their flags, so sandbox root could otherwise clear
nodev on a workspace and use a device node it holds. Every way to change
the flags of an existing mount is refused: ``mount`` with MS_REMOUNT,
``mount_setattr`` and ``fspick`` (reconfigure a superblock). A bind or a
clone of a mount keeps its flags, and a filesystem mounted from inside a
user namespace is nodev by the kernel's own rule.

Calls that act on another process by pid are allowed only on the caller
itself (pid 0): every REPL of a family sits in the same PID namespace with
the same credentials, so ``prlimit64(sibling, RLIMIT_CPU, 0)`` or a
scheduler change would otherwise reach a sibling branch (signals are kept
in their branch by Landlock, see ``entry``).

``setns`` is allowed for network namespaces only, so that a fork child can
join the one the daemon made ahead for it. The kernel asks CAP_SYS_ADMIN
over the namespace's owner (the host's is out of reach); a namespace of
another branch could be reached only through a pidfd of one of its
processes, and ``pidfd_open`` is refused: every REPL of a family shares
the family PID namespace, and Landlock gives a branch ptrace access over
the branches forked from it, so a parent could otherwise join a child's
network and its egress policy. A pidfd of a process one starts comes with
its clone (bb-init hands the REPL those of commands).

Landlock nests only 16 domains deep. A branch past that depth adds a second
filter (:func:`supervise_signals`) whose signal calls the daemon answers:
the kernel holds the caller while the daemon checks that the target is in
the caller's own sandbox (``runtime/signal_guard.py``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

from . import sysc

_AUDIT_ARCH_X86_64 = 0xC000003E
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_SECCOMP_RET_KILL_PROCESS = 0x80000000

# BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_RET_K = 0x06

_JSET_K = 0x45
_JGE_K = 0x35
_X32_SYSCALL_BIT = 0x40000000  # x32 calls come with the x86_64 arch and this bit set

# struct seccomp_data offsets
_NR, _ARCH = 0, 4

_SYS_MOUNT = 165
# syscall -> (argument index, the only value allowed): "this process" for calls that take a
# pid (0), PRIO_PROCESS/IOPRIO_WHO_PROCESS where a "which" selects what the pid means;
# for setns, the namespace type.
_ONLY_SELF = {
    "prlimit64": (302, ((0, 0),)),
    "sched_setaffinity": (203, ((0, 0),)),
    "sched_setscheduler": (144, ((0, 0),)),
    "sched_setparam": (142, ((0, 0),)),
    "sched_setattr": (314, ((0, 0),)),
    "migrate_pages": (256, ((0, 0),)),
    "move_pages": (279, ((0, 0),)),
    "setpriority": (141, ((0, 0), (1, 0))),
    "ioprio_set": (251, ((0, 1), (1, 0))),
    "setns": (308, ((1, sysc.CLONE_NEWNET),)),  # not "self": the one namespace type allowed
}
_MS_REMOUNT = 0x20
DENIED = {
    "pidfd_open": 434,  # a pidfd of another branch's REPL would reach its network (setns)
    "mount_setattr": 442,
    "fspick": 433,
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "pidfd_getfd": 438,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
    "kexec_load": 246,
    "kexec_file_load": 320,
    "bpf": 321,
    "perf_event_open": 298,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "open_by_handle_at": 304,
    "name_to_handle_at": 303,
    "userfaultfd": 323,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "acct": 163,
}


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def _args(index: int) -> int:
    """Offset of the low 32 bits of syscall argument ``index`` in struct seccomp_data."""
    return 16 + 8 * index


def _native_nr() -> list[bytes]:
    """Kill a call of another ABI (another arch, or x86_64's x32 calls, whose numbers
    carry bit 30: every rule below names native numbers only), then load the number."""
    return [
        _insn(_LD_W_ABS, 0, 0, _ARCH),
        _insn(_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
        _insn(_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0, 0, _NR),
        _insn(_JGE_K, 0, 1, _X32_SYSCALL_BIT),
        _insn(_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS),
    ]


def _program() -> bytes:
    eperm = _SECCOMP_RET_ERRNO | errno.EPERM
    prog = _native_nr()
    for nr in DENIED.values():
        prog += [_insn(_JEQ_K, 0, 1, nr), _insn(_RET_K, 0, 0, eperm)]
    for nr, conds in _ONLY_SELF.values():
        block = []
        for i, (arg, value) in enumerate(conds):  # any mismatch jumps to the EPERM below
            block += [_insn(_LD_W_ABS, 0, 0, _args(arg)),
                      _insn(_JEQ_K, 0, 2 * (len(conds) - i) - 1, value)]
        block += [_insn(_RET_K, 0, 0, _SECCOMP_RET_ALLOW), _insn(_RET_K, 0, 0, eperm)]
        prog += [_insn(_JEQ_K, 0, len(block), nr), *block]
    prog += [
        _insn(_JEQ_K, 0, 3, _SYS_MOUNT),
        _insn(_LD_W_ABS, 0, 0, _args(3)),  # mount's flags
        _insn(_JSET_K, 0, 1, _MS_REMOUNT),
        _insn(_RET_K, 0, 0, eperm),
        _insn(_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
    ]
    return b"".join(prog)


_SECCOMP_RET_USER_NOTIF = 0x7FC00000
_SYS_SECCOMP = 317
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
# Calls that signal, or take a handle to, a process named by pid; kill(0, ...) (this
# process group, always within the branch) is answered by the filter itself.
SIGNALLING = {"kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129,
              "rt_tgsigqueueinfo": 297, "pidfd_open": 434}


def _signal_program() -> bytes:
    notify = _SECCOMP_RET_USER_NOTIF
    prog = [
        *_native_nr(),
        _insn(_JEQ_K, 0, 4, SIGNALLING["kill"]),
        _insn(_LD_W_ABS, 0, 0, _args(0)),
        _insn(_JEQ_K, 0, 1, 0),
        _insn(_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
        _insn(_RET_K, 0, 0, notify),
    ]
    for name, nr in SIGNALLING.items():
        if name != "kill":
            prog += [_insn(_JEQ_K, 0, 1, nr), _insn(_RET_K, 0, 0, notify)]
    prog.append(_insn(_RET_K, 0, 0, _SECCOMP_RET_ALLOW))
    return b"".join(prog)


def _install(code: bytes, flags: int = 0) -> int:
    filters = ctypes.create_string_buffer(code)
    fprog = ctypes.create_string_buffer(
        struct.pack("HxxxxxxQ", len(code) // 8, ctypes.addressof(filters)))
    ret = sysc.libc().syscall(ctypes.c_long(_SYS_SECCOMP), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                              ctypes.c_long(flags), fprog)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp: {os.strerror(err)}")
    return ret


def supervise_signals() -> int:
    """Add the filter that hands this process's (and its descendants') signal calls to the
    daemon; returns the listener fd, which must reach the daemon and leave this process
    before any user code runs (whoever holds it answers the calls)."""
    return _install(_signal_program(), _SECCOMP_FILTER_FLAG_NEW_LISTENER)


def confine() -> None:
    """no_new_privs, then the filter, for this process and everything it will start."""
    sysc.prctl(sysc.PR_SET_NO_NEW_PRIVS, 1)
    _install(_program())
