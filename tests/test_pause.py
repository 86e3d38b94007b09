"""pause/resume (issue 13 part 2): a paused sandbox runs nothing, keeps everything, and its
timeouts stop counting; REST, both SDK faces and the listing show the state."""

from __future__ import annotations

import time

import httpx
import pytest
from blocking_app import blocking_transport

from branchbox import AsyncSandbox, Conflict, Sandbox, SandboxNotFound
from branchbox.sdk._portal import portal


def ticks(harness, sb: Sandbox) -> int:
    """Lines a background loop in the sandbox has written, read from the host's side of
    its writable layer (the sandbox's own file API is refused while it is paused)."""
    path = harness.host_path(sb, "/tmp/ticks")
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def wait_for_ticks(harness, sb: Sandbox, at_least: int) -> None:
    deadline = time.monotonic() + 10
    while ticks(harness, sb) < at_least:
        assert time.monotonic() < deadline, "the background loop never ticked"
        time.sleep(0.02)


def test_a_paused_sandbox_runs_nothing_and_keeps_its_state(harness, make) -> None:
    sb = make()
    sb.run_code("kept = {'answer': 42}")
    sb.exec("while :; do echo t >> /tmp/ticks; sleep 0.01; done", background=True)
    wait_for_ticks(harness, sb, 3)

    info = sb.pause()
    assert info["state"] == "paused"
    assert Sandbox.connect(sb.id, transport=harness.transport()).info()["state"] == "paused"
    listed = {i["id"]: i["state"] for i in Sandbox.list_all(transport=harness.transport())}
    assert listed[sb.id] == "paused"
    frozen_at = ticks(harness, sb)
    time.sleep(0.4)
    assert ticks(harness, sb) == frozen_at, "a command ran while the sandbox was paused"
    with pytest.raises(Conflict, match="paused"):
        sb.run_code("1")
    with pytest.raises(Conflict, match="paused"):
        sb.files.read("/tmp/ticks")
    with pytest.raises(Conflict, match="paused"):
        sb.fork(1)
    assert sb.pause()["state"] == "paused"  # idempotent

    assert sb.resume()["state"] == "ready"
    wait_for_ticks(harness, sb, frozen_at + 3)
    assert sb.run_code("kept['answer']").text == "42"
    assert sb.resume()["state"] == "ready"  # idempotent


def test_a_pause_waits_for_the_call_in_progress(harness, make) -> None:
    """No call is frozen half-way (its deadline would run out while paused): pause waits."""
    sb = make()
    runner = harness.start_run(sb, "import time; time.sleep(1.5); finished = True", timeout=10)
    sb.pause()
    assert not runner.is_alive(), "pause returned while a run was still going"
    runner.join()
    sb.resume()
    assert sb.run_code("finished").text == "True"


def test_timeouts_stop_counting_while_paused(harness) -> None:
    sb = harness.sandbox(timeout=2.0)
    try:
        sb.pause()
        time.sleep(3.0)  # past the lifetime: a paused sandbox is not closed
        assert sb.info()["state"] == "paused"
        sb.resume()
        assert sb.run_code("1 + 1").text == "2"  # about 2 s of lifetime left now
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                sb.info()
            except SandboxNotFound:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the resumed sandbox's timeout never fired")
    finally:
        sb.close()


def test_a_paused_sandbox_is_not_idle(harness) -> None:
    engine = harness.engine
    sb = harness.sandbox()
    try:
        portal.run(_idle(engine, sb.id, 0.5))
        sb.pause()
        time.sleep(1.2)
        assert sb.info()["state"] == "paused"
        sb.resume()
        assert sb.run_code("'awake'").text == "'awake'"
    finally:
        sb.close()


async def _idle(engine, sandbox_id: str, seconds: float) -> None:
    engine._close_when_idle(engine.get(sandbox_id), seconds)


def test_closing_a_paused_sandbox_kills_it(harness) -> None:
    sb = harness.sandbox()
    sb.exec("sleep 1000", background=True)
    cgroup = harness.engine.get(sb.id).body.cgroup
    sb.pause()
    sb.close()
    assert cgroup.dirs == [] and cgroup.pids() == []


def test_async_face_and_rest_errors(harness) -> None:
    async def scenario() -> None:
        async with AsyncSandbox(transport=harness.transport()) as sb:
            await sb.run_code("y = 7")
            assert (await sb.pause())["state"] == "paused"
            assert (await sb.info())["state"] == "paused"
            assert (await sb.resume())["state"] == "ready"
            assert (await sb.run_code("y")).text == "7"

    portal.run(scenario())
    with httpx.Client(transport=blocking_transport(harness), base_url="http://t") as client:
        reply = client.post("/v1/sandboxes/sbx_" + "0" * 32 + "/pause")
        assert reply.status_code == 404 and reply.json()["error"] == "sandbox not found"

