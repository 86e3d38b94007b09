"""Branches of one family cannot reach each other (issue 9, part 2), as hostile code would try.

Every attack runs as user code in a fork child's REPL — the process that shares
the family's PID namespace and credentials with its parent and siblings —
through the public SDK against real sandboxes.
"""

from __future__ import annotations

import ctypes
import os
import time

import pytest

from branchbox import Conflict, Sandbox, SandboxError

# ctypes helpers defined in the REPL; each returns the errno of a failed call, 0 on success
_SYSCALLS = r"""
import ctypes, os, signal
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

def _err(ret):
    return ctypes.get_errno() if ret < 0 else 0

def try_mount(source, target, fstype, flags):
    os.makedirs(target, exist_ok=True) if target else None
    b = lambda s: None if s is None else s.encode()
    return _err(_libc.mount(b(source), b(target), b(fstype), ctypes.c_ulong(flags), None))

def try_kill(pid, sig):
    try:
        os.kill(pid, sig)
        return 0
    except OSError as exc:
        return exc.errno

def try_join_net(pid):  # setns allows network namespaces only
    try:
        fd = os.pidfd_open(pid)
    except OSError as exc:
        return exc.errno
    try:
        return _err(_libc.syscall(308, fd, 0x40000000))
    finally:
        os.close(fd)

def try_setns_own_net():
    fd = os.open("/proc/1/ns/pid", os.O_RDONLY)  # its own sandbox's command namespace
    try:
        return _err(_libc.syscall(308, fd, 0x20000000))  # CLONE_NEWPID: the REPL once needed it
    finally:
        os.close(fd)
"""


def _family(make) -> tuple[Sandbox, Sandbox, Sandbox]:
    parent = make()
    parent.run_code(_SYSCALLS)
    a, b = parent.fork(n=2)
    return parent, a, b


def _pid(sb: Sandbox) -> int:
    return int(sb.run_code("os.getpid()").text)


def _alive(sb: Sandbox) -> None:
    assert sb.run_code("6 * 7").text == "42"


def test_a_branch_cannot_mount_its_family_namespace_proc(make) -> None:
    parent, a, b = _family(make)
    b.run_code("open('/root/secret', 'w').write('b only')")
    # A proc of the family namespace would show b's REPL and open /proc/PID/root of it.
    assert a.run_code("try_mount('proc', '/tmp/p', 'proc', 0)").text == "1"  # EPERM
    listing = a.run_code("sorted(os.listdir('/proc'))").text
    assert str(_pid(b)) not in listing.split(", ") or "'" + str(_pid(b)) + "'" not in listing
    assert not a.files.exists("/root/secret")


def test_a_branch_cannot_enter_another_namespace(make) -> None:
    parent, a, b = _family(make)
    assert a.run_code("try_setns_own_net()").text == "1"  # EPERM: only network namespaces
    # Network namespaces (fork children join the one made for them) only within reach:
    # never a sibling's or the parent's.
    for name, target in (("parent", parent), ("sibling", b)):
        got = a.run_code(f"try_join_net({_pid(target)})").text
        assert got == "1", f"joining the {name}'s network from a branch: errno {got}"
    # Nor the other way: a parent reaches its children's processes (Landlock nests their
    # domains in its own), but no pidfd of one can be had to join its network with.
    got = parent.run_code(f"try_join_net({_pid(a)})").text
    assert got == "1", f"joining a child's network from its parent: errno {got}"


def test_a_branch_cannot_signal_its_parent_or_siblings(make) -> None:
    parent, a, b = _family(make)
    targets = {"parent": _pid(parent), "sibling": _pid(b)}
    for name, pid in targets.items():
        got = a.run_code(f"try_kill({pid}, signal.SIGKILL)").text
        assert got == "1", f"SIGKILL to the {name} from a branch: errno {got}"
    a.run_code("try_kill(-1, signal.SIGKILL)")  # everything it may signal: only its own
    _alive(parent)
    _alive(b)


def test_a_branch_cannot_take_the_family_down_through_its_init(make) -> None:
    parent, a, b = _family(make)
    for sig in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1"):
        a.run_code(f"try_kill(1, signal.{sig})")
    _alive(parent)
    _alive(b)
    # Even the sandbox's own REPL may not signal the family init (it is outside its domain).
    assert parent.run_code("try_kill(1, signal.SIGINT)").text == "1"
    _alive(parent)


