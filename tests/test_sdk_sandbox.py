"""The SDK (and the CLI on top of it) against a real daemon on a unix socket.

The daemon runs as ``python -m branchbox serve`` in a temporary data
directory, with an API key, exactly as a user would start it. Needs root and
the default image (built on first use).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from branchbox import (
    AsyncSandbox,
    AuthError,
    CommandHandle,
    CommandNotFound,
    CommandResult,
    FileNotFound,
    InvalidRequest,
    Sandbox,
    SandboxError,
    SandboxNotFound,
    SandboxTimeout,
)
from branchbox.sdk import _daemon

API_KEY = "sdk-test-key"


def make_data_dir(tag: str) -> Path:
    """Not pytest's tmp_path: its parents are 0700, and a sandbox's mapped root must be
    able to traverse the data directory to attach its root filesystem."""
    path = Path(tempfile.mkdtemp(prefix=f"branchbox-{tag}-"))
    path.chmod(0o755)
    return path


def wait_until_healthy(sock: Path, proc_alive: object, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        # A plain connect first: httpx leaks the socket of a failed unix connect.
        with socket.socket(socket.AF_UNIX) as probe:
            listening = probe.connect_ex(str(sock)) == 0
        if listening:
            transport = httpx.HTTPTransport(uds=str(sock))
            with httpx.Client(transport=transport, base_url="http://branchbox") as client:
                assert client.get("/v1/healthz").text == "ok"
            return
        if not proc_alive():  # type: ignore[operator]
            pytest.fail(f"the daemon exited while starting:\n{log.read_text()}")
        time.sleep(0.2)
    pytest.fail(f"the daemon did not answer within 120 s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def daemon() -> Iterator[str]:
    """The URL of a daemon that wants API_KEY."""
    yield from serve_daemon("copy")


def serve_daemon(storage: str) -> Iterator[str]:
    """Start ``branchbox serve`` with store ``storage`` in a fresh data directory, yield its
    URL, stop it (it must exit cleanly) and remove the directory."""
    if os.geteuid() != 0:
        pytest.fail("the SDK tests need root: the daemon makes namespaces, cgroups and mounts")
    data_dir = make_data_dir("sdk-test")
    log = data_dir / "test-daemon.log"
    env = {**os.environ, "BRANCHBOX_API_KEY": API_KEY}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "branchbox", "serve", "--data-dir",
                                 str(data_dir), "--storage", storage], env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    sock = data_dir / "branchbox.sock"
    try:
        wait_until_healthy(sock, lambda: proc.poll() is None, log)
        assert f"branchbox listening on unix://{sock}" in log.read_text()
        assert sock.stat().st_mode & 0o777 == 0o600
        yield f"unix://{sock}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
        assert not sock.exists(), "a stopped daemon removes its socket"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(data_dir)


@pytest.fixture
def connected(daemon: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Configure the SDK through the environment, as a user would."""
    monkeypatch.setenv("BRANCHBOX_URL", daemon)
    monkeypatch.setenv("BRANCHBOX_API_KEY", API_KEY)
    return daemon


@pytest.fixture
def sandbox(connected: str) -> Iterator[Sandbox]:
    with Sandbox() as sb:
        yield sb


# ------------------------------------------------------------------------- the API.md flow


def test_api_md_example(connected: str) -> None:
    with Sandbox() as parent:
        parent.run_code("import pandas as pd")
        children = parent.fork(n=3)
        assert [c.parent_id for c in children] == [parent.id] * 3
        for child in children:
            assert child.run_code("print(pd.__version__)").stdout.strip()
        winner = children[0]
        winner.run_code("open('/root/result.txt', 'w').write('42')")
        changes = children[1].diff(winner)
        assert "/root/result.txt" in changes["added"]
        parent.merge_into(winner)
        assert parent.files.read("/root/result.txt") == b"42"
        winner.close()  # a no-op: the winner's state now belongs to the parent
        for child in children[1:]:
            child.close()
        assert parent.info()["state"] == "ready"


# ------------------------------------------------------------------------------- run_code


