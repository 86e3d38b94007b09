"""The REST API over a real engine, in-process (httpx.ASGITransport): shapes and statuses.

Needs root (sandboxes are namespaces, cgroups and mounts) and the default
image, which is built on first use (a few minutes, once per machine).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from branchbox.engine.config import EngineConfig
from branchbox.engine.sandboxes import Engine
from branchbox.server.app import create_app

pytestmark = pytest.mark.anyio
MISSING = "sbx_" + "0" * 32


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    if os.geteuid() != 0:
        pytest.fail("the server tests need root: sandboxes use namespaces, cgroups and mounts")
    # Not pytest's tmp_path: its parents are 0700, and a sandbox's mapped root must be able
    # to traverse the data directory to attach its root filesystem.
    data_dir = Path(tempfile.mkdtemp(prefix="branchbox-server-test-"))
    data_dir.chmod(0o755)
    yield Engine(EngineConfig(data_dir=data_dir, storage="copy"))
    shutil.rmtree(data_dir)


def client_for(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://branchbox")


@pytest.fixture(scope="module")
async def client(engine: Engine, anyio_backend: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(engine)
    async with app.router.lifespan_context(app), client_for(app) as http:  # starts the engine
        yield http
    assert not engine.live, "stopping the app must close every sandbox"


@pytest.fixture(scope="module")
async def sandbox(client: httpx.AsyncClient) -> AsyncIterator[str]:
    reply = await client.post("/v1/sandboxes", json={})
    assert reply.status_code == 201, reply.text
    yield reply.json()["id"]
    await client.delete(f"/v1/sandboxes/{reply.json()['id']}")


def assert_error(reply: httpx.Response, status: int, kind: str) -> str:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert set(body) == {"error", "type"} and body["type"] == kind, body
    assert body["error"]
    return body["error"]


async def ndjson(client: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
    reply = await client.post(path, json=body)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "application/x-ndjson"
    return [json.loads(line) for line in reply.text.splitlines()]


def output(lines: list[dict], kind: str = "stdout") -> str:
    return "".join(line["data"] for line in lines if line["type"] == kind)


# ----------------------------------------------------------------------------- lifecycle


async def test_healthz(client: httpx.AsyncClient) -> None:
    reply = await client.get("/v1/healthz")
    assert reply.status_code == 200
    assert reply.text == "ok"
    assert reply.headers["content-type"].startswith("text/plain")


async def test_create_info_list_close(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/sandboxes", json={"template": "default", "ram_mib": 512,
                                                      "timeout_seconds": 600, "egress": True})
    assert reply.status_code == 201, reply.text
    info = reply.json()
    sid = info["id"]
    assert sid.startswith("sbx_") and len(sid) == 36
    assert info["state"] == "ready" and info["parent_id"] is None
    assert (await client.get(f"/v1/sandboxes/{sid}")).json()["id"] == sid
    listed = (await client.get("/v1/sandboxes")).json()["sandboxes"]
    assert sid in [entry["id"] for entry in listed]
    reply = await client.delete(f"/v1/sandboxes/{sid}")
    assert reply.status_code == 204 and reply.content == b""
    assert_error(await client.get(f"/v1/sandboxes/{sid}"), 404, "SandboxNotFound")
    assert_error(await client.delete(f"/v1/sandboxes/{sid}"), 404, "SandboxNotFound")


async def test_the_list_says_what_each_info_says(client: httpx.AsyncClient) -> None:
    """A list is read in one go (resource use off the event loop, children in one pass):
    each row is what the sandbox's own info says."""
    parent = (await client.post("/v1/sandboxes", json={})).json()["id"]
    kids: list[str] = []
    try:
        kids = (await client.post(f"/v1/sandboxes/{parent}/fork", json={"n": 2})).json()[
            "children"]
        listed = {row["id"]: row for row in (await client.get("/v1/sandboxes")).json()[
            "sandboxes"]}
        for sid in (parent, *kids):
            info = (await client.get(f"/v1/sandboxes/{sid}")).json()
            row = listed[sid]
            assert {k: v for k, v in row.items() if k != "resources"} == \
                {k: v for k, v in info.items() if k != "resources"}
            assert set(row["resources"]) == set(info["resources"]) >= {
                "memory_bytes", "pids", "cpu_seconds", "host_pids", "repl_anon_huge_bytes"}
            assert row["resources"]["memory_bytes"] > 0 and row["resources"]["host_pids"]
        assert sorted(listed[parent]["children"]) == sorted(kids)
        assert all(listed[kid]["parent_id"] == parent for kid in kids)
    finally:
        for sid in (*kids, parent):
            await client.delete(f"/v1/sandboxes/{sid}")


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "", None),
    ("DELETE", "", None),
    ("POST", "/run_code", {"code": "1"}),
    ("POST", "/commands", {"cmd": "true"}),
    ("POST", "/commands/1/wait", {}),
    ("POST", "/fork", {"n": 1}),
    ("POST", "/diff", {"other": MISSING}),
    ("POST", f"/merge_into/{MISSING}", None),
    ("GET", "/files?path=/etc/hostname", None),
    ("GET", "/files/list?path=/", None),
    ("POST", "/exec", {"code": "1"}),
    ("GET", "/replay", None),
])
async def test_unknown_sandbox_is_404(client: httpx.AsyncClient, method: str, path: str,
                                      body: dict | None) -> None:
    reply = await client.request(method, f"/v1/sandboxes/{MISSING}{path}", json=body)
    assert assert_error(reply, 404, "SandboxNotFound") == "sandbox not found"


