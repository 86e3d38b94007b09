"""Issue 9, part 4: bounds on what hostile input can cost the daemon, on both backends.

- diff is bounded: a sparse file of 1 EiB apparent size, a FIFO, a big file shared by a
  snapshot cost (almost) nothing; a change inside a sparse file's data is still found;
  past its budget a file is reported modified and "unverified", never called equal;
  other families' create and close go on while a diff runs.
- bad input is a 400 with {"error"} (the SDK's InvalidRequest), never a 500.
- /proc/self/mountinfo inside a sandbox names no host path of the store or the images.
"""

from __future__ import annotations

import math
import os
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest

from branchbox import InvalidRequest, ResourceLimit, SandboxTimeout
from branchbox.sdk._portal import portal
from branchbox.storage import layerdiff

LIVENESS = 30.0  # seconds: a bound on "returns at all", not a timing assertion


def _diff_in_thread(a, b) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["diff"] = a.diff(b)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# ------------------------------------------------------------------------------ diff

def test_diff_of_an_exabyte_sparse_file_is_prompt_while_others_create_and_close(
        harness, make) -> None:
    parent = make()
    # ext4 (the copy backend's store here) stops at 16 TiB; btrfs takes a whole exabyte.
    size = parent.exec("truncate -s 1E /root/huge 2>/dev/null || truncate -s 15T /root/huge;"
                       " stat -c %s /root/huge").stdout.strip()
    assert int(size) >= 15 << 40
    a, b = parent.fork(2)
    make_pair = [a, b]
    a.exec("touch /root/huge")  # a copy-up in a; b still reads the frozen layer
    thread, out = _diff_in_thread(a, b)
    # Meanwhile another family is created and closed: the diff does not hold them up.
    other = harness.sandbox()
    assert other.run_code("1 + 1").text == "2"
    other.close()
    thread.join(LIVENESS)
    assert not thread.is_alive(), "diff of a sparse file did not return"
    assert "error" not in out, out.get("error")
    assert out["diff"] == {"added": [], "removed": [], "modified": []}
    assert parent.diff(b) == {"added": [], "removed": [], "modified": []}
    for sb in make_pair:
        sb.close()


def test_diff_finds_one_changed_byte_in_the_data_of_a_sparse_8_gib_file(
        make, monkeypatch) -> None:
    """Only the data regions are read: 4 MiB of data in 8 GiB fit a 64 MiB budget."""
    monkeypatch.setattr(layerdiff, "READ_BUDGET", 64 << 20)
    parent = make()
    parent.exec("truncate -s 8G /root/big && yes abc | head -c 4M | "
                "dd of=/root/big bs=1M seek=4096 conv=notrunc status=none")
    a, b = parent.fork(2)
    offset = (4096 << 20) + 12345
    a.exec(f"printf X | dd of=/root/big bs=1 seek={offset} conv=notrunc status=none")
    assert a.exec(f"tail -c +{offset + 1} /root/big | head -c 1").stdout == "X"
    started = time.monotonic()
    assert a.diff(b) == {"added": [], "removed": [], "modified": ["/root/big"]}
    assert b.diff(parent) == {"added": [], "removed": [], "modified": []}
    assert time.monotonic() - started < LIVENESS
    a.close()
    b.close()