def test_run_code_results(sandbox: Sandbox) -> None:
    execution = sandbox.run_code("import sys\nprint('out')\nprint('err', file=sys.stderr)\n"
                                 "{'a': 1}")
    assert execution.stdout == "out\n" and execution.stderr == "err\n"
    assert execution.text == "{'a': 1}" and execution.error is None
    assert execution.results["text/plain"] == "{'a': 1}"
    assert execution.duration >= 0 and execution.truncated is False
    failed = sandbox.run_code("def f():\n    raise ValueError('bad value')\nf()")
    assert failed.error is not None
    assert (failed.error.name, failed.error.value) == ("ValueError", "bad value")
    assert "raise ValueError" in failed.error.traceback


def test_output_streams_to_callbacks_while_running(sandbox: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    execution = sandbox.run_code(
        "import time\nprint('early', flush=True)\ntime.sleep(3)\nprint('late')",
        on_stdout=lambda text: seen.append((time.monotonic(), text)))
    assert [text for _, text in seen] == ["early\n", "late\n"]
    assert seen[1][0] - seen[0][0] > 1.5, "the first line must arrive before the run ends"
    assert execution.stdout == "early\nlate\n"


def test_timeout_interrupts_and_keeps_state(sandbox: Sandbox) -> None:
    sandbox.run_code("counter = 41")
    with pytest.raises(SandboxTimeout) as caught:
        sandbox.run_code("print('started', flush=True)\nimport time\ntime.sleep(60)",
                         timeout=1)
    assert isinstance(caught.value, TimeoutError) and isinstance(caught.value, SandboxError)
    assert caught.value.result.stdout == "started\n"
    assert sandbox.run_code("counter + 1").text == "42"


# ----------------------------------------------------------------------------------- exec


def test_exec(sandbox: Sandbox) -> None:
    result = sandbox.exec(["echo", "hello"])
    assert isinstance(result, CommandResult)
    assert (result.stdout, result.exit_code) == ("hello\n", 0)
    chunks: list[str] = []
    result = sandbox.exec("echo $GREETING from $(pwd) >&2; exit 5", cwd="/tmp",
                          env={"GREETING": "hi"}, on_stderr=chunks.append)
    assert (result.stderr, result.exit_code) == ("hi from /tmp\n", 5)
    assert "".join(chunks) == result.stderr


def test_a_plain_command_runs_as_bash_would_run_it(sandbox: Sandbox) -> None:
    """``env`` is started without bash (agent.plain_command); quoted, through bash, which
    execs it in its place: in a sandbox, through its spawner, the same environment."""
    plain = sandbox.exec("env -0", cwd="/tmp", env={"SHLVL": "2"}).stdout.split("\0")
    via_bash = sandbox.exec("'env' -0", cwd="/tmp", env={"SHLVL": "2"}).stdout.split("\0")
    assert sorted(plain) == sorted(via_bash) and "_=/usr/bin/env" in plain
    assert sandbox.exec("ls -d /tmp /root").stdout == "/root\n/tmp\n"


def test_command_not_found(sandbox: Sandbox) -> None:
    with pytest.raises(CommandNotFound):
        sandbox.exec(["no-such-program"])
    with pytest.raises(CommandNotFound) as caught:
        sandbox.exec("no-such-program --flag")
    assert caught.value.result.exit_code == 127


def test_background_commands(sandbox: Sandbox) -> None:
    handle = sandbox.exec("sleep 0.2; echo finished", background=True)
    assert isinstance(handle, CommandHandle) and handle.pid > 0
    result = handle.wait(timeout=30)
    assert (result.stdout, result.exit_code) == ("finished\n", 0)
    sleeper = sandbox.exec(["sleep", "600"], background=True)
    assert isinstance(sleeper, CommandHandle)
    with pytest.raises(SandboxTimeout):
        sleeper.wait(timeout=0.5)
    sleeper.kill()
    assert sleeper.wait(timeout=30).exit_code != 0


# ---------------------------------------------------------------------------------- files


def test_files(sandbox: Sandbox, tmp_path: Path) -> None:
    sandbox.files.write("/root/notes/a.txt", "text")  # parents are created
    sandbox.files.write("/root/notes/b.bin", b"\x00\x01", mode=0o600)
    assert sandbox.files.read("/root/notes/a.txt") == b"text"
    names = sorted(entry["name"] for entry in sandbox.files.list("/root/notes"))
    assert names == ["a.txt", "b.bin"]
    assert sandbox.files.stat("/root/notes/b.bin")["mode"] == 0o600
    assert sandbox.files.exists("/root/notes/a.txt")
    sandbox.files.remove("/root/notes", recursive=True)
    assert not sandbox.files.exists("/root/notes")
    with pytest.raises(FileNotFound) as caught:
        sandbox.files.read("/root/notes/a.txt")
    assert isinstance(caught.value, FileNotFoundError)


def test_large_files_stream_both_ways(sandbox: Sandbox, tmp_path: Path) -> None:
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(7 * 1024 * 1024 + 5))
    with source.open("rb") as upload:  # sent in chunks, never read whole
        sandbox.files.write("/root/big.bin", upload)
    chunks = list(sandbox.files.read_stream("/root/big.bin"))
    assert len(chunks) > 1, "a download must arrive as a stream of chunks"
    assert b"".join(chunks) == source.read_bytes()
    assert sandbox.exec("wc -c < /root/big.bin").stdout.strip() == str(7 * 1024 * 1024 + 5)