async def test_unknown_endpoint_is_json(client: httpx.AsyncClient) -> None:
    """Our error, and E2B's ``code`` and ``message`` beside it: E2B's SDKs call routes of
    theirs this server does not serve and read those."""
    for reply, status, kind in ((await client.get("/v1/nothing"), 404, "EndpointNotFound"),
                                (await client.put("/v1/healthz"), 405, "MethodNotAllowed")):
        body = reply.json()
        assert (body.pop("code"), body.pop("message")) == (status, body["error"])
        assert_error(httpx.Response(status, json=body), status, kind)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("content", "expect"), [
    (b"{not json", "invalid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"", "must be a JSON object"),
])
async def test_malformed_body_is_400(client: httpx.AsyncClient, sandbox: str, content: bytes,
                                     expect: str) -> None:
    reply = await client.post(f"/v1/sandboxes/{sandbox}/run_code", content=content,
                              headers={"content-type": "application/json"})
    assert expect in assert_error(reply, 400, "InvalidRequest")


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/run_code", {}, "code"),
    ("/exec", {"language": "bash"}, "code"),
    ("/exec", {"code": "ls", "language": "ruby"}, "language"),
    ("/diff", {}, "other"),
    ("/run_code", {"code": 5}, "code"),
    ("/run_code", {"code": "1", "timeout": "soon"}, "timeout"),
    ("/run_code", {"code": "1", "timeout": -1}, "timeout"),
    ("/run_code", {"code": "1", "unknown": True}, "unknown"),
    ("/commands", {"cmd": []}, "cmd"),
    ("/commands", {"cmd": ["ls", 1]}, "cmd"),
    ("/commands", {"cmd": "ls", "env": {"A": 1}}, "env.A"),
    ("/commands", {"cmd": "ls", "background": "yes"}, "background"),
    ("/diff", {"other": MISSING, "paths": ["relative"]}, "paths.0"),
])
async def test_wrong_types_are_400(client: httpx.AsyncClient, sandbox: str, path: str,
                                   body: dict, field: str) -> None:
    reply = await client.post(f"/v1/sandboxes/{sandbox}{path}", json=body)
    assert assert_error(reply, 400, "InvalidRequest").startswith(field)


