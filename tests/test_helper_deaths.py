"""The daemon's helper processes may die while it runs (killed by an operator or the OOM
killer, crashed): each is replaced, the daemon serves on, and what the helper
guaranteed still holds. Only a request the dead helper had in hand fails.

- the zygote (forks families' launchers) and the netlink helper (plugs sandboxes'
  networks) keep no state: the next request starts another;
- the fd keeper (sandboxes outlive a killed daemon) is replaced the moment it hangs
  up and handed every control socket again;
- the thaw guard (nothing stays frozen after a daemon dies) is replaced the moment it
  exits and told again what it must leave frozen (paused sandboxes, checkpoints).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import pytest
from served import ServedDaemon, env_with_key
from test_daemon_killed import frozen_cgroups
from test_reattach import freezer_state, kill9
from test_restart import stop_last
from waiting import ended, eventually

from branchbox import Sandbox, SandboxError
from branchbox.engine.branching import FORK_FAULT_ENV
from branchbox.engine.config import EngineConfig
from branchbox.sdk._portal import portal

KEY = "helper-deaths-test-key"


def _running(pattern: str) -> int | None:
    """The pid of the live process whose command line contains ``pattern``."""
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    live = [int(p) for p in out.split() if not ended(int(p))]
    return live[0] if live else None


def _kill(pid: int | None) -> int:
    assert pid is not None, "the helper is not running"
    os.kill(pid, signal.SIGKILL)
    assert eventually(lambda: ended(pid), within=10)
    return pid


def test_a_dead_zygote_is_replaced(harness, make) -> None:
    make()  # the zygote runs
    portal.run(harness.engine.settle())  # and is not starting the warm pool's next ones
    zygote = harness.engine.zygote
    first = _kill(zygote.pid)
    # A create whose interpreter must read its env at start: neither the warm pool nor the
    # image's template serves it, the zygote does (engine.templates).
    sb = make(env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert sb.run_code("'started'").text == "'started'"
    assert zygote.pid not in (None, first)


def test_dead_netlink_helpers_are_replaced(harness, make) -> None:
    """Both helpers: the one on the fork's path (plugs, merges) and the one that makes a
    family's namespaces ahead; the next request to either starts a new one."""
    sb = make()
    portal.run(harness.engine.settle())
    net = harness.engine.net
    helper, maker = net.net.helper, net.net.maker
    first = _kill(helper.proc.pid)
    assert portal.run(helper.call("links"))["names"]
    assert helper.proc.pid != first
    family = harness.engine.get(sb.id).family.family
    net.drop_made(family.ident)  # what was made goes; the next namespaces need the maker
    first = _kill(maker.proc.pid)
    children = sb.fork(2)  # plugged by the new helper, or joining what the new maker made
    try:
        assert len({sb.ip, *(c.ip for c in children)}) == 3
        assert eventually(lambda: len(net.made.get(family.ident, ())) >= 2, within=10)
        assert maker.proc.pid != first
        assert make().ip not in {sb.ip, *(c.ip for c in children)}
    finally:
        for child in children:
            child.close()


def test_a_dead_fd_keeper_is_replaced_and_sandboxes_still_outlive_the_daemon() -> None:
    env = env_with_key(KEY)
    daemon = ServedDaemon("helpers", env)
    restarted = None
    held: list[Sandbox] = []
    try:
        sb = Sandbox(url=daemon.url, api_key=KEY)
        held.append(sb)
        sb.run_code("x = 'kept in memory'")
        (kid,) = sb.fork(1)
        held.append(kid)
        pattern = f"runtime.fd_keeper {daemon.data_dir}/run/keeper"
        first = _kill(_running(pattern))
        assert eventually(lambda: _running(pattern) not in (None, first), within=15), \
            "no new fd keeper"
        assert eventually(lambda: "fd keeper replaced" in daemon.log.read_text(), within=15)
        kill9(daemon)
        restarted = ServedDaemon("helpers", env, data_dir=daemon.data_dir)
        for made, text in ((sb, "'kept in memory'"), (kid, "'kept in memory'")):
            again = Sandbox.connect(made.id, url=restarted.url, api_key=KEY)
            held.append(again)
            assert again.run_code("x").text == text
    finally:
        for client in held:
            client.detach()
        stop_last(daemon, restarted, env)


def test_a_dead_thaw_guard_is_replaced_and_still_thaws_after_the_daemon_dies() -> None:
    env = {k: v for k, v in env_with_key(KEY).items() if k != FORK_FAULT_ENV}
    daemon = ServedDaemon("helpers", {**env, FORK_FAULT_ENV: "frozen"})
    group = EngineConfig(data_dir=daemon.data_dir).cgroup_group
    held: list[Sandbox] = []
    try:
        paused = Sandbox(url=daemon.url, api_key=KEY)
        sb = Sandbox(url=daemon.url, api_key=KEY)
        held += [paused, sb]
        paused.pause()  # told to the guard before it dies: the new one must know it too
        pattern = f"runtime.thaw_guard {group}"
        first = _kill(_running(pattern))
        assert eventually(lambda: _running(pattern) not in (None, first), within=15), \
            "no new thaw guard"
        sb.exec("sleep 600", background=True)  # in the commands leaf the fork freezes
        pids = sb.info()["resources"]["host_pids"]
        paused_pids = paused.info()["resources"]["host_pids"]
        with pytest.raises(SandboxError):
            sb.fork(1)  # the daemon kills itself with the commands frozen
        assert daemon.proc.wait(30) == -9, daemon.log.read_text()
        assert eventually(lambda: all(freezer_state(p) == "THAWED" for p in pids),
                          within=10), f"frozen after the daemon died: {frozen_cgroups(group)}"
        assert all(freezer_state(p) == "FROZEN" for p in paused_pids), "the pause was lost"
    finally:
        for client in held:
            client.detach()
        stop_last(daemon, None, env)


def test_a_thaw_guard_that_stops_reading_is_replaced(harness, make) -> None:
    """A guard stopped (SIGSTOP) fills its pipe; the daemon must not hang on it."""
    guard = harness.engine._thaw_guard
    stopped = guard.pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        sb = make()
        for _ in range(5000):  # ~140 KiB of hold/release messages: more than a pipe holds
            sb.pause()
            sb.resume()
            if guard.pid != stopped:
                break
        assert guard.pid != stopped, "the stopped guard was never replaced"
        assert eventually(lambda: ended(stopped), within=10)
        assert sb.run_code("'alive'").text == "'alive'"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)