# ------------------------------------------------------------------------ errors and life


def test_typed_errors(sandbox: Sandbox, daemon: str) -> None:
    with pytest.raises(SandboxNotFound):
        Sandbox.connect("sbx_" + "0" * 32)
    with pytest.raises(InvalidRequest, match="n must be between 1 and 32"):
        sandbox.fork(n=0)
    with pytest.raises(InvalidRequest, match="path"):
        sandbox.files.read("relative/path")
    with pytest.raises(AuthError, match="invalid api key"):
        Sandbox(url=daemon, api_key="wrong-key")


def test_unreachable_daemon_is_a_sandbox_error(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="could not reach") as caught:
        Sandbox(url=f"unix://{tmp_path}/nobody.sock")
    assert isinstance(caught.value.__cause__, httpx.TransportError)


def test_context_manager_closes(connected: str) -> None:
    with Sandbox(env={"MARK": "set"}) as sb:
        sandbox_id = sb.id
        assert sb.exec("echo $MARK").stdout == "set\n"
        again = Sandbox.connect(sandbox_id)
        assert again.id == sandbox_id and again.parent_id is None
        again.detach()  # leaves it running
    with pytest.raises(SandboxNotFound):
        Sandbox.connect(sandbox_id)
    sb.close()  # idempotent
    with pytest.raises(SandboxError, match="closed"):
        sb.run_code("1")
    assert sandbox_id not in [info["id"] for info in Sandbox.list_all()]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_async_sandbox(connected: str, anyio_backend: str) -> None:
    streamed: list[str] = []

    async def on_stdout(text: str) -> None:
        streamed.append(text)

    async with AsyncSandbox() as sb:
        await sb.run_code("x = 20")
        execution = await sb.run_code("print(x * 2)", on_stdout=on_stdout)
        assert execution.stdout == "40\n" and streamed == ["40\n"]
        result = await sb.exec("cat /proc/sys/kernel/hostname")
        assert isinstance(result, CommandResult) and result.stdout.strip() == sb.id
        await sb.files.write("/tmp/async.txt", b"async")
        assert await sb.files.read("/tmp/async.txt") == b"async"
        assert [chunk async for chunk in sb.files.read_stream("/tmp/async.txt")] == [b"async"]
        with pytest.raises(SandboxTimeout):
            await sb.run_code("import time; time.sleep(30)", timeout=0.5)
        assert (await sb.run_code("x")).text == "20"
        (child,) = await sb.fork()
        assert child.parent_id == sb.id and (await child.run_code("x")).text == "20"
        await child.close()
        sandbox_id = sb.id
    with pytest.raises(SandboxNotFound):
        await AsyncSandbox.connect(sandbox_id)