async def test_create_rejects_bad_options(client: httpx.AsyncClient) -> None:
    for body in ({"memory_mb": "lots"}, {"image": 3}, {"cwd": "relative"}, {"color": "red"}):
        assert_error(await client.post("/v1/sandboxes", json=body), 400, "InvalidRequest")
    message = assert_error(await client.post("/v1/sandboxes", json={"image": "no-such-image"}),
                           400, "InvalidRequest")
    assert "no-such-image" in message


@pytest.mark.parametrize("n", [0, 33, -1, "5", 10**20, True, 2.5, None])
async def test_fork_n_out_of_range_or_not_an_int(client: httpx.AsyncClient, sandbox: str,
                                                 n: object) -> None:
    message = assert_error(await client.post(f"/v1/sandboxes/{sandbox}/fork", json={"n": n}),
                           400, "InvalidRequest")
    assert message.startswith("n")
    if isinstance(n, int) and not isinstance(n, bool):
        assert message == "n must be between 1 and 32"


@pytest.mark.parametrize("path", ["etc/hostname", "/etc/../etc/hostname", "/etc/host\0name",
                                  "", "/.."])
@pytest.mark.parametrize(("method", "suffix"), [
    ("GET", ""), ("PUT", ""), ("DELETE", ""), ("GET", "/list"), ("GET", "/stat"),
    ("GET", "/exists"),
])
async def test_bad_paths_are_400(client: httpx.AsyncClient, sandbox: str, path: str,
                                 method: str, suffix: str) -> None:
    reply = await client.request(method, f"/v1/sandboxes/{sandbox}/files{suffix}",
                                 params={"path": path}, content=b"x" if method == "PUT" else None)
    assert "path" in assert_error(reply, 400, "InvalidRequest")


async def test_directories_are_not_files(client: httpx.AsyncClient, sandbox: str) -> None:
    files = f"/v1/sandboxes/{sandbox}/files"
    assert_error(await client.get(files, params={"path": "/root"}), 400, "InvalidRequest")
    assert_error(await client.put(files, params={"path": "/root"}, content=b"x"), 400,
                 "InvalidRequest")
    assert (await client.get(f"{files}/exists", params={"path": "/root"})).json() == {
        "exists": True}


async def test_merge_only_into_an_ancestor(client: httpx.AsyncClient, sandbox: str) -> None:
    merge = f"/v1/sandboxes/{sandbox}/merge_into"
    assert "itself" in assert_error(await client.post(f"{merge}/{sandbox}"), 400,
                                    "InvalidRequest")
    other = (await client.post("/v1/sandboxes", json={})).json()["id"]
    try:
        message = assert_error(await client.post(f"{merge}/{other}"), 400, "InvalidRequest")
        assert "not a descendant" in message
    finally:
        await client.delete(f"/v1/sandboxes/{other}")


async def test_json_bodies_have_a_size_limit(client: httpx.AsyncClient, sandbox: str) -> None:
    big = b'{"code": "' + b"x" * (64 << 20) + b'"}'
    reply = await client.post(f"/v1/sandboxes/{sandbox}/run_code", content=big,
                              headers={"content-type": "application/json"})
    assert "PUT /v1/sandboxes/{id}/files" in assert_error(reply, 413, "PayloadTooLarge")


# ------------------------------------------------------------------------------ run_code


async def test_run_code_streams_in_order(client: httpx.AsyncClient, sandbox: str) -> None:
    code = ("import sys, time\nprint('one', flush=True)\nprint('two', file=sys.stderr, "
            "flush=True)\nprint('three', flush=True)\n6 * 7")
    lines = await ndjson(client, f"/v1/sandboxes/{sandbox}/run_code", {"code": code})
    assert [(line["type"], line.get("data")) for line in lines[:-1]] == [
        ("stdout", "one\n"), ("stderr", "two\n"), ("stdout", "three\n")]
    final = lines[-1]
    assert final["type"] == "result"
    assert final["text"] == "42" and final["error"] is None
    assert final["results"]["text/plain"] == "42"


