"""Checkpoints (issue 13 part 3): instants of a sandbox, memory and files, that it goes back
to (same id, same address) or branches from, freed with it."""

from __future__ import annotations

import os
import platform
import signal
import time
from pathlib import Path

import httpx
import pytest
from blocking_app import blocking_transport

from branchbox import (
    AsyncSandbox,
    Conflict,
    InvalidRequest,
    ReplGone,
    SandboxNotFound,
    StaleBranchError,
)
from branchbox.sdk._portal import portal

STATE = "import os; (x, os.environ.get('FOO'), os.getcwd())"


_RECVMSG = {"x86_64": 47, "aarch64": 212}[platform.machine()]


def waiting(cgroup, sandbox_cgroup) -> None:
    """A checkpoint runs nothing and holds nothing of its sandbox: its cgroup has one
    process, asleep in recvmsg on its one socket, every other fd /dev/null, in
    namespaces and a root of its own. (It says it is ready once its instant is kept,
    then leaves the sandbox's namespaces and goes to wait: a busy machine may show it
    on its way.)"""
    for _ in range(500):  # the init of its empty proc's namespace may be there a moment
        pids = cgroup.pids()
        proc = Path(f"/proc/{pids[0]}")
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        call = (proc / "syscall").read_text().split()[0]
        if len(pids) == 1 and state == "S" and call == str(_RECVMSG):
            break
        time.sleep(0.01)
    assert (len(pids), state, call) == (1, "S", str(_RECVMSG))
    repl = Path(f"/proc/{min(sandbox_cgroup.pids())}")
    for ns in ("mnt", "net", "ipc", "uts"):
        assert os.readlink(proc / "ns" / ns) != os.readlink(repl / "ns" / ns), ns
    assert os.stat(proc / "root/").st_dev != os.stat(repl / "root/").st_dev
    targets = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
    assert sum(t.startswith("socket:") for t in targets) == 1, targets
    assert all(t.startswith("socket:") or t == "/dev/null" for t in targets), targets


def test_restore_round_trips_memory_files_env_and_cwd(harness, make) -> None:
    sb = make()
    sb.run_code("import os; x = [1, 2, 3]; os.environ['FOO'] = 'before'; os.chdir('/tmp')")
    sb.files.write("/root/kept.txt", b"one")
    ip = sb.ip
    cp = sb.checkpoint("after-setup")
    assert cp.name == "after-setup" and cp.id.startswith("cp_")
    waiting(harness.engine._checkpoints[cp.id].body.cgroup, harness.engine.live[sb.id].body.cgroup)

    for _ in range(2):  # the checkpoint stays: restore it twice
        sb.run_code("x.append(4); os.environ['FOO'] = 'after'; os.chdir('/')")
        sb.files.write("/root/kept.txt", b"two")
        sb.files.write("/root/new.txt", b"new")
        sb.restore(cp)
        assert sb.run_code(STATE).text == "([1, 2, 3], 'before', '/tmp')"
        assert sb.files.read("/root/kept.txt") == b"one"
        assert not sb.files.exists("/root/new.txt")
        assert sb.exec("hostname").stdout.strip() == sb.id
        info = sb.info()
        assert info["id"] == sb.id and info["address"] == ip and info["state"] == "ready"
    assert [c.id for c in sb.checkpoints()] == [cp.id]


def test_a_restore_failing_after_its_wake_leaves_the_sandbox_and_nothing_else(
        harness, make, monkeypatch) -> None:
    """The checkpoint is woken before the restored body is made. When making the body
    fails, the restore fails saying so, the sandbox is as it was, the woken copy ends
    (its control socket closes before its root came), and a later restore works."""
    sb = make()
    sb.run_code("x = 'at the checkpoint'")
    cp = sb.checkpoint()
    sb.run_code("x = 'now'")
    engine = harness.engine
    cp_cgroup = engine._checkpoints[cp.id].body.cgroup
    real = engine._child_body

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(engine, "_child_body", failing)
    with pytest.raises(Exception, match="injected"):
        sb.restore(cp)
    monkeypatch.setattr(engine, "_child_body", real)
    assert sb.run_code("x").text == "'now'"
    waiting(cp_cgroup, engine.live[sb.id].body.cgroup)  # the checkpoint alone again
    sb.restore(cp)
    assert sb.run_code("x").text == "'at the checkpoint'"


def test_restore_after_fork_and_merge(harness, make) -> None:
    sb = make()
    sb.run_code("x = 'original'")
    cp = sb.checkpoint()
    kids = sb.fork(2)
    kids[0].run_code("x = 'merged'")
    kids[0].files.write("/root/merged.txt", b"m")
    sb.merge_into(kids[0])
    assert sb.run_code("x").text == "'merged'"
    sb.restore(cp)
    assert sb.run_code("x").text == "'original'"
    assert not sb.files.exists("/root/merged.txt")
    with pytest.raises(StaleBranchError):  # forked before the restore: stale
        sb.merge_into(kids[1])
    kids[1].close()


def test_fork_from_a_checkpoint(harness, make) -> None:
    sb = make()
    sb.run_code("x = 'then'")
    cp = sb.checkpoint()
    sb.run_code("x = 'now'")
    kids = cp.fork(2)
    try:
        assert [k.run_code("x").text for k in kids] == ["'then'", "'then'"]
        assert all(k.parent_id == sb.id for k in kids)
        assert len({k.ip for k in kids} | {sb.ip}) == 3
        assert sb.run_code("x").text == "'now'"
        kids[0].run_code("x = 'winner'")
        sb.merge_into(kids[0])  # a branch of the checkpoint merges like any child
        assert sb.run_code("x").text == "'winner'"
    finally:
        for kid in kids:
            kid.close()