def test_sync_face_over_asgi_transport() -> None:
    """``transport=`` reaches the app in-process, for the blocking face too (via its loop)."""
    from branchbox.engine.config import EngineConfig
    from branchbox.engine.sandboxes import Engine
    from branchbox.sdk._portal import portal
    from branchbox.server.app import create_app

    data_dir = make_data_dir("asgi-test")
    app = create_app(Engine(EngineConfig(data_dir=data_dir, storage="copy")))
    lifespan = app.router.lifespan_context(app)
    portal.run(lifespan.__aenter__())  # the engine lives on the loop the SDK uses
    try:
        with Sandbox(transport=httpx.ASGITransport(app)) as sb:
            assert sb.run_code("1 + 1").text == "2"
            sb.files.write("/root/x", b"y")
            assert sb.files.read("/root/x") == b"y"
    finally:
        portal.run(lifespan.__aexit__(None, None, None))
        shutil.rmtree(data_dir)


# --------------------------------------------------------------- starting the local daemon


def test_starts_local_daemon_when_none_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    data_dir = make_data_dir("autostart-test")
    for name in ("BRANCHBOX_URL", "BRANCHBOX_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BRANCHBOX_DATA_DIR", str(data_dir))
    monkeypatch.setenv("BRANCHBOX_STORAGE", "copy")
    try:
        with Sandbox() as sb:
            assert sb.run_code("'auto'").text == "'auto'"
        assert (data_dir / "branchbox.sock").exists()
        assert "branchbox listening on" in (data_dir / "daemon.log").read_text()
    finally:
        stop_daemon_of(data_dir)
        shutil.rmtree(data_dir)


def stop_daemon_of(data_dir: Path) -> None:
    """SIGTERM the daemon the SDK started for ``data_dir`` (our child) and reap it."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(data_dir).encode() in argv:
            pid = int(entry.name)
            os.kill(pid, signal.SIGTERM)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0


def test_starting_a_daemon_needs_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("BRANCHBOX_URL", "BRANCHBOX_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BRANCHBOX_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(_daemon.os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxError, match="needs root"):
        Sandbox()


# -------------------------------------------------------------------------------- the CLI


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "branchbox", *args], capture_output=True,
                          text=True, timeout=120, env=os.environ.copy())


def test_cli(connected: str) -> None:
    created = cli("create", "--timeout", "600")
    assert created.returncode == 0, created.stderr
    sandbox_id = created.stdout.strip()
    assert sandbox_id.startswith("sbx_")
    listed = json.loads(cli("ls", "--json").stdout)
    assert sandbox_id in [info["id"] for info in listed]
    ran = cli("run", sandbox_id, "print('from cli')\n6 * 7")
    assert (ran.returncode, ran.stdout) == (0, "from cli\n42\n")
    assert cli("run", sandbox_id, "1/0").returncode == 1
    executed = cli("exec", sandbox_id, "--", "sh", "-c", "echo shell; exit 4")
    assert (executed.returncode, executed.stdout) == (4, "shell\n")
    forked = json.loads(cli("fork", sandbox_id, "-n", "2", "--json").stdout)["children"]
    assert len(forked) == 2
    assert cli("exec", forked[0], "--", "touch /root/new").returncode == 0
    changes = json.loads(cli("diff", sandbox_id, forked[0], "--json").stdout)
    assert "/root/new" in changes["added"]
    assert cli("merge", sandbox_id, forked[0]).returncode == 0
    assert cli("rm", forked[1], sandbox_id).returncode == 0
    missing = cli("rm", sandbox_id)
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: sandbox not found")
    assert len(missing.stderr.strip().splitlines()) == 1



@pytest.mark.parametrize("name", ["serve", "ls", "create", "run", "exec", "fork", "diff",
                                  "merge", "rm"])
def test_cli_help(name: str) -> None:
    helped = cli(name, "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--json" in helped.stdout
    lines = [line.strip() for line in helped.stdout.split("Usage:", 1)[1].splitlines()]
    summary = next(line for line in lines[1:] if line)
    assert len(summary) > 20 and summary[0].isupper(), helped.stdout  # says what it does