async def test_run_code_keeps_state_and_reports_errors(client: httpx.AsyncClient,
                                                       sandbox: str) -> None:
    path = f"/v1/sandboxes/{sandbox}/run_code"
    await ndjson(client, path, {"code": "kept = 'value'"})
    assert (await ndjson(client, path, {"code": "kept"}))[-1]["text"] == "'value'"
    error = (await ndjson(client, path, {"code": "1 / 0"}))[-1]["error"]
    assert error["name"] == "ZeroDivisionError" and "division" in error["value"]
    assert "ZeroDivisionError" in error["traceback"]


async def test_run_code_timeout_keeps_state(client: httpx.AsyncClient, sandbox: str) -> None:
    path = f"/v1/sandboxes/{sandbox}/run_code"
    final = (await ndjson(client, path, {"code": "before = 1\nimport time\ntime.sleep(60)",
                                         "timeout": 1}))[-1]
    assert final["type"] == "result" and final["timed_out"] is True
    assert (await ndjson(client, path, {"code": "before + 1"}))[-1]["text"] == "2"


# ------------------------------------------------------------------------------ commands


async def test_command_streams_and_exits(client: httpx.AsyncClient, sandbox: str) -> None:
    path = f"/v1/sandboxes/{sandbox}/commands"
    lines = await ndjson(client, path, {"cmd": ["echo", "hello"]})
    assert output(lines) == "hello\n"
    assert lines[-1]["type"] == "exit" and lines[-1]["exit_code"] == 0
    lines = await ndjson(client, path, {"cmd": "echo oops >&2; exit 3", "cwd": "/tmp",
                                        "env": {"X": "1"}})
    assert output(lines, "stderr") == "oops\n" and lines[-1]["exit_code"] == 3
    lines = await ndjson(client, path, {"cmd": "no-such-program"})
    assert lines[-1]["command_not_found"] is True


async def test_command_errors_before_output_are_http_errors(client: httpx.AsyncClient,
                                                            sandbox: str) -> None:
    path = f"/v1/sandboxes/{sandbox}/commands"
    assert_error(await client.post(path, json={"cmd": ["no-such-program"]}), 400,
                 "CommandNotFound")
    assert_error(await client.post(path, json={"cmd": "true", "cwd": "/no/such/dir"}), 400,
                 "InvalidRequest")


async def test_failure_after_output_ends_the_stream_with_an_error_line(
        client: httpx.AsyncClient, sandbox: str) -> None:
    path = f"/v1/sandboxes/{sandbox}/commands"
    lines = await ndjson(client, path, {"cmd": "echo started; sleep 60", "timeout": 1})
    assert output(lines) == "started\n"
    assert lines[-1] == {"type": "error", "error": lines[-1]["error"], "kind": "SandboxTimeout",
                         "status": 408}
    # Before any output, the same failure is an ordinary HTTP error.
    assert_error(await client.post(path, json={"cmd": "sleep 60", "timeout": 1}), 408,
                 "SandboxTimeout")


async def test_unexpected_failures_are_500_with_the_cause(engine: Engine) -> None:
    app = create_app(engine)

    async def broken() -> None:
        raise RuntimeError("boom")

    app.add_api_route("/v1/broken", broken)
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://branchbox") as http:
        message = assert_error(await http.get("/v1/broken"), 500, "SandboxError")
    assert message == "internal error: RuntimeError: boom"