def test_a_hundred_checkpoints(harness, make) -> None:
    sb = make()
    cps = []
    for i in range(100):
        sb.run_code(f"i = {i}")
        cps.append(sb.checkpoint(f"step {i}"))
    assert [c.id for c in sb.checkpoints()] == [c.id for c in cps]
    for i in (37, 0, 99):
        sb.restore(cps[i])
        assert sb.run_code("i").text == str(i)
    bodies = [harness.engine._checkpoints[c.id].body.cgroup for c in cps]
    for cp in cps[:50]:
        cp.delete()
    assert [c.id for c in sb.checkpoints()] == [c.id for c in cps[50:]]
    assert all(cg.dirs == [] for cg in bodies[:50])
    sb.close()
    assert all(cg.dirs == [] for cg in bodies), "a closed sandbox's checkpoints are freed"
    assert not [c for c in harness.engine._checkpoints.values() if c.sandbox_id == sb.id]


def test_a_sandbox_whose_repl_died_can_be_restored(harness, make) -> None:
    sb = make()
    sb.run_code("z = 'alive'")
    cp = sb.checkpoint()
    with pytest.raises(ReplGone):
        sb.run_code("import os; os._exit(3)")
    sb.restore(cp)
    assert sb.run_code("z").text == "'alive'"


def test_a_checkpoint_keeps_its_instant_of_shared_memory_and_listening_sockets(make) -> None:
    """Shared memory the sandbox writes after the checkpoint is not the checkpoint's (its
    process copied it), and a socket listening then listens again after a restore, in the
    restored body's own network, though the sandbox closed it meanwhile."""
    sb = make()
    sb.run_code("import mmap, socket\n"
                "shm = mmap.mmap(-1, 1 << 20)\n"
                "shm[:6] = b'before'\n"
                "srv = socket.socket()\n"
                "srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                "srv.bind(('0.0.0.0', 8765)); srv.listen()")
    cp = sb.checkpoint()
    sb.run_code("shm[:6] = b'after!'; srv.close()")
    for _ in range(2):
        sb.restore(cp)
        assert sb.run_code("bytes(shm[:6])").text == "b'before'"
        sb.exec("python3 -c \"import socket; "
                "socket.create_connection(('127.0.0.1', 8765)).sendall(b'hi')\"")
        assert sb.run_code("c, _ = srv.accept(); c.recv(2)").text == "b'hi'"
        sb.run_code("shm[:6] = b'later!'")  # the next restore is the instant again


def test_a_checkpoint_whose_process_was_killed_is_gone(harness, make) -> None:
    sb = make()
    sb.run_code("z = 'kept'")
    cp = sb.checkpoint()
    pid = harness.engine._checkpoints[cp.id].body.channel.host_pid
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):  # until the kernel has reaped it
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.01)
    with pytest.raises(ReplGone):
        sb.restore(cp)
    with pytest.raises(ReplGone):
        cp.fork(2)
    assert sb.run_code("z").text == "'kept'"  # the sandbox itself is untouched
    cp.delete()
    assert sb.checkpoints() == []


def test_limits_and_errors(harness, make) -> None:
    sb, other = make(), make()
    cp = sb.checkpoint()
    with pytest.raises(SandboxNotFound):
        other.restore(cp.id)  # not other's checkpoint
    with pytest.raises(SandboxNotFound):
        sb.restore("cp_" + "0" * 32)
    with pytest.raises(InvalidRequest):
        sb.checkpoint("x" * 500)
    with pytest.raises(InvalidRequest):
        cp.fork(0)
    sb.pause()
    with pytest.raises(Conflict, match="paused"):
        sb.checkpoint()
    with pytest.raises(Conflict, match="paused"):
        sb.restore(cp)
    sb.resume()
    config = harness.engine.config
    limit, config.max_checkpoints = config.max_checkpoints, 2
    try:
        child = sb.fork(1)[0]
        child.checkpoint()  # the family now holds two
        with pytest.raises(Conflict, match="limit"):
            sb.checkpoint()
        child.close()  # its checkpoint goes with it
        sb.checkpoint()
    finally:
        config.max_checkpoints = limit
    with httpx.Client(transport=blocking_transport(harness), base_url="http://t") as client:
        reply = client.post(f"/v1/sandboxes/{sb.id}/checkpoints", json={"name": 5})
        assert reply.status_code == 400 and "name" in reply.json()["error"]
        reply = client.delete(f"/v1/sandboxes/{sb.id}/checkpoints/cp_nope")
        assert reply.status_code == 404 and "checkpoint" in reply.json()["error"]


def test_async_face(harness) -> None:
    async def scenario() -> None:
        async with AsyncSandbox(transport=harness.transport()) as sb:
            await sb.run_code("w = 1")
            cp = await sb.checkpoint("one")
            await sb.run_code("w = 2")
            await sb.restore(cp)
            assert (await sb.run_code("w")).text == "1"
            (kid,) = await cp.fork(1)
            assert (await kid.run_code("w")).text == "1"
            await kid.close()
            assert [c.id for c in await sb.checkpoints()] == [cp.id]
            await cp.delete()
            assert await sb.checkpoints() == []

    portal.run(scenario())

