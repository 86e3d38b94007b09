"""A daemon restart keeps every sandbox's files (issue 13, part 4): processes that died
with the host come back as ``stopped`` sandboxes under the same ids, and ``start()``
gives each a fresh REPL on its files; a stop with ``--keep`` leaves them running.
Against real ``branchbox serve`` processes on one data directory (the sandboxes that
outlive a killed daemon: test_reattach.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest
from served import ServedDaemon, env_with_key

from branchbox import Sandbox, SandboxError, SandboxNotFound, StaleBranchError
from branchbox.engine.config import EngineConfig
from branchbox.runtime.cgroups import CGROUP_ROOT, SandboxCgroup, thaw_leftovers

KEY = "restart-test-key"


def family_pids(group: str) -> list[int]:
    return [pid for cg in SandboxCgroup.leftovers(group) for pid in cg.pids()]


def kill_hard(daemon: ServedDaemon, group: str) -> None:
    """kill -9 the daemon, then every process of its sandboxes, as a host reboot would."""
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    thaw_leftovers(group)  # a checkpoint stays frozen without a daemon; a reboot kills it too
    for pid in family_pids(group):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while family_pids(group):
        assert time.monotonic() < deadline, "the sandboxes' processes would not die"
        time.sleep(0.05)


def started_events(daemon: ServedDaemon, last: str) -> list[str]:
    """The sandboxes of the daemon's ``start`` events (GET /v1/events), up to ``last``'s."""
    started = []
    with daemon.client(KEY) as http, http.stream("GET", "/v1/events?since=0") as stream:
        for line in stream.iter_lines():
            event = json.loads(line.removeprefix("data: ")) if line.startswith("data: ") else {}
            if event.get("type") == "start":
                started.append(event["sandbox"])
                if event["sandbox"] == last:
                    return started
    raise AssertionError(f"the event stream ended before {last} started")


def stop_last(first: ServedDaemon, second: ServedDaemon | None, env: dict[str, str]) -> None:
    """Stop whichever daemon of the data directory runs last (closing its sandboxes and
    removing the directory); a daemon started only for that if the first one was killed."""
    if second is not None:
        second.stop()
    elif first.proc.poll() is None:
        first.stop()
    else:
        ServedDaemon("restart", env, data_dir=first.data_dir).stop()


def test_sandboxes_come_back_stopped_with_their_files() -> None:
    env = env_with_key(KEY)
    first = ServedDaemon("restart", env)
    group = EngineConfig(data_dir=first.data_dir).cgroup_group
    second = None
    try:
        sb = Sandbox(url=first.url, api_key=KEY)
        sb.run_code("x = 'lost with the memory'")
        sb.files.write("/root/kept.txt", b"kept")
        (kid,) = sb.fork(1)
        kid.files.write("/root/kid.txt", b"kid's")
        sb.checkpoint("memory only")
        spare = Sandbox(url=first.url, api_key=KEY)
        spare.files.write("/root/spare.txt", b"spare")
        ids = {sb.id, kid.id, spare.id}
        for each in (sb, kid, spare):
            each.detach()
        kill_hard(first, group)

        second = ServedDaemon("restart", env, data_dir=first.data_dir)
        listed = {i["id"]: i["state"] for i in Sandbox.list_all(url=second.url, api_key=KEY)}
        assert {i: listed.get(i) for i in ids} == dict.fromkeys(ids, "stopped")
        sb = Sandbox.connect(sb.id, url=second.url, api_key=KEY)
        assert sb.info()["state"] == "stopped"
        with pytest.raises(SandboxError):
            sb.run_code("1")  # no REPL until start()

        sb.start()
        assert sb.info()["state"] == "ready"
        assert sb.files.read("/root/kept.txt") == b"kept"
        assert sb.run_code("'x' in globals()").text == "False"  # a fresh REPL
        assert sb.exec("hostname").stdout.strip() == sb.id
        sb.files.write("/root/after.txt", b"after")
        (grandkid,) = sb.fork(1)  # a started sandbox forks like any other
        assert grandkid.files.read("/root/after.txt") == b"after"
        grandkid.close()
        assert sb.checkpoints() == []  # checkpoints were memory

        kid = Sandbox.connect(kid.id, url=second.url, api_key=KEY).start()
        assert started_events(second, kid.id) == [sb.id, kid.id]  # the fork tree page sees them
        assert kid.files.read("/root/kid.txt") == b"kid's"
        assert kid.files.read("/root/kept.txt") == b"kept"  # from its parent's layer
        assert sb.start().info()["state"] == "ready"  # a no-op on a running sandbox

        spare = Sandbox.connect(spare.id, url=second.url, api_key=KEY)
        spare.close()  # closed while stopped: its files go
        with pytest.raises(SandboxNotFound):
            Sandbox.connect(spare.id, url=second.url, api_key=KEY)
        kid.close()
        sb.close()
    finally:
        stop_last(first, second, env)


def test_a_stop_with_keep_leaves_sandboxes_running() -> None:
    env = env_with_key(KEY)
    first = ServedDaemon("keep", env, "--keep")
    group = EngineConfig(data_dir=first.data_dir).cgroup_group
    second = None
    try:
        sb = Sandbox(url=first.url, api_key=KEY)
        sb.run_code("kept = 'through a clean stop'")
        sb.pause()
        sb.detach()
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(60) == 0, first.log.read_text()
        assert family_pids(group), "the sandbox's processes should outlive a --keep stop"

        second = ServedDaemon("keep", env, data_dir=first.data_dir)  # no --keep: closes all
        sb = Sandbox.connect(sb.id, url=second.url, api_key=KEY)
        assert sb.info()["state"] == "paused"  # still paused: frozen again at re-attach
        sb.resume()
        assert sb.run_code("kept").text == "'through a clean stop'"
        sb.close()
    finally:
        stop_last(first, second, env)
    assert family_pids(group) == []


def test_a_stopped_sandbox_starts_again_on_its_workspace_branch(workspace) -> None:
    env = env_with_key(KEY)
    first = ServedDaemon("restart", env)
    group = EngineConfig(data_dir=first.data_dir).cgroup_group
    second = None
    try:
        sb = Sandbox(url=first.url, api_key=KEY, workspace=str(workspace))
        (sibling,) = sb.fork(1)
        sibling.exec(f"echo first > {workspace}/first")
        sibling.commit()  # the sandbox's branch is stale from here on
        sb.exec(f"echo mine > {workspace}/mine")
        later = Sandbox(url=first.url, api_key=KEY, workspace=str(workspace))  # branched after
        later.exec(f"echo later > {workspace}/later")
        for each in (sb, sibling, later):
            each.detach()
        kill_hard(first, group)

        second = ServedDaemon("restart", env, data_dir=first.data_dir)
        sb = Sandbox.connect(sb.id, url=second.url, api_key=KEY)
        assert sb.info()["state"] == "stopped"
        sb.start()
        assert sb.exec(f"cat {workspace}/mine").stdout == "mine\n"  # its changes came back
        with pytest.raises(StaleBranchError):  # and its commit base: first commit wins
            sb.commit()
        assert sorted(p.name for p in workspace.iterdir()) == ["first"]
        later = Sandbox.connect(later.id, url=second.url, api_key=KEY).start()
        assert later.commit()["version"] == 2
        assert sorted(p.name for p in workspace.iterdir()) == ["first", "later"]
        later.close()
        sb.close()
        Sandbox.connect(sibling.id, url=second.url, api_key=KEY).close()
    finally:
        stop_last(first, second, env)


def test_a_cgroup_half_made_by_a_killed_daemon_is_reaped() -> None:
    """A daemon killed while it made a sandbox cgroup (one made ahead, say) leaves some
    controllers' directories and not others; the next daemon starts and removes it (it
    failed to start, on the cgroup's missing freezer)."""
    env = env_with_key(KEY)
    first = ServedDaemon("partial", env)
    group = EngineConfig(data_dir=first.data_dir).cgroup_group
    second = None
    half = CGROUP_ROOT / "memory" / "branchbox" / group / "0123456789abcdef"
    try:
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        half.mkdir(parents=True)
        second = ServedDaemon("partial", env, data_dir=first.data_dir)
        assert not half.exists()
        with Sandbox(url=second.url, api_key=KEY) as sb:
            assert sb.run_code("1 + 1").text == "2"
    finally:
        with contextlib.suppress(OSError):
            half.rmdir()
        stop_last(first, second, env)
