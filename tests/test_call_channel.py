"""Runs over the calls WebSocket (server.call_channel, sdk._channel), against a real daemon.

The SDK sends run_code and foreground commands of all its sandboxes down one
connection; what must hold is what holds over HTTP: the same results and typed
errors, runs of different sandboxes at once, a run given up on (cancelled, or its
connection closed) abandoned in the sandbox, a graceful stop answered with
ServerStopping, and no run for a client without the key. Hostile messages close
the connection or get an error line; none reaches the engine unchecked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from served import ServedDaemon
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from branchbox import (
    AsyncSandbox,
    InvalidRequest,
    Sandbox,
    SandboxError,
    SandboxNotFound,
    ServerStopping,
    StaleBranchError,
)
from branchbox.sdk._config import ssl_context
from branchbox.server.call_channel import MAX_RUNS

KEY = "channel-test-key"


@pytest.fixture(scope="module")
def daemon() -> Iterator[ServedDaemon]:
    served = ServedDaemon("channel", {**os.environ, "BRANCHBOX_API_KEY": KEY})
    yield served
    served.stop()


def _ws_url(daemon: ServedDaemon) -> str:
    return "ws" + daemon.url.removeprefix("http") + "/v1/calls"


def _raw(daemon: ServedDaemon, key: str | None = KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return connect(_ws_url(daemon), additional_headers=headers, proxy=None)


def test_runs_and_their_errors_over_one_connection(daemon: ServedDaemon) -> None:
    with Sandbox(url=daemon.url, api_key=KEY) as sb:
        printed: list[str] = []
        run = sb.run_code("print('out'); import sys; print('err', file=sys.stderr); 6 * 7",
                          on_stdout=printed.append)
        assert (run.text, run.stdout, run.stderr, printed) == ("42", "out\n", "err\n", ["out\n"])
        assert sb.run_code("1 / 0").error.name == "ZeroDivisionError"
        done = sb.exec("echo hi; exit 3")
        assert (done.stdout, done.exit_code) == ("hi\n", 3)
        with pytest.raises(InvalidRequest, match="timeout"):
            sb.run_code("1", timeout=-1)
        with pytest.raises(InvalidRequest, match="n must be"):
            sb.fork(n=0)
        children = sb.fork(n=2)  # over the connection too
        try:
            assert len({sb.ip, *(c.ip for c in children)}) == 3
            assert [c.run_code("2 + 2").text for c in children] == ["4", "4"]
            channel = sb._core._api._channel  # noqa: SLF001 - which connection carried them
            assert all(c._core._api._channel is channel for c in children)  # noqa: SLF001
            assert channel._ws is not None and channel._ids >= 8  # noqa: SLF001
        finally:
            for child in children:
                child.close()


def test_a_close_goes_over_the_connection_once_it_is_open(daemon: ServedDaemon) -> None:
    """A close goes down the connection when the client has it open (its runs opened it),
    with the answers of its HTTP route; a client that ran nothing closes over HTTP
    rather than open a connection for its last call."""
    async def scenario() -> None:
        sb = await AsyncSandbox(url=daemon.url, api_key=KEY).start()
        channel = sb._api._channel  # noqa: SLF001 - which connection carried it
        assert (await sb.run_code("1 + 1")).text == "2"
        sent = channel._ids  # noqa: SLF001
        gone = AsyncSandbox._attached(sb._api.retain(), "sbx_" + "0" * 32, None)  # noqa: SLF001
        await gone.close()  # not found: closed already, as over HTTP
        await sb.close()
        assert channel._ids == sent + 2  # noqa: SLF001
        with pytest.raises(SandboxNotFound):
            await AsyncSandbox.connect(sb.id, url=daemon.url, api_key=KEY)
        idle = await AsyncSandbox(url=daemon.url, api_key=KEY).start()
        await idle.close()
        assert idle._api._channel._ws is None  # noqa: SLF001 - never opened
        with pytest.raises(SandboxNotFound):
            await AsyncSandbox.connect(idle.id, url=daemon.url, api_key=KEY)
    asyncio.run(scenario())


def test_merges_checkpoints_and_restores_over_the_connection(daemon: ServedDaemon) -> None:
    """Every call that answers once goes down the connection too, with the answers and
    typed errors its HTTP route gives."""
    with Sandbox(url=daemon.url, api_key=KEY) as sb:
        sb.run_code("x = 'at the checkpoint'")
        cp = sb.checkpoint("first")
        assert (cp.name, [c.id for c in sb.checkpoints()]) == ("first", [cp.id])
        sb.run_code("x = 'later'")
        sb.restore(cp)
        assert sb.run_code("x").text == "'at the checkpoint'"
        (twin,) = cp.fork(1)
        (child,) = sb.fork(1)
        try:
            assert twin.ip and twin.run_code("x").text == "'at the checkpoint'"
            with pytest.raises(StaleBranchError):  # forked from before the restore
                sb.merge_into(twin)
            child.run_code("x = 'merged'")
            sb.merge_into(child)
            assert sb.run_code("x").text == "'merged'"
            with pytest.raises(SandboxNotFound):
                sb.restore("cp_" + "0" * 32)
            with pytest.raises(InvalidRequest, match="checkpoint name"):
                sb.checkpoint("\n")
        finally:
            twin.close()
            child.close()
        channel = sb._core._api._channel  # noqa: SLF001 - which connection carried them
        assert channel._ws is not None and channel._ids >= 12  # noqa: SLF001


def test_runs_started_at_once_share_one_connection(daemon: ServedDaemon) -> None:
    """The first runs of a client, started together, open one connection between them."""
    async def scenario() -> None:
        async with AsyncSandbox(url=daemon.url, api_key=KEY) as sb:
            children = await sb.fork(n=3)
            runs = [member.run_code("7 * 6") for member in (sb, *children)]
            assert [r.text for r in await asyncio.gather(*runs)] == ["42"] * 4
            channel = sb._api._channel  # noqa: SLF001
            opened = [task for task in asyncio.all_tasks()
                      if getattr(task.get_coro(), "__qualname__", "") == "CallChannel._read"]
            assert len(opened) == 1 and channel._ws is not None  # noqa: SLF001
            for child in children:
                await child.close()
    asyncio.run(scenario())


def test_runs_of_different_sandboxes_go_on_at_once(daemon: ServedDaemon) -> None:
    """A run that waits for the host holds no other run up: another sandbox's run, on the
    same connection, is answered meanwhile. (The first waits for a connection from the
    host: a file written through the API would wait behind the run.)"""
    with Sandbox(url=daemon.url, api_key=KEY) as sb:
        sb.run_code("import socket; srv = socket.create_server(('0.0.0.0', 9000))")
        (other,) = sb.fork(n=1)
        try:
            waiting = threading.Thread(target=sb.run_code, args=("srv.accept()",))
            waiting.start()
            assert other.run_code("'answered'").text == "'answered'"
            assert waiting.is_alive()
            with socket.create_connection((sb.ip, 9000), timeout=30):
                waiting.join(60)
            assert not waiting.is_alive()
        finally:
            other.close()


def test_a_run_given_up_on_is_interrupted(daemon: ServedDaemon) -> None:
    """A cancelled call sends a cancel: the run stops (KeyboardInterrupt) at once and the
    sandbox serves the next call, its state intact, instead of answering busy."""
    async def scenario() -> None:
        async with AsyncSandbox(url=daemon.url, api_key=KEY) as sb:
            run = asyncio.ensure_future(sb.run_code(
                "x = 1\nimport time\nwhile True: time.sleep(0.01)"))
            await asyncio.sleep(1)
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            assert (await sb.run_code("x")).text == "1"
    asyncio.run(scenario())


def test_closing_the_connection_abandons_its_runs(daemon: ServedDaemon) -> None:
    """Runs queued behind a busy sandbox and the run under way, all of a connection that
    closes: the queued ones never run, the running one is interrupted."""
    with Sandbox(url=daemon.url, api_key=KEY) as sb:
        async def scenario() -> None:
            async with _raw(daemon) as ws:
                body = {"code": "open('/tmp/ran', 'a').write('x')\n"
                                "import time\nwhile True: time.sleep(0.01)"}
                for run in range(3):
                    await ws.send(json.dumps({"id": run, "op": "run_code", "sandbox": sb.id,
                                              "body": body}))
                await asyncio.sleep(1)
        asyncio.run(scenario())
        assert sb.run_code("open('/tmp/ran').read()").text == "'x'"


def test_a_run_abandoned_before_its_cell_began_still_ends(daemon: ServedDaemon) -> None:
    """The connection closes as soon as the run is sent: its interrupt can land before the
    REPL began the cell (between calls it ignores SIGINT). It is interrupted again until
    it ends, so the sandbox serves the next call (it used to be killed 5 s later)."""
    with Sandbox(url=daemon.url, api_key=KEY) as sb:
        async def scenario() -> None:
            async with _raw(daemon) as ws:
                await ws.send(json.dumps({"id": 1, "op": "run_code", "sandbox": sb.id,
                                          "body": {"code": "import time; time.sleep(60)"}}))
        for _ in range(5):
            asyncio.run(scenario())
            assert sb.run_code("'served'").text == "'served'"


def test_bad_messages_close_the_connection_or_get_an_error_line(daemon: ServedDaemon) -> None:
    with Sandbox(url=daemon.url, api_key=KEY) as sb:
        async def answer(ws, message: dict) -> dict:
            await ws.send(json.dumps(message))
            return json.loads(await ws.recv())["line"]

        async def scenario() -> None:
            for bad in (b"binary", "not json", "[1]", json.dumps({"id": 1}),
                        json.dumps({"id": 1, "op": "files", "sandbox": sb.id, "body": {}}),
                        json.dumps({"id": True, "op": "run_code", "sandbox": sb.id,
                                    "body": {}}),
                        json.dumps({"cancel": "x"})):
                async with _raw(daemon) as ws:
                    await ws.send(bad)
                    with pytest.raises(ConnectionClosed) as closed:
                        await ws.recv()
                    assert closed.value.rcvd.code == 1007, bad
            async with _raw(daemon) as ws:
                line = await answer(ws, {"id": 1, "op": "run_code", "sandbox": sb.id,
                                         "body": {"code": 5}})
                assert (line["type"], line["status"], line["kind"]) == (
                    "error", 400, "InvalidRequest")
                line = await answer(ws, {"id": 2, "op": "run_code", "sandbox": "sbx_" + "0" * 32,
                                         "body": {"code": "1"}})
                assert (line["type"], line["status"]) == ("error", 404)
                line = await answer(ws, {"id": 3, "op": "commands", "sandbox": sb.id,
                                         "body": {"cmd": "sleep 9", "background": True}})
                assert (line["type"], line["status"]) == ("error", 400)
                await ws.send(json.dumps({"cancel": 77}))  # nothing of that id: ignored
                line = await answer(ws, {"id": 4, "op": "run_code", "sandbox": sb.id,
                                         "body": {"code": "'still served'"}})
                assert line["text"] == "'still served'"
        asyncio.run(scenario())


def test_runs_at_once_on_one_connection_are_bounded(daemon: ServedDaemon) -> None:
    with Sandbox(url=daemon.url, api_key=KEY) as sb:
        async def scenario() -> None:
            async with _raw(daemon) as ws:
                body = {"code": "import time; time.sleep(60)"}
                for run in range(MAX_RUNS + 1):  # one runs, the others wait for the sandbox
                    await ws.send(json.dumps({"id": run, "op": "run_code", "sandbox": sb.id,
                                              "body": body}))
                reply = json.loads(await ws.recv())
                assert reply["id"] == MAX_RUNS
                assert (reply["line"]["status"], reply["line"]["kind"]) == (429, "ResourceLimit")
                await ws.send(json.dumps({"id": 0, "op": "run_code", "sandbox": sb.id,
                                          "body": body}))
                reply = json.loads(await ws.recv())
                assert (reply["id"], reply["line"]["status"]) == (0, 400)  # id 0 still runs
        asyncio.run(scenario())
        assert sb.run_code("'free again'").text == "'free again'"  # all were abandoned


def test_no_runs_without_the_key(daemon: ServedDaemon) -> None:
    async def scenario() -> None:
        for key in (None, "wrong"):
            with pytest.raises(InvalidStatus) as refused:
                async with _raw(daemon, key):
                    pass
            assert refused.value.response.status_code == 403
    asyncio.run(scenario())


def test_a_graceful_stop_ends_a_run_with_server_stopping() -> None:
    served = ServedDaemon("channel-stop", {**os.environ, "BRANCHBOX_API_KEY": KEY})
    try:
        sb = Sandbox(url=served.url, api_key=KEY)
        sb.run_code("import socket; srv = socket.create_server(('0.0.0.0', 9000))")
        caught: list[BaseException] = []

        def long_run() -> None:
            try:
                sb.run_code("conn, _ = srv.accept(); conn.sendall(b'go')\n"
                            "import time; time.sleep(120)")
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                caught.append(exc)

        runner = threading.Thread(target=long_run)
        runner.start()
        with socket.create_connection((sb.ip, 9000), timeout=30) as conn:
            assert conn.recv(2) == b"go"  # the run is under way
        served.proc.send_signal(signal.SIGTERM)
        runner.join(60)
        assert served.proc.wait(60) == 0, served.log.read_text()
        [error] = caught
        assert isinstance(error, ServerStopping), repr(error)
        sb.detach()
    finally:
        served.stop()


@contextmanager
def _tls_front(daemon: ServedDaemon, cert: Path, key: Path) -> Iterator[str]:
    """An https URL whose TLS ends in front of ``daemon`` (as a proxy's before a remote
    daemon does): each connection piped to the daemon's plain port, a thread each way."""
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    opened: list[socket.socket] = []

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)

    def serve() -> None:
        with contextlib.suppress(OSError):  # the listener shut: the test is over
            while True:
                conn, _ = listener.accept()
                try:
                    client = tls.wrap_socket(conn, server_side=True)
                except ssl.SSLError:  # the client did not trust us
                    conn.close()
                    continue
                upstream = socket.create_connection(("127.0.0.1", daemon.port))
                opened.extend([client, upstream])
                for src, dst in ((client, upstream), (upstream, client)):
                    threading.Thread(target=pipe, args=(src, dst), daemon=True).start()

    accepting = threading.Thread(target=serve, daemon=True)
    accepting.start()
    try:
        yield f"https://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        accepting.join(10)
        listener.close()
        for sock in opened:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_calls_and_runs_over_tls_trust_one_shared_context(daemon: ServedDaemon, tmp_path: Path,
                                                           monkeypatch) -> None:
    """Over https, HTTP calls and the runs' WebSocket verify the server with the one TLS
    context the SDK makes per process (loading CAs cost every Sandbox() ~23 ms when each
    made its own): it trusts ``SSL_CERT_FILE``, and a server it does not trust is
    refused on both."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    ssl_context.cache_clear()  # made anew, with this test's CA file
    try:
        with _tls_front(daemon, cert, key) as url:
            with pytest.raises(SandboxError):  # the default CAs do not know this server
                Sandbox(url=url, api_key=KEY)
            ssl_context.cache_clear()
            monkeypatch.setenv("SSL_CERT_FILE", str(cert))
            with Sandbox(url=url, api_key=KEY) as sb, Sandbox(url=url, api_key=KEY) as other:
                assert sb.run_code("x = 6 * 7; x").text == "42"  # over the WebSocket
                sb.files.write("/root/t.txt", b"tls")  # over HTTP
                (kid,) = sb.fork(1)
                with kid:
                    assert kid.run_code("x").text == "42"
                    assert kid.files.read("/root/t.txt") == b"tls"
                assert other.exec("echo hi").stdout == "hi\n"
            made = ssl_context.cache_info()
            assert (made.misses, made.currsize) == (1, 1) and made.hits >= 3, made
    finally:
        ssl_context.cache_clear()