def test_a_branch_cannot_change_limits_or_scheduling_of_another(make) -> None:
    parent, a, b = _family(make)
    pid = _pid(b)
    code = (
        "import resource\n"
        "try:\n"
        f"    resource.prlimit({pid}, resource.RLIMIT_NOFILE, (0, 0)); r = 0\n"
        "except OSError as exc:\n"
        "    r = exc.errno\n"
        "r"
    )
    assert a.run_code(code).text == "1"
    prio = f"_err(_libc.setpriority(0, {pid}, 19))"
    assert a.run_code(prio).text == "1"
    assert a.run_code("_err(_libc.setpriority(2, 0, 19))").text == "1"  # PRIO_USER: all of uid 0
    assert a.run_code("os.sched_setaffinity(0, {0}) or 'own'").text == "'own'"
    assert b.run_code("import resource; resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 0").text \
        == "True"
    _alive(b)


def test_mount_flags_cannot_be_cleared_from_inside(make, tmp_path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    sb = make(workspace=str(ws))
    sb.run_code(_SYSCALLS)
    remount = 0x20 | 0x1000  # MS_REMOUNT | MS_BIND
    assert sb.run_code(f"try_mount(None, {str(ws)!r}, None, {remount})").text == "1"
    assert sb.run_code(f"try_mount(None, '/', None, {remount})").text == "1"
    # mount_setattr and fspick would change flags too
    assert sb.run_code("_err(_libc.syscall(442, -100, b'/', 0, None, 0))").text == "1"
    assert sb.run_code("_err(_libc.syscall(433, -100, b'/', 0))").text == "1"
    options = sb.exec(f"grep ' {ws} ' /proc/self/mountinfo").stdout
    assert "nodev" in options


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_kill_zero_stays_in_its_branch(make, sig) -> None:
    parent, a, b = _family(make)
    with pytest.raises(SandboxError):  # its own process group: it ends itself, nothing more
        a.run_code(f"try_kill(0, signal.{sig})")
    _alive(parent)
    _alive(b)


def test_fork_merge_rounds_go_on_past_the_landlock_nesting_limit(make) -> None:
    """Landlock nests 16 domains deep; fork → merge must keep working far beyond that."""
    sb = make()
    sb.run_code("n = 0")
    for _ in range(24):
        (child,) = sb.fork(n=1)
        child.run_code("n += 1")
        sb.merge_into(child)
    assert sb.run_code("n").text == "24"
    a, b = sb.fork(n=2)
    assert a.exec("echo ok").stdout == "ok\n"
    assert b.run_code("n").text == "24"


def test_branches_deeper_than_landlock_still_cannot_signal_each_other(make) -> None:
    """Past Landlock's 16 nested domains the daemon answers the branches' signal calls."""
    sb = make()
    sb.run_code(_SYSCALLS)
    for _ in range(18):
        (child,) = sb.fork(n=1)
        sb.merge_into(child)
    a, b = sb.fork(n=2)
    for name, target in (("parent", sb), ("sibling", b)):
        got = a.run_code(f"try_kill({_pid(target)}, signal.SIGKILL)").text
        assert got == "1", f"SIGKILL to the {name} from a deep branch: errno {got}"
        got = a.run_code(f"try_join_net({_pid(target)})").text
        assert got == "1", f"joining the {name}'s network from a deep branch: errno {got}"
    assert a.run_code("try_kill(-1, signal.SIGKILL)").text == "1"
    assert a.run_code(f"try_kill(-{_pid(b)}, signal.SIGKILL)").text == "1"  # b's group
    # What is its own still answers to it: a subprocess of the REPL, a background command
    # (the agent signals its process group), and a command's own children (in Q).
    own = "import subprocess; p = subprocess.Popen(['sleep', '30']); try_kill(p.pid, 9)"
    assert a.run_code(own).text == "0"
    assert a.run_code("p.wait()").text == "-9"
    background = a.exec("sleep 30", background=True)
    background.kill()
    assert a.exec("sleep 30 & kill $! && wait $!; echo $?").stdout.strip() == "143"
    _alive(sb)
    _alive(b)


_SHARED_MEMORY = r"""
import mmap, multiprocessing, os
from multiprocessing import shared_memory
with open("/root/data", "wb") as f:
    f.write(b"." * 8192)
data = open("/root/data", "r+b")
fm = mmap.mmap(data.fileno(), 8192)
fm[:11] = b"parent-data"          # in the page cache only: no flush, no write()
am = mmap.mmap(-1, 4096)
am[:6] = b"parent"
counter = multiprocessing.Value("i", 7)
block = shared_memory.SharedMemory(create=True, size=64 << 20)  # sparse: one page written
block.buf[:6] = b"parent"
"""


def test_a_branch_cannot_write_through_shared_memory_it_inherited(make) -> None:
    """MAP_SHARED mappings (an mmap-ed file, multiprocessing values, shared_memory blocks,
    anonymous shared memory) are one mapping in every process that inherits them; each
    fork child gets its own, so its writes reach neither its parent nor its siblings."""
    parent = make()
    parent.run_code(_SHARED_MEMORY)
    a, b = parent.fork(n=2)
    first = a.run_code(
        "fm[:5] = b'CHILD'; fm.flush(); am[:6] = b'child!'; counter.value = 99; "
        "block.buf[:6] = b'child!'"
    )
    assert first.error is None, first.error
    assert first.warnings and "shared memory" in first.warnings[0]
    look = "(bytes(fm[:11]), am[:6], counter.value, bytes(block.buf[:6]))"
    untouched = "(b'parent-data', b'parent', 7, b'parent')"
    assert parent.run_code(look).text == untouched
    assert b.run_code(look).text == untouched
    assert parent.exec("head -c 11 /root/data").stdout == "parent-data"
    assert b.exec("head -c 11 /root/data").stdout == "parent-data"
    # The child's writes are its own, in its own file and memory.
    assert a.run_code(look).text == "(b'CHILDt-data', b'child!', 99, b'child!')"
    assert a.exec("head -c 11 /root/data").stdout == "CHILDt-data"
    # And parent's writes after the fork do not reach the children either.
    parent.run_code("am[:6] = b'later!'; counter.value = 1; fm[:6] = b'LATER!'")
    assert b.run_code(look).text == untouched


def test_shared_memory_stays_shared_with_a_branch_own_processes(make) -> None:
    """Made its own, a child's shared memory is still shared with what the child starts."""
    parent = make()
    parent.run_code(_SHARED_MEMORY)
    (child,) = parent.fork(n=1)
    code = (
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    counter.value = 41; am[:5] = b'grand'; os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "(counter.value, am[:5])"
    )
    assert child.run_code(code).text == "(41, b'grand')"
    assert parent.run_code("(counter.value, am[:6])").text == "(7, b'parent')"


_REMOUNT_FROM_A_COMMAND = (
    "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
    "r = libc.mount(None, b'/', None, ctypes.c_ulong(0x20 | 0x1000), None); "
    "print(ctypes.get_errno() if r else 0)")


def test_commands_run_under_the_filter_in_every_sandbox(make) -> None:
    """What a command runs under is what bb-init runs under: in a family's first sandbox
    too (its bb-init was once started before the filter, and its commands had none)."""
    parent = make()
    (child,) = parent.fork(n=1)
    for name, sb in (("first sandbox", parent), ("fork child", child)):
        status = sb.exec("grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status").stdout.split()
        assert status == ["NoNewPrivs:", "1", "Seccomp:", "2"], f"{name}: {status}"
        refused = sb.exec(["python3", "-c", _REMOUNT_FROM_A_COMMAND]).stdout.strip()
        assert refused == "1", f"{name}: a command remounted / (errno {refused})"


def test_a_deleted_file_mapping_keeps_its_data_in_a_child(make) -> None:
    """A shared mapping of a file deleted since (nothing to map again in the child's root)
    is copied whole, evicted pages included, and is the child's own from then on."""
    parent = make()
    parent.run_code(
        "import mmap, os\n"
        "f = open('/root/gone', 'w+b'); f.write(b'%06d' % 7 * 4096); f.flush()\n"
        "os.fsync(f.fileno())\n"
        "gone = mmap.mmap(f.fileno(), 6 * 4096)\n"
        "os.unlink('/root/gone')\n"
        "os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache")
    (child,) = parent.fork(n=1)
    assert child.run_code("bytes(gone[:6]), bytes(gone[-6:])").text == \
        "(b'000007', b'000007')"
    child.run_code("gone[:6] = b'child!'")
    assert parent.run_code("bytes(gone[:6])").text == "b'000007'"


def test_a_parent_cannot_hand_its_branches_a_shared_file_as_a_device(make) -> None:
    """A child's /dev binds its parent's device nodes: a parent that bound one of its own
    files over /dev/null (its /dev is its own to change) would give every branch that
    file, one file they all write. A node that is not the device is refused instead."""
    sb = make()
    assert sb.exec("echo mine > /root/f && mount --bind /root/f /dev/null").exit_code == 0
    with pytest.raises(Conflict, match="/dev/null is not the device") as refused:
        sb.fork(2)
    assert refused.value.status == 409  # the sandbox's doing, not the daemon's failure
    assert sb.files.read("/root/f") == b"mine\n"
    assert sb.exec("umount -l /dev/null").exit_code == 0
    (kid,) = sb.fork(1)
    assert kid.exec("echo x > /dev/null && cat /dev/null").stdout == ""


def test_a_hook_run_at_fork_keeps_no_channel_into_the_parent(make) -> None:
    """An ``os.register_at_fork`` hook of user code runs in each fork child only once it
    is in its own sandbox: a file it opens is the child's own, never the parent's."""
    sb = make()
    sb.files.write("/root/secret", b"parent")
    sb.run_code("import os\n_kept = []\n"
                "os.register_at_fork(after_in_child=lambda: "
                "_kept.append(os.open('/root/secret', os.O_WRONLY)))")
    (kid,) = sb.fork(1)
    kid.run_code("os.write(_kept[0], b'CHILD!')")
    assert sb.files.read("/root/secret") == b"parent"
    assert kid.files.read("/root/secret") == b"CHILD!"


def test_a_child_that_did_not_enter_its_sandbox_is_refused(harness, make) -> None:
    """The agent that makes a child runs in the parent's process, where the parent's code
    can change it: a child that skipped its entry (here the parent replaced it) would
    serve from the parent's root and namespaces. The daemon checks from outside, also
    when the child was handed a network namespace made ahead (nothing else would stop
    it then)."""
    sb = make()
    family = harness.engine.live[sb.id].family.family
    for _ in range(500):
        if harness.engine.net.made.get(family.ident):
            break
        time.sleep(0.01)
    assert harness.engine.net.made.get(family.ident), "no namespace was made ahead"
    sb.run_code("import os, bbagent.entry as e\n"
                "def skip(hostname, repl, netns=None):\n"
                "    for fd in repl:\n"
                "        os.write(fd, b'0')\n"
                "e.enter_namespaces = skip\n"
                "e.enter_root = lambda tree, attach, cmds, mounts=(): -1")
    with pytest.raises(SandboxError, match="did not enter its sandbox"):
        sb.fork(1)
    assert sb.run_code("1 + 1").text == "2"


TAKE_ALL = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
held, tid = 0, ctypes.c_void_p()
while held < 200_000 and (libc.inotify_init1(0) >= 0 if KIND == "inotify"
                          else libc.timer_create(1, None, ctypes.byref(tid)) == 0):
    held += 1
held, ctypes.get_errno()
"""
ONE_MORE = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
tid = ctypes.c_void_p()
ok = libc.inotify_init1(0) >= 0 if KIND == "inotify" else \
    libc.timer_create(1, None, ctypes.byref(tid)) == 0
ok, ctypes.get_errno()
"""


@pytest.mark.parametrize("kind", ["inotify", "timers"])
def test_a_sandbox_takes_only_its_familys_share_of_kernel_budgets(make, kind) -> None:
    """The kernel counts inotify instances (128 a user by default) and pending signals
    (POSIX timers; 96,365) against the owner of each user namespace up the chain. Every
    family's namespace was owned by the host's root (or by a template's, owned by it):
    one sandbox took them all, and the host's root, and every other family, had none
    (``timeout`` failed on the host). Now each family's are its own ids', capped per
    family within a template (``launching.FAMILY_SYSCTLS``, ``FAMILY_RLIMITS``)."""
    greedy, other = make(), make()
    held, errno_ = eval(greedy.run_code(f"KIND = {kind!r}\n" + TAKE_ALL).text)
    assert errno_ in (11, 24) and 0 < held < 100_000, (held, errno_)  # EAGAIN, EMFILE
    assert eval(other.run_code(f"KIND = {kind!r}\n" + ONE_MORE).text)[0] is True
    libc = ctypes.CDLL(None, use_errno=True)  # the host's root: this test process
    if kind == "inotify":
        fd = libc.inotify_init1(0)
        assert fd >= 0, f"the host's root got no inotify instance: errno {ctypes.get_errno()}"
        os.close(fd)
    else:
        timer = ctypes.c_void_p()
        assert libc.timer_create(1, None, ctypes.byref(timer)) == 0, ctypes.get_errno()
        libc.timer_delete(timer)
    greedy.close()
