"""Errors a user can cause by exhausting something (issue 16, finding 8), against a real daemon.

Each is a typed JSON error with the status that says what happened, and a typed
SDK exception, never a 500 with the agent's traceback: a full disk is 507, the
process limit 429, a call cut by a graceful stop 503, and a REPL the kernel killed
for the sandbox's memory limit says so.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import httpx
import pytest
from served import ServedDaemon
from waiting import eventually

from branchbox import (
    InsufficientStorage,
    ReplGone,
    ResourceLimit,
    Sandbox,
)

KEY = "errors-test-key"


@pytest.fixture(scope="module")
def daemon() -> Iterator[ServedDaemon]:
    served = ServedDaemon("errors", {**os.environ, "BRANCHBOX_API_KEY": KEY},
                          "--storage", "btrfs")
    yield served
    served.stop()


def sandbox(daemon: ServedDaemon, **kwargs) -> Sandbox:
    return Sandbox(url=daemon.url, api_key=KEY, **kwargs)


def test_a_full_disk_is_a_507_with_a_json_error(daemon: ServedDaemon) -> None:
    with sandbox(daemon, disk_mb=64) as sb:
        with pytest.raises(InsufficientStorage) as caught:
            sb.files.write("/root/big", b"\0" * (100 << 20))
        assert caught.value.status == 507
        assert "disk" in caught.value.message and "Traceback" not in caught.value.message
        with daemon.client(KEY) as client:
            r = client.put(f"/v1/sandboxes/{sb.id}/files", params={"path": "/root/big2"},
                           content=b"\0" * (100 << 20))
        assert r.status_code == 507, r.text
        assert r.json()["type"] == "InsufficientStorage"
        sb.files.write("/root/small", b"fits")  # the failed writes left nothing behind
        assert sb.files.read("/root/small") == b"fits"


# Takes every free process slot and keeps them: a background command, so that nothing
# transient (a run_code's output thread) frees a slot before the test's own exec.
FILL = ("python3 -c \"import subprocess, time\n"
        "procs = []\n"
        "try:\n"
        "    while True: procs.append(subprocess.Popen(['sleep', '600']))\n"
        "except OSError as exc:\n"
        "    open('/tmp/full', 'w').write(str(exc.errno))\n"
        "time.sleep(600)\"")


def test_the_process_limit_is_a_429(daemon: ServedDaemon) -> None:
    with sandbox(daemon) as sb:
        filler = sb.exec(FILL, background=True)
        assert eventually(lambda: sb.files.exists("/tmp/full"), within=60)
        assert sb.files.read("/tmp/full") == b"11"  # EAGAIN: the limit is reached
        with pytest.raises(ResourceLimit) as caught:
            sb.exec("true")
        assert caught.value.status == 429
        assert "process limit" in caught.value.message, caught.value.message
        with pytest.raises(ResourceLimit) as caught:  # the REPL cannot fork a child either
            sb.fork(2)
        assert caught.value.status == 429 and "fork failed" in caught.value.message
        filler.kill()  # its process group: the sleeps too
        assert eventually(lambda: _runs(sb), within=30)
        (child,) = sb.fork(1)  # nothing of the failed fork is left in the way
        assert child.run_code("1 + 1").text == "2"
        child.close()


def test_commands_after_user_code_killed_their_init_are_a_typed_410(
        daemon: ServedDaemon) -> None:
    """``os.kill(-1, SIGKILL)`` from the REPL kills the init of the sandbox's command
    namespace: every later exec answered a 500 with the agent's BrokenPipeError. Now a
    410 of kind CommandsGone that says so, and the REPL and the files go on."""
    with sandbox(daemon) as sb:
        sb.run_code("import os, signal\nos.kill(-1, signal.SIGKILL)")
        for _ in range(2):
            with pytest.raises(ReplGone) as caught:
                sb.exec("echo hi")
            assert (caught.value.status, caught.value.kind) == (410, "CommandsGone")
            assert "command namespace is gone" in caught.value.message
        assert sb.run_code("6 * 7").text == "42"
        sb.files.write("/tmp/still", b"ok")
        assert sb.files.read("/tmp/still") == b"ok"


def _runs(sb: Sandbox) -> bool:
    try:
        return sb.exec("echo ok").stdout == "ok\n"
    except ResourceLimit:
        return False


def test_a_repl_killed_for_its_memory_limit_says_so(daemon: ServedDaemon) -> None:
    with sandbox(daemon, memory_mb=256) as sb:
        with pytest.raises(ReplGone, match="ran out of memory") as caught:
            sb.run_code("hog = b'x' * (1 << 30)")
        assert caught.value.status == 410


def test_calls_in_flight_during_a_graceful_stop_get_a_503() -> None:
    served = ServedDaemon("stopping", {**os.environ, "BRANCHBOX_API_KEY": KEY})
    try:
        sb = sandbox(served)
        replies: list[httpx.Response] = []
        # The run starts a process first: the sandbox's process count, which the daemon
        # reads from its cgroup without asking the REPL, says when the run is under way.
        code = "import subprocess, time; p = subprocess.Popen(['sleep', '300']); time.sleep(120)"

        def long_call() -> None:
            with served.client(KEY) as client:
                replies.append(client.post(f"/v1/sandboxes/{sb.id}/run_code",
                                           json={"code": code}))

        with served.client(KEY) as client:
            def pids() -> int:
                return client.get(f"/v1/sandboxes/{sb.id}").json()["resources"]["pids"]

            before = pids()
            caller = threading.Thread(target=long_call)
            caller.start()
            assert eventually(lambda: pids() > before)
        served.proc.send_signal(signal.SIGTERM)
        caller.join(60)
        assert served.proc.wait(60) == 0, served.log.read_text()
        [reply] = replies
        assert reply.status_code == 503, reply.text
        assert reply.json()["type"] == "ServerStopping"
        assert "stopping" in reply.json()["error"]
        sb.detach()  # the stop closed it: only the client's connection is let go
    finally:
        served.stop()