def test_diff_of_big_files_shared_by_a_snapshot(harness, make, monkeypatch) -> None:
    """btrfs: the parent's file and the fork's frozen copy share extents, so they are equal
    without a byte read (a 1 MiB budget for a 64 MiB file), even after a copy-up in the
    child (overlayfs reflinks it); a change still in the page cache is not hidden by the
    shared extent. The copy backend has no shared extents: the same file is read (and
    equal) within the default budget, and past a small one it is reported modified and
    unverified, never equal."""
    parent = make()
    parent.exec("head -c 64M /dev/urandom > /root/blob")
    (child,) = parent.fork(1)
    clean = {"added": [], "removed": [], "modified": []}
    if harness.backend == "btrfs":
        monkeypatch.setattr(layerdiff, "READ_BUDGET", 1 << 20)
        assert parent.diff(child) == clean
        child.exec("touch /root/blob")  # copied up into the child's own layer
        assert parent.diff(child) == clean
        parent.exec("printf X | dd of=/root/blob bs=1 seek=33554432 conv=notrunc "
                    "status=none")
        monkeypatch.setattr(layerdiff, "READ_BUDGET", 64 << 20)
        assert parent.diff(child)["modified"] == ["/root/blob"]
    else:
        assert parent.diff(child) == clean
        monkeypatch.setattr(layerdiff, "READ_BUDGET", 1 << 20)
        assert parent.diff(child) == {"added": [], "removed": [], "modified": ["/root/blob"],
                                      "unverified": ["/root/blob"]}
    child.close()


def test_diff_never_opens_a_fifo(make) -> None:
    parent = make()
    a, b = parent.fork(2)
    for sb in (a, b):
        sb.exec("mkfifo /tmp/pipe && mknod /tmp/null c 1 3")
    thread, out = _diff_in_thread(a, b)
    thread.join(LIVENESS)
    assert not thread.is_alive(), "diff blocked on a FIFO"
    assert out.get("diff") == {"added": [], "removed": [], "modified": []}, out
    a.close()
    b.close()


def test_diff_past_its_time_budget_fails_with_a_clear_error(make, monkeypatch) -> None:
    parent = make()
    a, b = parent.fork(2)
    b.exec("mkdir -p /root/many && touch /root/many/f{1..50}")
    monkeypatch.setattr(layerdiff, "TIME_BUDGET", 0.0)
    with pytest.raises(SandboxTimeout, match="narrower paths"):
        a.diff(b)
    a.close()
    b.close()