async def test_background_command_wait_and_kill(client: httpx.AsyncClient, sandbox: str) -> None:
    base = f"/v1/sandboxes/{sandbox}/commands"
    pid = (await client.post(base, json={"cmd": "echo done", "background": True})).json()["pid"]
    waited = (await client.post(f"{base}/{pid}/wait", json={"timeout": 30})).json()
    assert waited["exit_code"] == 0 and waited["stdout"] == "done\n"
    pid = (await client.post(base, json={"cmd": ["sleep", "600"], "background": True})).json()[
        "pid"]
    assert_error(await client.post(f"{base}/{pid}/wait", json={"timeout": 0.5}), 408,
                 "SandboxTimeout")
    assert (await client.post(f"{base}/{pid}/kill")).status_code == 204
    waited = (await client.post(f"{base}/{pid}/wait")).json()
    assert waited["exit_code"] != 0


async def test_podflare_exec(client: httpx.AsyncClient, sandbox: str) -> None:
    path = f"/v1/sandboxes/{sandbox}/exec"
    lines = await ndjson(client, path, {"code": "echo hi; echo; printf end", "language": "bash"})
    seqs = [line["seq"] for line in lines]  # rising per sandbox, across runs (for replay)
    assert seqs == list(range(seqs[0], seqs[0] + len(lines)))
    assert [(line["type"], line["data"]) for line in lines] == [
        ("stdout", "hi"), ("stdout", ""), ("stdout", "end"), ("exit", 0)]  # a line each
    lines = await ndjson(client, path, {"code": "print(1)\n1/0"})
    assert output(lines) == "1" and "ZeroDivisionError" in output(lines, "stderr")
    assert lines[-1]["type"] == "exit" and lines[-1]["data"] == 1
    replayed = (await client.get(f"/v1/sandboxes/{sandbox}/replay")).text.splitlines()
    assert [json.loads(line) for line in replayed[-len(lines):]] == lines


# --------------------------------------------------------------------------------- files


async def test_large_file_roundtrip(client: httpx.AsyncClient, sandbox: str) -> None:
    data = os.urandom(6 * 1024 * 1024 + 123)

    async def chunks() -> AsyncIterator[bytes]:  # a chunked upload, no Content-Length
        for start in range(0, len(data), 1 << 20):
            yield data[start:start + (1 << 20)]

    path = "/root/big/blob.bin"  # parent directories are created
    reply = await client.put(f"/v1/sandboxes/{sandbox}/files", params={"path": path},
                             content=chunks())
    assert reply.status_code == 200, reply.text
    assert reply.json()["size"] == len(data)
    # (ASGITransport buffers responses; the SDK tests check that a download streams.)
    download = await client.get(f"/v1/sandboxes/{sandbox}/files", params={"path": path})
    assert download.status_code == 200
    assert download.headers["content-type"] == "application/octet-stream"
    assert download.content == data


async def test_list_stat_exists_remove(client: httpx.AsyncClient, sandbox: str) -> None:
    files = f"/v1/sandboxes/{sandbox}/files"
    for name in ("a.txt", "sub/b.txt"):
        reply = await client.put(files, params={"path": f"/root/tree/{name}", "mode": "640"},
                                 content=b"text")
        assert reply.status_code == 200, reply.text
    entries = (await client.get(f"{files}/list", params={"path": "/root/tree"})).json()["entries"]
    assert sorted(entry["name"] for entry in entries) == ["a.txt", "sub"]
    stat = (await client.get(f"{files}/stat", params={"path": "/root/tree/a.txt"})).json()
    assert stat["type"] == "file" and stat["size"] == 4 and stat["mode"] == 0o640
    assert (await client.get(f"{files}/exists", params={"path": "/root/tree"})).json() == {
        "exists": True}
    assert_error(await client.get(f"{files}/stat", params={"path": "/root/none"}), 404,
                 "FileNotFound")
    assert_error(await client.get(files, params={"path": "/root/none"}), 404, "FileNotFound")
    assert_error(await client.delete(files, params={"path": "/root/tree"}), 400,
                 "InvalidRequest")
    reply = await client.delete(files, params={"path": "/root/tree", "recursive": "true"})
    assert reply.status_code == 204
    assert (await client.get(f"{files}/exists", params={"path": "/root/tree"})).json() == {
        "exists": False}


