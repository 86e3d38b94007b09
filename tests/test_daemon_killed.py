"""A daemon killed with -9 (issue 16, finding 7; issue 13 part 1) leaves nothing frozen,
nothing mounted twice, no workspace half committed, and no fork or merge half done.

Against real ``branchbox serve`` processes. The commit path's fault injection
(``BRANCHBOX_COMMIT_FAULT``) makes the daemon SIGKILL itself mid-commit, while the
sandbox is frozen (on the copy backend commit reads the live layer, so the whole
sandbox stays frozen for it): the sandbox must be thawed without any daemon running,
and a daemon started again on the same data directory must use, and on its stop
remove, the one cgroup hierarchy mount its predecessor left.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from served import ServedDaemon
from test_restart import stop_last
from waiting import eventually

from branchbox import Sandbox, SandboxError
from branchbox.engine.branching import FORK_FAULT_ENV
from branchbox.engine.config import EngineConfig
from branchbox.runtime.cgroups import SandboxCgroup
from branchbox.storage.journal import FAULT_ENV


def frozen_cgroups(group: str) -> list[str]:
    """The cgroup directories of ``group`` (sandboxes and their leaves) that are frozen."""
    frozen = []
    for cg in SandboxCgroup.leftovers(group):
        for d in cg.dirs:
            for where in (d, d / "repl", d / "cmds"):
                v1, v2 = where / "freezer.state", where / "cgroup.events"
                if (v1.exists() and v1.read_text().strip() != "THAWED"
                        or v2.exists() and "frozen 1" in v2.read_text()):
                    frozen.append(str(where))
    return frozen


def mounts_under(path: Path) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if f" {path}/" in line]


def test_a_daemon_killed_inside_a_commit_leaves_nothing_frozen(workspace: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    env["BRANCHBOX_API_KEY"] = "kill9-test-key"
    daemon = ServedDaemon("kill9", {**env, FAULT_ENV: "staged"})
    group = EngineConfig(data_dir=daemon.data_dir).cgroup_group
    restarted = None
    try:
        sb = Sandbox(url=daemon.url, api_key="kill9-test-key", workspace=workspace)
        assert sb.exec(f"echo new > {workspace}/file").exit_code == 0
        with pytest.raises(SandboxError):
            sb.commit()  # the daemon kills itself inside it
        assert daemon.proc.wait(30) == -9, daemon.log.read_text()
        sb.detach()  # its daemon is gone: only the client's connection is let go
        assert SandboxCgroup.leftovers(group), "the killed daemon's sandbox should still exist"
        eventually(lambda: not frozen_cgroups(group), within=10)
        assert not frozen_cgroups(group), f"frozen after the daemon died: {frozen_cgroups(group)}"

        # One hierarchy mount was left by the dead daemon; the new one uses it (mounting
        # again is EBUSY) and removes it on its graceful stop.
        assert len(mounts_under(daemon.data_dir)) == 1, mounts_under(daemon.data_dir)
        restarted = ServedDaemon("kill9", env, data_dir=daemon.data_dir)
        assert len(mounts_under(daemon.data_dir)) == 1, mounts_under(daemon.data_dir)
    finally:
        stop_last(daemon, restarted, env)  # or reap what the killed daemon left
    assert not mounts_under(daemon.data_dir), mounts_under(daemon.data_dir)


def test_a_commit_cut_by_a_kill_is_finished_without_waiting_for_a_restart(
        workspace: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    env["BRANCHBOX_API_KEY"] = "kill9-test-key"
    daemon = ServedDaemon("kill9", {**env, FAULT_ENV: "apply:1"})  # dies after one step
    try:
        sb = Sandbox(url=daemon.url, api_key="kill9-test-key", workspace=workspace)
        assert sb.exec(f"echo a > {workspace}/a; echo b > {workspace}/b").exit_code == 0
        with pytest.raises(SandboxError):
            sb.commit()
        assert daemon.proc.wait(30) == -9, daemon.log.read_text()
        sb.detach()  # its daemon is gone: only the client's connection is let go
        # No daemon runs now; the directory must become entirely the new version anyway.
        def staging() -> list[Path]:
            return [p for p in workspace.parent.iterdir()
                    if p.name.startswith(f".{workspace.name}.branchbox-commit")]

        names = {"a", "b"}
        eventually(lambda: {p.name for p in workspace.iterdir()} == names and not staging(),
                   within=10)
        assert {p.name for p in workspace.iterdir()} == names
        assert not staging()
    finally:
        stop_last(daemon, None, env)


def killed_by(fault: str) -> tuple[ServedDaemon, dict[str, str]]:
    """A daemon that SIGKILLs itself at branching fault point ``fault``, and the
    environment to start its successor with (without the fault)."""
    env = {k: v for k, v in os.environ.items() if k != FORK_FAULT_ENV}
    env["BRANCHBOX_API_KEY"] = "kill9-test-key"
    return ServedDaemon("kill9", {**env, FORK_FAULT_ENV: fault}), env


def ids_of(daemon: ServedDaemon) -> set[str]:
    return {i["id"] for i in Sandbox.list_all(url=daemon.url, api_key="kill9-test-key")}


def test_a_daemon_killed_inside_a_fork_leaves_nothing_frozen_and_no_half_fork() -> None:
    daemon, env = killed_by("frozen")
    group = EngineConfig(data_dir=daemon.data_dir).cgroup_group
    restarted = None
    try:
        sb = Sandbox(url=daemon.url, api_key="kill9-test-key")
        sb.run_code("x = 'before the fork'")
        sb.exec("sleep 600", background=True)  # in the commands leaf the fork freezes
        with pytest.raises(SandboxError):
            sb.fork(1)
        assert daemon.proc.wait(30) == -9, daemon.log.read_text()
        sb.detach()
        eventually(lambda: not frozen_cgroups(group), within=10)
        assert not frozen_cgroups(group), f"frozen after the daemon died: {frozen_cgroups(group)}"
        # The fork is cleanly not done: the parent runs on, no child of it exists.
        restarted = ServedDaemon("kill9", env, data_dir=daemon.data_dir)
        assert ids_of(restarted) == {sb.id}
        sb = Sandbox.connect(sb.id, url=restarted.url, api_key="kill9-test-key")
        assert sb.run_code("x").text == "'before the fork'"
        assert "sleep 600" in sb.exec("ps -eo args").stdout
        (kid,) = sb.fork(1)
        assert kid.run_code("x").text == "'before the fork'"
        kid.close()
        sb.close()
    finally:
        stop_last(daemon, restarted, env)


def test_a_daemon_killed_once_a_fork_is_recorded_leaves_it_done() -> None:
    daemon, env = killed_by("adopted")
    restarted = None
    try:
        sb = Sandbox(url=daemon.url, api_key="kill9-test-key")
        sb.run_code("x = 'forked'")
        with pytest.raises(SandboxError):
            sb.fork(3)  # recorded, then the daemon dies before answering
        assert daemon.proc.wait(30) == -9, daemon.log.read_text()
        sb.detach()
        restarted = ServedDaemon("kill9", env, data_dir=daemon.data_dir)
        kids = ids_of(restarted) - {sb.id}
        assert len(kids) == 3 and sb.id in ids_of(restarted)
        for kid_id in kids:
            kid = Sandbox.connect(kid_id, url=restarted.url, api_key="kill9-test-key")
            assert kid.info()["parent_id"] == sb.id
            assert kid.run_code("x").text == "'forked'"
            kid.close()
        Sandbox.connect(sb.id, url=restarted.url, api_key="kill9-test-key").close()
    finally:
        stop_last(daemon, restarted, env)


def test_a_daemon_killed_between_a_fork_s_slots_and_its_end_leaves_the_repl_whole() -> None:
    """Killed after the REPL forked its children, before "fork" ended the batch: the REPL
    still holds its signal handlers (as it does during every fork). The restarted daemon
    ends that batch, so the handlers work again and the next fork is a fork of its own."""
    daemon, env = killed_by("slots")
    restarted = None
    try:
        sb = Sandbox(url=daemon.url, api_key="kill9-test-key")
        sb.run_code("import os, signal, time\nn = 0\n"
                    "def count(signum, frame):\n"
                    "    global n\n"
                    "    n += 1\n"
                    "signal.signal(signal.SIGUSR1, count)")
        with pytest.raises(SandboxError):
            sb.fork(2)
        assert daemon.proc.wait(30) == -9, daemon.log.read_text()
        sb.detach()
        restarted = ServedDaemon("kill9", env, data_dir=daemon.data_dir)
        assert ids_of(restarted) == {sb.id}  # the half-made children are gone
        sb = Sandbox.connect(sb.id, url=restarted.url, api_key="kill9-test-key")
        assert sb.run_code("os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.01); n"
                           ).text == "1"
        kids = sb.fork(2)
        assert [k.run_code("n, signal.getsignal(signal.SIGUSR1) is count").text
                for k in kids] == ["(1, True)"] * 2
        for kid in kids:
            kid.close()
        sb.close()
    finally:
        stop_last(daemon, restarted, env)


def test_a_daemon_killed_inside_a_merge_leaves_it_done() -> None:
    """Killed after the parent's record names the winner's body, before the winner's id
    is closed: the restarted daemon finishes the merge (the body is the parent's)."""
    daemon, env = killed_by("merged")
    restarted = None
    try:
        sb = Sandbox(url=daemon.url, api_key="kill9-test-key")
        sb.run_code("x = 'parent'")
        (kid,) = sb.fork(1)
        kid.run_code("x = 'winner'")
        with pytest.raises(SandboxError):
            sb.merge_into(kid)
        assert daemon.proc.wait(30) == -9, daemon.log.read_text()
        sb.detach()
        kid.detach()
        restarted = ServedDaemon("kill9", env, data_dir=daemon.data_dir)
        assert ids_of(restarted) == {sb.id}
        sb = Sandbox.connect(sb.id, url=restarted.url, api_key="kill9-test-key")
        assert sb.run_code("x").text == "'winner'"
        (again,) = sb.fork(1)  # a later fork and merge work on the merged parent
        again.run_code("x = 'again'")
        sb.merge_into(again)
        assert sb.run_code("x").text == "'again'"
        again.detach()  # its id ended with the merge
        sb.close()
    finally:
        stop_last(daemon, restarted, env)