class _CountedBudget(layerdiff.Budget):
    """A budget whose clock is its own checks: out after ``checks`` of them."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.checks = checks

    def expired(self) -> bool:
        self.checks -= 1
        return self.checks < 0


def test_resolving_a_removed_subtree_counts_against_the_listing_deadline(
        tmp_path: Path) -> None:
    """A sandbox that removed a directory of 300,000 files: the 300,000 paths it hid were
    listed within the deadline, then each resolved through every layer with no look at
    the clock (a diff refused at 10 s took 30 s more). 40 files, listed (and resolved)
    from both sides: the listing takes 81 checks, the resolving must run out by 100."""
    shared = tmp_path / "shared" / "root" / "wide"
    shared.mkdir(parents=True)
    for i in range(40):
        (shared / f"f{i}").touch()
    for name in ("mine", "other"):
        (tmp_path / name / "root").mkdir(parents=True)
    os.mknod(tmp_path / "other" / "root" / "wide", stat.S_IFCHR | 0o600, 0)  # a whiteout
    layers = ([tmp_path / "mine", tmp_path / "shared"], [tmp_path / "other", tmp_path / "shared"])
    assert len(layerdiff.diff_layers(*layers, ["/root"], _CountedBudget(10_000))["removed"]) == 40
    with pytest.raises(layerdiff.DiffTooLarge):
        layerdiff.diff_layers(*layers, ["/root"], _CountedBudget(100))


def test_a_cancelled_diff_stops(tmp_path: Path) -> None:
    """The flag a cancelled request sets stops the worker at its next check."""
    for name in ("a", "b"):
        (tmp_path / name / "root").mkdir(parents=True)
        (tmp_path / name / "root" / "f").write_bytes(b"x")
    budget = layerdiff.Budget()
    budget.cancelled.set()
    with pytest.raises(layerdiff.DiffCancelled):
        layerdiff.diff_layers([tmp_path / "a"], [tmp_path / "b"], ["/root"], budget)


# ------------------------------------------------------------------------ bad input

LONG_CWD = "/" + "a" * 5000
LONG_NAME_CWD = "/" + "b" * 256


def _rest_400(harness, method: str, path: str, body: dict) -> str:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=harness.transport(),
                                     base_url="http://sandbox") as client:
            return await client.request(method, path, json=body)

    reply = portal.run(go())
    assert reply.status_code == 400, (body, reply.status_code, reply.text[:300])
    message = reply.json()["error"]
    assert isinstance(message, str) and len(message) < 400
    return message


@pytest.mark.parametrize("pool", ["warm", "cold"])
def test_a_cwd_that_is_not_a_directory_is_an_invalid_request(harness, monkeypatch,
                                                            pool) -> None:
    if pool == "cold":  # a new family, not a hand-out from the warm pool
        async def cold(image: str) -> None:
            return None

        monkeypatch.setattr(harness.engine, "_take_warm", cold)
    else:
        portal.run(harness.engine.settle())
    with pytest.raises(InvalidRequest, match="/dev/null"):
        harness.sandbox(cwd="/dev/null")
    _rest_400(harness, "POST", "/v1/sandboxes", {"cwd": "/etc/passwd/x"})
    with harness.sandbox(cwd="/tmp/work/deep") as sb:  # a good one still works
        assert sb.exec("pwd").stdout.strip() == "/tmp/work/deep"


def test_overlong_paths_and_tiny_timeouts_are_invalid_requests(harness, sandbox) -> None:
    for cwd in (LONG_CWD, LONG_NAME_CWD):
        with pytest.raises(InvalidRequest):
            harness.sandbox(cwd=cwd)
        with pytest.raises(InvalidRequest):
            sandbox.exec("pwd", cwd=cwd)
        with pytest.raises(InvalidRequest):
            sandbox.files.read(cwd)
        assert len(_rest_400(harness, "POST", "/v1/sandboxes", {"cwd": cwd})) < 400
    for timeout in (1e-300, 0.0, -1.0):
        with pytest.raises(InvalidRequest):
            sandbox.run_code("1", timeout=timeout)
        with pytest.raises(InvalidRequest):
            sandbox.exec("true", timeout=timeout)
    sid = sandbox.id
    for body in ({"code": "1", "timeout": 1e-300}, {"code": "1", "timeout": 1e9}):
        _rest_400(harness, "POST", f"/v1/sandboxes/{sid}/run_code", body)
        _rest_400(harness, "POST", f"/v1/sandboxes/{sid}/exec", body)
    _rest_400(harness, "POST", "/v1/sandboxes", {"timeout": 1e-300})
    _rest_400(harness, "POST", "/v1/sandboxes", {"idle_timeout": 1e-300})
    # NaN and Infinity: Python's json module writes them, so a client can send them.
    for value in (math.nan, math.inf):
        async def go(value: float = value) -> httpx.Response:
            async with httpx.AsyncClient(transport=harness.transport(),
                                         base_url="http://sandbox") as client:
                return await client.post(
                    f"/v1/sandboxes/{sid}/run_code",
                    content=f'{{"code": "1", "timeout": {value!r}}}'.replace(
                        "nan", "NaN").replace("inf", "Infinity"),
                    headers={"content-type": "application/json"})
        assert portal.run(go()).status_code == 400
    # The smallest timeout allowed is a timeout, not a crash, however soon it fires.
    for _ in range(20):
        with pytest.raises(SandboxTimeout):
            sandbox.run_code("while True: pass", timeout=0.001)
    assert sandbox.run_code("40 + 2").text == "42"


def test_env_and_command_bytes_execve_cannot_carry(harness, sandbox) -> None:
    for env in ({"A=B": "x"}, {"": "x"}, {"A\0": "x"}, {"A": "x\0y"}):
        with pytest.raises(InvalidRequest):
            sandbox.exec("true", env=env)
        with pytest.raises(InvalidRequest):
            harness.sandbox(env=env)
    for cmd in ("echo a\0b", ["echo", "a\0b"], ["ech\0o"]):
        with pytest.raises(InvalidRequest):
            sandbox.exec(cmd)
    assert sandbox.exec("echo $A", env={"A": "ok"}).stdout == "ok\n"


# ------------------------------------------------------------------------ mountinfo

def test_mountinfo_shows_no_host_path(harness, make) -> None:
    parent = make()
    (child,) = parent.fork(1)
    engine = harness.engine
    secrets = {str(harness.data_dir), str(engine.config.image_cache),
               str(engine.store.root)}
    for sb in (parent, child):
        layers = engine.get(sb.id).body.layers
        secrets |= {str(path) for path in layers.layer_dirs()}
        secrets.add(str(layers.volume))
    for sb in (parent, child):
        mountinfo = sb.exec("cat /proc/self/mountinfo").stdout
        assert " / / " in mountinfo  # the root's line is there to be checked
        leaked = sorted(s for s in secrets if s in mountinfo)
        assert not leaked, f"mountinfo in {sb.id} shows host paths {leaked}:\n{mountinfo}"
        assert "/proc/self/fd/" in mountinfo.split(" / / ", 1)[1].splitlines()[0]
    child.close()


def test_all_sandboxes_together_are_bounded(harness, sandbox) -> None:
    """Each sandbox has its own limits, but their sum had none: a family of 31 fork
    children at 1,024 processes each reached the kernel's pid_max and nothing on the host
    could fork. The daemon bounds the cgroup every sandbox is under: 3/4 of pid_max,
    and all of RAM but max(2 GiB, 1/10); a sandbox's processes are in it."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    top = Path("/sys/fs/cgroup")
    v1 = (top / "pids").is_dir()
    pids = top / ("pids/branchbox/pids.max" if v1 else "branchbox/pids.max")
    memory = top / ("memory/branchbox/memory.limit_in_bytes" if v1 else "branchbox/memory.max")
    assert int(pids.read_text()) == pid_max - pid_max // 4
    page = os.sysconf("SC_PAGE_SIZE")
    kept = min(max(2 << 30, ram // 10), ram // 4)
    assert int(memory.read_text()) == (ram - kept) // page * page
    host_pids = portal.run(harness.engine.report(sandbox.id))["resources"]["host_pids"]
    assert host_pids
    for pid in host_pids:
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
        assert ":pids:/branchbox/" in cgroups or "::/branchbox/" in cgroups, cgroups


def _fill(name: str, mib: int) -> str:
    """Code that allocates ``mib`` MiB under ``name`` and touches every page of it."""
    return f"{name} = bytearray({mib} << 20)\nfor i in range(0, len({name}), 4096): {name}[i] = 1"


def _memory_dirs(harness) -> set[str]:
    """The names of the memory cgroups under the daemon's group: live bodies', made-ahead
    ones, and those a family keeps charged."""
    top = Path("/sys/fs/cgroup")
    base = top / "memory" / "branchbox" if (top / "memory").is_dir() else top / "branchbox"
    return {p.name for p in (base / harness.engine.config.cgroup_group).iterdir()}


def test_a_family_cannot_outgrow_its_memory_by_closing_parents(harness, make) -> None:
    """The kernel charges a page to the cgroup that first touched it, for as long as it
    lives: a closed parent's heap its fork child maps stayed charged to a removed cgroup,
    counted against no live limit. Fork, close the parent, allocate again: a sandbox of
    memory_mb=1024 held 4,000 MiB after five rounds (its own cgroup said 805), taken from
    every other family. The family now keeps that cgroup on its account and a fork is
    refused (429, FamilyOverLimit) while it holds more than its live sandboxes may;
    freeing the memory lets it fork again. A merge of a big heap stays forkable."""
    parent = make(memory_mb=256)
    parent.run_code(_fill("a", 150))
    first = harness.engine.get(parent.id).body.cgroup.name  # where a's pages are charged
    winner, loser = parent.fork(2)
    parent.merge_into(winner)  # the old body's heap, mapped by the winner: kept charged
    loser.close()
    assert first in _memory_dirs(harness)
    (after_merge,) = parent.fork(1)
    assert after_merge.run_code("len(a)").text == str(150 << 20)
    after_merge.close()
    (child,) = parent.fork(1)
    try:
        parent.close()  # its heap lives on in the child, charged to removed cgroups
        child.run_code(_fill("b", 150))  # within the child's own limit
        with pytest.raises(ResourceLimit, match="MiB of memory"):
            child.fork(1)
        child.run_code("del a")  # the closed parent's pages are freed: nothing held
        (grandchild,) = child.fork(1)
        assert grandchild.run_code("len(b)").text == str(150 << 20)
        grandchild.close()
        room = harness.engine.get(child.id).family.room
        assert sum(r.pinned() for r in room.remains) < 32 << 20  # a's 150 MiB are gone
    finally:
        child.close()


def test_a_family_cannot_outgrow_its_memory_by_restoring(harness, make) -> None:
    """Restore replaces a body: its pages the checkpoint maps stayed charged to the
    removed cgroup, and the new body started from nothing. Each checkpoint-restore round
    could add a limit's worth; now the family's account refuses the next checkpoint (a
    restore itself, which leaves the family holding less, goes on)."""
    sb = make(memory_mb=256)
    sb.run_code(_fill("a", 150))
    cp = sb.checkpoint()
    sb.restore(cp)  # the old body's heap, mapped by the checkpoint: kept charged
    assert sb.run_code("len(a)").text == str(150 << 20)
    sb.run_code(_fill("b", 150))
    with pytest.raises(ResourceLimit, match="cannot checkpoint"):
        sb.checkpoint()
    sb.restore(cp)  # never refused: the body let go holds less once gone
    assert sb.run_code("'b' in dir()").text == "False"
    assert sb.checkpoint().id  # within the limits again: that body's own pages are freed


def test_a_family_holds_a_bounded_number_of_sandboxes(harness, make, monkeypatch) -> None:
    """Each fork child is a few processes and some memory drawn from what every family
    shares (the all-sandboxes bound): a family had no limit on how many it held."""
    monkeypatch.setattr(harness.engine.config, "max_family", 3)
    parent = make()
    with pytest.raises(ResourceLimit, match="would hold 4 sandboxes, past its limit of 3"):
        parent.fork(3)
    a, b = parent.fork(2)
    with pytest.raises(ResourceLimit, match="past its limit"):
        a.fork(1)
    b.close()
    (c,) = a.fork(1)  # room again
    cp = parent.checkpoint()
    with pytest.raises(ResourceLimit, match="past its limit"):
        cp.fork(1)
    for sb in (a, c):
        sb.close()


UDP_FLOOD = r"""
import resource, socket
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
tx.setblocking(False)
held = []
for _ in range(min(hard, 4096) - 64):
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 24)
    rx.bind(("127.0.0.1", 0))
    for _ in range(64):  # never read
        try:
            tx.sendto(bytes(60000), rx.getsockname())
        except OSError:
            break
    held.append(rx)
len(held)
"""


def _udp_pages() -> int:
    for line in Path("/proc/net/sockstat").read_text().splitlines():
        if line.startswith("UDP:"):
            return int(line.split()[-1])
    return 0


def test_socket_buffers_count_against_a_sandbox(harness, make) -> None:
    """On cgroup v1 a cgroup is charged for socket buffers only once its TCP limit is set:
    a sandbox of memory_mb=256 held 2.8 GiB of UDP receive queues (and 2.2 GiB of TCP
    buffers, the host's whole tcp_mem), counted in no limit. Each sandbox now has at most
    64 MiB of them (TCP and UDP alike)."""
    sb = make(memory_mb=256)
    before = _udp_pages()
    assert int(sb.run_code(UDP_FLOOD, timeout=300).text) > 1000
    grown = (_udp_pages() - before) * os.sysconf("SC_PAGE_SIZE")
    assert grown < 96 << 20, f"the sandbox's unread datagrams hold {grown >> 20} MiB"
