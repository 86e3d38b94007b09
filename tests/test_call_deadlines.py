"""Every call ends (issue 16, findings 2-5), against a real ``branchbox serve``.

Each test is a case that never ended, or ran for nobody, before the daemon had
deadlines of its own: C code and caught interrupts past ``run_code(timeout=)``,
a fork bomb's children, a client that hangs up mid-run or while queued, a fork
of a REPL that cannot answer, fork children that outlived their parent's
lifetime. The clients' own timeouts are only there so that a regression fails
instead of hanging the suite; nothing here asserts a duration.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from served import ServedDaemon
from waiting import eventually

from branchbox import AsyncSandbox, SandboxTimeout
from branchbox.engine.config import EngineConfig
from branchbox.runtime.cgroups import SandboxCgroup
from branchbox.sdk._http import Api

KEY = "deadlines-test-key"
BUSY_WAIT = 6  # the daemon's bound on waiting for a busy sandbox (BRANCHBOX_BUSY_WAIT)
FORK_DEADLINE = 3


@pytest.fixture(scope="module")
def daemon() -> Iterator[ServedDaemon]:
    served = ServedDaemon("deadlines", {
        **os.environ, "BRANCHBOX_API_KEY": KEY, "BRANCHBOX_BUSY_WAIT": str(BUSY_WAIT),
        "BRANCHBOX_FORK_DEADLINE": str(FORK_DEADLINE)})
    yield served
    served.stop()


@pytest.fixture
def api(daemon: ServedDaemon) -> Iterator[httpx.Client]:
    with daemon.client(KEY) as client:
        client.timeout = httpx.Timeout(60)
        yield client


@pytest.fixture
def sid(api: httpx.Client) -> Iterator[str]:
    sandbox_id = api.post("/v1/sandboxes", json={}).json()["id"]
    yield sandbox_id
    api.delete(f"/v1/sandboxes/{sandbox_id}")


def run(api: httpx.Client, sid: str, code: str, **fields) -> httpx.Response:
    return api.post(f"/v1/sandboxes/{sid}/run_code", json={"code": code, **fields})


def result(reply: httpx.Response) -> dict:
    """The final ``result`` line of a run_code reply."""
    assert reply.status_code == 200, reply.text
    return [line for line in map(json.loads, reply.text.splitlines())
            if line.get("type") == "result"][-1]


def give_up_after(daemon: ServedDaemon, seconds: float, sid: str, code: str) -> None:
    """A client that sends ``code`` and hangs up after ``seconds`` without an answer."""
    with daemon.client(KEY) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post(f"/v1/sandboxes/{sid}/run_code", json={"code": code},
                       timeout=httpx.Timeout(seconds, connect=10))


def wait_for_status(api: httpx.Client, sid: str, status: int, within: float = 60) -> httpx.Response:
    deadline = time.monotonic() + within
    while True:
        reply = run(api, sid, "1")
        if reply.status_code == status or time.monotonic() > deadline:
            return reply
        time.sleep(0.5)


def test_c_code_past_its_timeout_is_killed_with_a_typed_error(api: httpx.Client, sid: str) -> None:
    reply = run(api, sid, "sum(range(10**11))", timeout=1)
    assert reply.status_code == 408, reply.text
    assert reply.json()["type"] == "SandboxTimeout"
    assert "killed" in reply.json()["error"]
    after = run(api, sid, "1")
    assert after.status_code == 410, after.text  # reported dead, saying why
    assert "timeout" in after.json()["error"]


def test_a_caught_interrupt_and_a_fork_bomb_are_stopped(api: httpx.Client, sid: str) -> None:
    code = ("import os, time\n"
            "for _ in range(8):\n"
            "    if os.fork() == 0:\n"
            "        while True: pass\n"
            "while True:\n"
            "    try:\n"
            "        time.sleep(0.1)\n"
            "    except KeyboardInterrupt:\n"
            "        pass\n")
    reply = run(api, sid, code, timeout=1)
    assert reply.status_code == 408, reply.text
    assert "killed" in reply.json()["error"]
    left = api.get(f"/v1/sandboxes/{sid}").json()["resources"].get("host_pids")
    assert left == [], f"processes of the sandbox still running: {left}"


def test_a_run_whose_client_hung_up_is_interrupted(daemon: ServedDaemon, api: httpx.Client,
                                                   sid: str) -> None:
    give_up_after(daemon, 1.5, sid, "import time\ntime.sleep(600)")
    assert result(run(api, sid, "40 + 2"))["text"] == "42"


def test_a_run_that_ignores_its_interrupt_is_busy_then_stopped(
        daemon: ServedDaemon, api: httpx.Client, sid: str) -> None:
    give_up_after(daemon, 1.5, sid, "import time\nwhile True:\n    try:\n        time.sleep(1)\n"
                                    "    except KeyboardInterrupt:\n        pass\n")
    busy = run(api, sid, "1")
    assert busy.status_code in (409, 410), busy.text  # never a call queued behind it
    if busy.status_code == 409:
        assert "busy" in busy.json()["error"]
    gone = wait_for_status(api, sid, 410)
    assert gone.status_code == 410, gone.text
    assert "went away" in gone.json()["error"]


def test_calls_abandoned_while_queued_never_run(daemon: ServedDaemon, api: httpx.Client,
                                                sid: str) -> None:
    first = threading.Thread(target=run, args=(
        api, sid, "open('/tmp/first', 'w').close()\nimport time\ntime.sleep(4)"))
    first.start()
    # The run holds the REPL once its marker is in a writable layer (copy storage's volumes).
    assert eventually(lambda: any(daemon.data_dir.glob("volumes/*/upper/tmp/first")))
    quitters = [threading.Thread(target=give_up_after, args=(
        daemon, 1, sid, "open('/root/ran', 'a').write('x')")) for _ in range(3)]
    for quitter in quitters:
        quitter.start()
    for thread in (first, *quitters):
        thread.join()
    time.sleep(1)
    ran = result(run(api, sid, "import os\nos.path.exists('/root/ran')"))
    assert ran["text"] == "False", "a call whose client gave up ran later"


def frozen_leaves(daemon: ServedDaemon) -> list[str]:
    frozen = []
    for cg in SandboxCgroup.leftovers(EngineConfig(data_dir=daemon.data_dir).cgroup_group):
        for d in cg.dirs:
            state = d / "cmds" / "freezer.state"
            events = d / "cmds" / "cgroup.events"
            if (state.exists() and state.read_text().strip() != "THAWED"
                    or events.exists() and "frozen 1" in events.read_text()):
                frozen.append(str(d))
    return frozen


def test_a_fork_of_a_repl_that_cannot_answer_ends_and_thaws(
        daemon: ServedDaemon, api: httpx.Client, sid: str) -> None:
    # A thread in C code holds the interpreter lock: the REPL reads no request any more.
    result(run(api, sid, "import threading\n"
                         "threading.Timer(0.5, lambda: sum(range(10**12))).start()"))
    time.sleep(1.5)
    reply = api.post(f"/v1/sandboxes/{sid}/fork", json={"n": 2})
    assert reply.status_code == 408, reply.text
    assert "did not finish" in reply.json()["error"]
    assert frozen_leaves(daemon) == []
    assert wait_for_status(api, sid, 410).status_code == 410


def test_a_request_the_repl_cannot_answer_ends(api: httpx.Client, sid: str) -> None:
    result(run(api, sid, "import threading\n"
                         "threading.Timer(0.5, lambda: sum(range(10**12))).start()"))
    time.sleep(1.5)
    reply = api.post(f"/v1/sandboxes/{sid}/commands/999999/kill", json={})
    assert reply.status_code == 408, reply.text
    assert "did not answer" in reply.json()["error"]


@pytest.mark.parametrize("policy", [{"timeout": 4}, {"idle_timeout": 3}])
def test_fork_children_live_by_their_parents_lifetime(api: httpx.Client, policy: dict) -> None:
    parent = api.post("/v1/sandboxes", json=policy).json()["id"]
    children = [c["id"] if isinstance(c, dict) else c for c in
                api.post(f"/v1/sandboxes/{parent}/fork", json={"n": 2}).json()["children"]]
    deadline = time.monotonic() + 60
    alive = [*children, parent]
    while alive and time.monotonic() < deadline:
        alive = [s for s in alive if api.get(f"/v1/sandboxes/{s}").status_code == 200]
        time.sleep(0.5)
    for leftover in alive:
        api.delete(f"/v1/sandboxes/{leftover}")
    assert alive == [], "sandboxes outlived their family's lifetime"


def test_the_sdk_gives_up_on_a_server_that_never_answers() -> None:
    """The SDK's own deadline: a server that accepts the call and never answers it (a
    hung daemon or a dropped connection, which no real daemon can be made to be)."""

    async def scenario() -> None:
        async def never_answer(reader: asyncio.StreamReader,
                               writer: asyncio.StreamWriter) -> None:
            try:
                await reader.read(1 << 16)
                await reader.read(1)  # until the client hangs up
            finally:
                writer.close()

        server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            sandbox = AsyncSandbox._attached(Api(f"http://127.0.0.1:{port}", KEY),
                                             "sbx_" + "0" * 32, None)
            try:
                with pytest.raises(SandboxTimeout, match="no answer"):
                    await asyncio.wait_for(sandbox.run_code("1", timeout=0.5), 60)
            finally:
                await sandbox.detach()

    asyncio.run(scenario())
