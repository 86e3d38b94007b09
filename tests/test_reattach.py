"""Sandboxes outlive a daemon killed with -9 (issue 13, part 1): the next daemon on the
data directory re-attaches to them, under the same ids, REPL state, background
commands, addresses, checkpoints, pauses, lineage, lifetimes and workspace branches
intact; and nothing of them is left once it stops. Against real ``branchbox serve``
processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from served import ServedDaemon, env_with_key
from test_restart import family_pids
from test_security_isolation import _SYSCALLS, _pid
from waiting import eventually

from branchbox import Sandbox, SandboxNotFound, StaleBranchError
from branchbox.engine.config import EngineConfig

KEY = "reattach-test-key"


@pytest.fixture
def env() -> dict[str, str]:
    return env_with_key(KEY)


def kill9(daemon: ServedDaemon) -> None:
    daemon.proc.send_signal(signal.SIGKILL)
    assert daemon.proc.wait(30) == -9


def left_behind(daemon: ServedDaemon) -> list[str]:
    """Processes of the data directory's daemon still running: sandboxes, family
    launchers and inits, the fd keeper."""
    group = EngineConfig(data_dir=daemon.data_dir).cgroup_group
    ps = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    ours = [line for line in ps.splitlines() if not line.startswith("Z") and (
        "bb-launcher" in line or "bb-family" in line or str(daemon.data_dir) in line)]
    return ours + [str(pid) for pid in family_pids(group)]


@pytest.fixture
def held() -> list[Sandbox]:
    """Clients the test made: each lets go of its connections at the end (the sandboxes
    end with the daemon's stop)."""
    clients: list[Sandbox] = []
    yield clients
    for sb in clients:
        sb.detach()


def freezer_state(pid: int) -> str:
    """The freezer state of the cgroup v1 leaf process ``pid`` is in."""
    line = next(x for x in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                if ":freezer:" in x)
    return Path("/sys/fs/cgroup/freezer", line.split(":", 2)[2].lstrip("/"),
                "freezer.state").read_text().strip()


def connect(sandbox_id: str, daemon: ServedDaemon, held: list[Sandbox]) -> Sandbox:
    sb = Sandbox.connect(sandbox_id, url=daemon.url, api_key=KEY)
    held.append(sb)
    return sb


def test_sandboxes_outlive_a_killed_daemon(env: dict[str, str], held: list[Sandbox]) -> None:
    first = ServedDaemon("reattach", env)
    daemons = [first]
    try:
        sb = Sandbox(url=first.url, api_key=KEY, timeout=3600)
        sb.run_code("x = 41")
        sb.exec("sleep 600", background=True)
        (kid,) = sb.fork(1)
        kid.run_code("x = 42")
        cp = sb.checkpoint("before")
        address = sb.info()["address"]
        paused = Sandbox(url=first.url, api_key=KEY)
        paused.run_code("y = 'paused'")
        paused_pids = paused.info()["resources"]["host_pids"]
        paused.pause()
        short = Sandbox(url=first.url, api_key=KEY, timeout=8)
        for each in (sb, kid, paused, short):
            each.detach()
        kill9(first)
        # The thaw guard thaws what a dead daemon froze for a moment, not a pause.
        group = EngineConfig(data_dir=first.data_dir).cgroup_group
        assert eventually(lambda: f"thaw_guard {group}" not in subprocess.run(
            ["ps", "-eo", "args"], capture_output=True, text=True).stdout, within=10)
        assert {freezer_state(pid) for pid in paused_pids} == {"FROZEN"}

        second = ServedDaemon("reattach", env, data_dir=first.data_dir)
        daemons.append(second)
        sb, kid = connect(sb.id, second, held), connect(kid.id, second, held)
        assert sb.run_code("x").text == "41"
        assert kid.run_code("x").text == "42"
        assert "sleep 600" in sb.exec("ps -eo args").stdout  # its command runs on
        assert sb.info()["address"] == address
        assert kid.info()["parent_id"] == sb.id
        assert [c.id for c in sb.checkpoints()] == [cp.id]
        paused = connect(paused.id, second, held)
        assert paused.info()["state"] == "paused"
        paused.resume()
        assert paused.run_code("y").text == "'paused'"

        (grandkid,) = sb.fork(1)  # the family forks on
        held.append(grandkid)
        assert grandkid.run_code("x").text == "41"
        assert grandkid.info()["address"] not in (address, kid.info()["address"])
        kid.run_code("x = 43")
        sb.merge_into(kid)  # the lineage came back: kid is sb's branch
        assert sb.run_code("x").text == "43"
        assert sb.info()["address"] == address
        sb.restore(cp)
        assert sb.run_code("x").text == "41"
        # Its lifetime came back too: created with timeout=8, it closes on time.
        assert eventually(lambda: short.id not in {
            i["id"] for i in Sandbox.list_all(url=second.url, api_key=KEY)}, within=30)
        with pytest.raises(SandboxNotFound):
            connect(short.id, second, held)
    finally:
        daemons[-1].stop()
    assert eventually(lambda: left_behind(first) == [], within=10), left_behind(first)


def test_twenty_kill_restart_rounds(env: dict[str, str], held: list[Sandbox]) -> None:
    daemon = ServedDaemon("reattach", env)
    try:
        a = Sandbox(url=daemon.url, api_key=KEY)
        a.run_code("n = 0")
        (a_kid,) = a.fork(1)
        b = Sandbox(url=daemon.url, api_key=KEY)
        b.run_code("n = 0")
        b.exec("sleep 3600", background=True)
        c = Sandbox(url=daemon.url, api_key=KEY)
        c.run_code("n = 0")
        ids = [a.id, a_kid.id, b.id, c.id]
        for each in (a, a_kid, b, c):
            each.detach()
        for round_ in range(1, 21):
            kill9(daemon)
            daemon = ServedDaemon("reattach", env, data_dir=daemon.data_dir)
            for sid in ids:
                sb = connect(sid, daemon, held)
                assert sb.run_code("n += 1; n").text == str(round_), (round_, sid)
        assert "sleep 3600" in connect(b.id, daemon, held).exec("ps -eo args").stdout
    finally:
        daemon.stop()
    assert eventually(lambda: left_behind(daemon) == [], within=10), left_behind(daemon)


def test_a_repl_that_does_not_answer_comes_back_stopped(env: dict[str, str],
                                                        held: list[Sandbox]) -> None:
    """A REPL the new daemon cannot talk to (here: stopped with SIGSTOP, as one stuck
    would be) is not waited for: its processes are killed, its files kept."""
    first = ServedDaemon("reattach", env)
    daemons = [first]
    try:
        stuck = Sandbox(url=first.url, api_key=KEY)
        stuck.files.write("/root/kept.txt", b"kept")
        pids = stuck.info()["resources"]["host_pids"]
        fine = Sandbox(url=first.url, api_key=KEY)
        fine.run_code("z = 'fine'")
        stuck.detach()
        fine.detach()
        kill9(first)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        second = ServedDaemon("reattach", env, data_dir=first.data_dir)
        daemons.append(second)
        assert connect(fine.id, second, held).run_code("z").text == "'fine'"
        stuck = connect(stuck.id, second, held)
        assert stuck.info()["state"] == "stopped"
        stuck.start()
        assert stuck.files.read("/root/kept.txt") == b"kept"
    finally:
        daemons[-1].stop()
    assert eventually(lambda: left_behind(first) == [], within=10), left_behind(first)


def test_a_repl_of_another_protocol_version_comes_back_stopped(env: dict[str, str],
                                                                held: list[Sandbox]) -> None:
    """A daemon upgraded and restarted finds REPLs still running the agent of the one
    before; one whose agent speaks another protocol version (here it says so because
    its own code was changed) would misread the new daemon's requests: it is not
    re-attached but comes back stopped, its files kept, and starts afresh."""
    first = ServedDaemon("reattach", env)
    daemons = [first]
    try:
        older = Sandbox(url=first.url, api_key=KEY)
        older.files.write("/root/kept.txt", b"kept")
        older.run_code("import bbagent.protocol\nbbagent.protocol.VERSION -= 1")
        same = Sandbox(url=first.url, api_key=KEY)
        same.run_code("z = 'same'")
        older.detach()
        same.detach()
        kill9(first)
        second = ServedDaemon("reattach", env, data_dir=first.data_dir)
        daemons.append(second)
        assert connect(same.id, second, held).run_code("z").text == "'same'"
        older = connect(older.id, second, held)
        assert older.info()["state"] == "stopped"
        assert "speaks protocol" in second.log.read_text()
        older.start()
        assert older.files.read("/root/kept.txt") == b"kept"
        assert older.run_code("1 + 1").text == "2"
    finally:
        daemons[-1].stop()
    assert eventually(lambda: left_behind(first) == [], within=10), left_behind(first)


def test_a_workspace_branch_outlives_a_killed_daemon(env: dict[str, str], held: list[Sandbox],
                                                     workspace: Path) -> None:
    """Same host directory, same commit base; first commit wins across the restart."""
    daemon = ServedDaemon("reattach", env)
    try:
        sb = Sandbox(url=daemon.url, api_key=KEY, workspace=str(workspace))
        (sibling,) = sb.fork(1)
        sb.exec(f"echo one > {workspace}/one")
        sb.commit()
        sb.exec(f"echo two > {workspace}/two")
        sibling.exec(f"echo mine > {workspace}/mine")
        sb.detach()
        sibling.detach()
        kill9(daemon)

        daemon = ServedDaemon("reattach", env, data_dir=daemon.data_dir)
        sibling = connect(sibling.id, daemon, held)
        with pytest.raises(StaleBranchError):  # sb committed first, before the restart
            sibling.commit()
        sb = connect(sb.id, daemon, held)
        assert sb.commit()["version"] == 2
        assert sorted(p.name for p in workspace.iterdir()) == ["one", "two"]
        (kid,) = sb.fork(1)  # a fork after the restart branches the same workspace
        held.append(kid)
        assert kid.exec(f"cat {workspace}/two").stdout == "two\n"
    finally:
        daemon.stop()


def test_branches_deeper_than_landlock_keep_their_signal_guard(env: dict[str, str],
                                                              held: list[Sandbox]) -> None:
    """A deep branch's signal filter listener is held by the keeper while no daemon
    runs and answered by the next one: its calls neither fail nor get through."""
    daemon = ServedDaemon("reattach", env)
    try:
        sb = Sandbox(url=daemon.url, api_key=KEY)
        held.append(sb)
        sb.run_code(_SYSCALLS)
        for _ in range(18):
            (child,) = sb.fork(n=1)
            sb.merge_into(child)
            child.detach()
        a, b = sb.fork(n=2)
        held += [a, b]
        kill9(daemon)
        daemon = ServedDaemon("reattach", env, data_dir=daemon.data_dir)
        a, b = connect(a.id, daemon, held), connect(b.id, daemon, held)
        assert a.run_code(f"try_kill({_pid(b)}, signal.SIGKILL)").text == "1"  # EPERM
        own = "import subprocess; p = subprocess.Popen(['sleep', '30']); try_kill(p.pid, 9)"
        assert a.run_code(own).text == "0"
        assert b.run_code("6 * 7").text == "42"
    finally:
        daemon.stop()


def test_sandboxes_on_leaf_bridges_outlive_a_killed_daemon(env: dict[str, str],
                                                          held: list[Sandbox]) -> None:
    """With 4 ports per bridge a family spreads over leaf bridges; after kill -9 the next
    daemon keeps the leaves and their trunks: every member is reached as before, and its
    next children go on bridges with room."""
    env = {**env, "BRANCHBOX_BRIDGE_PORTS": "4"}
    first = ServedDaemon("reattach", env)
    daemons = [first]
    try:
        sb = Sandbox(url=first.url, api_key=KEY, timeout=3600)
        sb.run_code("import socket; srv = socket.create_server(('0.0.0.0', 8000))")
        members = [sb, *sb.fork(n=6)]
        addresses = {m.id: m.ip for m in members}
        leaf = f"bbr{EngineConfig(data_dir=first.data_dir).cgroup_group[2:6]}x1"
        assert os.path.exists(f"/sys/class/net/{leaf}/brif"), "no leaf bridge was made"
        for member in members:
            member.detach()
        kill9(first)
        second = ServedDaemon("reattach", env, data_dir=first.data_dir)
        daemons.append(second)
        for sid, address in addresses.items():
            assert connect(sid, second, held).info()["address"] == address
            with socket.create_connection((address, 8000), timeout=10):
                pass
        for child in connect(sb.id, second, held).fork(n=4):
            held.append(child)
            with socket.create_connection((child.ip, 8000), timeout=10):
                pass
    finally:
        daemons[-1].stop()
    assert not [name for name in os.listdir("/sys/class/net") if name.startswith("bt")]