async def test_upload_limit(engine: Engine, sandbox: str) -> None:
    async with client_for(create_app(engine, max_upload=1000)) as small:
        path = f"/v1/sandboxes/{sandbox}/files"
        reply = await small.put(path, params={"path": "/root/limited"}, content=b"x" * 1001)
        assert "1000 bytes" in assert_error(reply, 413, "PayloadTooLarge")

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length to refuse up front
            for _ in range(3):
                yield b"x" * 600

        reply = await small.put(path, params={"path": "/root/limited"}, content=chunked())
        assert_error(reply, 413, "PayloadTooLarge")
        assert (await small.put(path, params={"path": "/root/limited"},
                                content=b"x" * 1000)).status_code == 200


async def test_api_keys(engine: Engine, sandbox: str) -> None:
    async with client_for(create_app(engine, api_keys=["s3cret"])) as guarded:
        assert (await guarded.get("/v1/healthz")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            reply = await guarded.get(f"/v1/sandboxes/{sandbox}", headers=headers)
            assert assert_error(reply, 401, "AuthError") == "invalid api key"
        reply = await guarded.get(f"/v1/sandboxes/{sandbox}",
                                  headers={"Authorization": "Bearer s3cret"})
        assert reply.status_code == 200


# ----------------------------------------------------------------- fork, diff, merge_into


async def test_fork_diff_merge(client: httpx.AsyncClient) -> None:
    parent = (await client.post("/v1/sandboxes", json={})).json()["id"]
    run = f"/v1/sandboxes/{parent}/run_code"
    await ndjson(client, run, {"code": "value = 'parent'"})
    reply = await client.post(f"/v1/sandboxes/{parent}/fork", json={"n": 2})
    assert reply.status_code == 200, reply.text
    children = reply.json()["children"]
    assert len(children) == 2
    for child in children:
        info = (await client.get(f"/v1/sandboxes/{child}")).json()
        assert info["parent_id"] == parent
        lines = await ndjson(client, f"/v1/sandboxes/{child}/run_code", {"code": "value"})
        assert lines[-1]["text"] == "'parent'"
    winner, loser = children
    await ndjson(client, f"/v1/sandboxes/{winner}/run_code",
                 {"code": "value = 'winner'\nopen('/root/won.txt', 'w').write('yes')"})
    changes = (await client.post(f"/v1/sandboxes/{parent}/diff", json={"other": winner})).json()
    assert "/root/won.txt" in changes["added"] and changes["removed"] == []
    reply = await client.post(f"/v1/sandboxes/{parent}/merge_into/{winner}")
    assert reply.status_code == 204, reply.text
    assert_error(await client.get(f"/v1/sandboxes/{winner}"), 404, "SandboxNotFound")
    assert (await ndjson(client, run, {"code": "value"}))[-1]["text"] == "'winner'"
    assert_error(await client.post(f"/v1/sandboxes/{parent}/merge_into/{loser}"), 409,
                 "StaleBranchError")
    for sid in (loser, parent):
        assert (await client.delete(f"/v1/sandboxes/{sid}")).status_code == 204


async def test_fork_of_a_busy_sandbox_is_409_after_the_bounded_wait(
        client: httpx.AsyncClient, engine: Engine, sandbox: str) -> None:
    """API.md's 409 for "busy": a fork waits for the REPL's running call, then gives up."""
    engine.config.busy_wait = 0.3
    try:
        running = asyncio.ensure_future(
            client.post(f"/v1/sandboxes/{sandbox}/run_code",
                        json={"code": "import time; time.sleep(1.5)"}))
        await asyncio.sleep(0.3)  # the run holds the REPL now
        reply = await client.post(f"/v1/sandboxes/{sandbox}/fork", json={"n": 1})
        assert "busy" in assert_error(reply, 409, "Conflict")
        assert (await running).status_code == 200
    finally:
        engine.config.busy_wait = 30.0
