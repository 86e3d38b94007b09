"""``branchbox mcp``, driven by the ``mcp`` SDK's own client: over stdio (the client starts
the server as a subprocess) and over streamable HTTP (a ``branchbox mcp --http`` process
behind the daemon's keys), both against a real daemon process."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, ImageContent, TextContent
from served import ServedDaemon, wait_started

KEY = "mcp-test-key"
MISSING = "sbx_" + "0" * 32
TOOLS = {"create_sandbox", "run_code", "exec", "read_file", "write_file", "list_files", "fork",
         "diff", "merge_into", "commit", "checkpoint", "restore", "close"}
CHART = """
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
plt.plot([1, 2, 3], [1, 4, 9])
plt.title("squares")
"""

Scenario = Callable[[Client], Awaitable[Any]]


@pytest.fixture(scope="module")
def daemon() -> Iterator[ServedDaemon]:
    server = ServedDaemon("mcp", {**os.environ, "BRANCHBOX_API_KEY": KEY})
    try:
        yield server
    finally:
        server.stop()


def server_env(daemon: ServedDaemon) -> dict[str, str]:
    return {**os.environ, "BRANCHBOX_URL": daemon.url, "BRANCHBOX_API_KEY": KEY}


def live(daemon: ServedDaemon) -> set[str]:
    with daemon.client(KEY) as rest:
        reply = rest.get("/v1/sandboxes")
    reply.raise_for_status()
    return {sandbox["id"] for sandbox in reply.json()["sandboxes"]}


class McpHttp:
    """``branchbox mcp --http 127.0.0.1:PORT`` as a process, using ``daemon`` (``env`` and
    ``extra`` arguments replace the daemon's URL and key)."""

    def __init__(self, daemon: ServedDaemon, env: dict[str, str] | None = None,
                 *extra: str) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.log = daemon.data_dir / f"mcp-{self.port}.log"  # removed with the daemon's
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "branchbox", "mcp", "--http", f"127.0.0.1:{self.port}",
                 *extra], env=server_env(daemon) if env is None else env,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        wait_started(self.proc, self._listening, self.stop, "branchbox mcp --http", self.log)

    def _listening(self) -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", self.port)) == 0

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    @asynccontextmanager
    async def client(self, key: str = KEY, mode: str = "auto") -> AsyncIterator[Client]:
        """A connected client; its HTTP client (ours to close) carries ``key``."""
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"},
                                      timeout=httpx2.Timeout(30, read=300)) as http, \
                Client(streamable_http_client(self.url, http_client=http), mode=mode) as client:
            yield client

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                pytest.fail(f"branchbox mcp --http ignored SIGTERM:\n{self.output()}")
        return self.proc.returncode


@pytest.fixture(scope="module")
def mcp_http(daemon: ServedDaemon) -> Iterator[McpHttp]:
    server = McpHttp(daemon)
    try:
        yield server
    finally:
        server.stop()


def stdio_client(daemon: ServedDaemon) -> Client:
    return Client(StdioServerParameters(command=sys.executable, args=["-m", "branchbox", "mcp"],
                                        env=server_env(daemon)))


def run(connect: AbstractAsyncContextManager[Client], scenario: Scenario) -> Any:
    """``scenario`` with a connected client; the session ends when it returns."""
    async def main() -> Any:
        async with connect as client:
            return await scenario(client)

    return anyio.run(main)


async def call(client: Client, tool: str, **arguments: Any) -> CallToolResult:
    """A tool call that must succeed."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, f"{tool} failed: {text(result)}"
    return result


def text(result: CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, TextContent))


def facts(result: CallToolResult) -> dict[str, Any]:
    assert isinstance(result.structured_content, dict), result
    return result.structured_content


@pytest.fixture
def ws() -> Iterator[Path]:
    """A host directory to branch; not pytest's tmp_path, whose parents are 0700: the
    sandbox's root must traverse it."""
    path = Path(tempfile.mkdtemp(prefix="branchbox-test-mcp-ws-"))
    path.chmod(0o755)
    (path / "base.txt").write_text("base\n")
    try:
        yield path
    finally:
        shutil.rmtree(path)


async def fork_diff_merge_commit(client: Client, ws: Path) -> dict[str, Any]:
    """The whole round an agent makes; returns what the test checks afterwards."""
    listed = await client.list_tools()
    tools = {tool.name: tool for tool in listed.tools}
    assert set(tools) == TOOLS
    for tool in tools.values():
        assert tool.description and tool.input_schema["type"] == "object"
    assert "n" in tools["fork"].input_schema["properties"]

    created = facts(await call(client, "create_sandbox", workspace=str(ws)))
    parent = created["sandbox_id"]
    ran = await call(client, "run_code", sandbox_id=parent, code="x = 41\nx + 1")
    assert facts(ran)["text"] == "42" and "42" in text(ran)
    failed = await call(client, "run_code", sandbox_id=parent, code="1 / 0")
    assert facts(failed)["error"]["name"] == "ZeroDivisionError"
    assert "ZeroDivisionError" in text(failed)

    chart = await call(client, "run_code", sandbox_id=parent, code=CHART)
    images = [block for block in chart.content if isinstance(block, ImageContent)]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    assert base64.b64decode(images[0].data).startswith(b"\x89PNG\r\n\x1a\n")

    children = facts(await call(client, "fork", sandbox_id=parent, n=3))["children"]
    assert len(children) == 3 and len(set(children)) == 3 and parent not in children
    a, b, c = children
    await call(client, "write_file", sandbox_id=a, path="/root/a.txt", content="a\n")
    await call(client, "write_file", sandbox_id=a, path=f"{ws}/from_a.txt", content="a\n")
    ran_b = await call(client, "exec", sandbox_id=b, command=(
        f"echo b > /root/b.txt && echo b > {ws}/from_b.txt && rm {ws}/base.txt && echo done"))
    assert facts(ran_b)["exit_code"] == 0 and facts(ran_b)["stdout"] == "done\n"
    ran_c = await call(client, "run_code", sandbox_id=c, code="x * 2")
    assert facts(ran_c)["text"] == "82"  # the REPL's memory came along

    changes = facts(await call(client, "diff", sandbox_id=a, other_id=b))
    assert (changes["added"], changes["removed"]) == (
        ["/root/b.txt", f"{ws}/from_b.txt"], ["/root/a.txt", f"{ws}/base.txt", f"{ws}/from_a.txt"])

    await call(client, "merge_into", sandbox_id=parent, winner_id=b)
    listing = facts(await call(client, "list_files", sandbox_id=parent, path=str(ws)))
    assert {entry["name"] for entry in listing["entries"]} == {"from_b.txt"}
    read = await call(client, "read_file", sandbox_id=parent, path=f"{ws}/from_b.txt")
    assert facts(read)["content"] == "b\n"
    assert (ws / "base.txt").exists() and not (ws / "from_b.txt").exists()
    await call(client, "commit", sandbox_id=parent)

    saved = facts(await call(client, "checkpoint", sandbox_id=parent, name="before y"))
    await call(client, "run_code", sandbox_id=parent, code="y = 'after'")
    await call(client, "restore", sandbox_id=parent, checkpoint_id=saved["checkpoint_id"])
    back = await call(client, "run_code", sandbox_id=parent, code="'y' in globals(), x")
    assert facts(back)["text"] == "(False, 41)"
    return {"parent": parent, "children": children}


def check_round(daemon: ServedDaemon, ws: Path, made: dict[str, Any]) -> None:
    assert sorted(p.name for p in ws.iterdir()) == ["from_b.txt"]  # the commit landed
    assert (ws / "from_b.txt").read_text() == "b\n"
    still = live(daemon) & {made["parent"], *made["children"]}
    assert not still, f"the session ended but its sandboxes live on: {still}"


def test_stdio_round_and_session_end(daemon: ServedDaemon, ws: Path) -> None:
    made = run(stdio_client(daemon), lambda client: fork_diff_merge_commit(client, ws))
    check_round(daemon, ws, made)


def test_http_legacy_session_round_and_end(daemon: ServedDaemon, mcp_http: McpHttp,
                                           ws: Path) -> None:
    """The handshake-era protocol has sessions: ending one (DELETE) closes its sandboxes."""
    made = run(mcp_http.client(mode="legacy"),
               lambda client: fork_diff_merge_commit(client, ws))
    check_round(daemon, ws, made)


async def bad_calls(client: Client) -> list[str]:
    """Each bad call is a tool error saying what is wrong; the server answers the next call."""
    messages = []
    for tool, arguments in [
        ("fork", {"sandbox_id": MISSING, "n": 0}),
        ("fork", {"sandbox_id": MISSING, "n": "three"}),
        ("run_code", {"sandbox_id": "not-an-id", "code": "1"}),
        ("run_code", {"sandbox_id": MISSING}),
        ("run_code", {"sandbox_id": MISSING, "code": "1", "colour": "red"}),
        ("run_code", {"sandbox_id": MISSING, "code": "1"}),
        ("write_file", {"sandbox_id": MISSING, "path": "/root/x", "content": "%%",
                        "encoding": "base64"}),
        ("read_file", {"sandbox_id": MISSING, "path": "relative/path"}),
        ("no_such_tool", {}),
    ]:
        result = await client.call_tool(tool, arguments)
        assert result.is_error, (tool, arguments, result)
        messages.append(text(result))
    created = facts(await call(client, "create_sandbox"))["sandbox_id"]
    missing = await client.call_tool("read_file", {"sandbox_id": created, "path": "/nope"})
    assert missing.is_error
    messages.append(text(missing))
    timed_out = await client.call_tool("run_code", {"sandbox_id": created, "timeout": 1,
                                                    "code": "print('started', flush=True)\n"
                                                            "import time; time.sleep(30)"})
    assert timed_out.is_error
    messages.append(text(timed_out))
    assert facts(await call(client, "run_code", sandbox_id=created, code="6 * 7"))["text"] == "42"
    await call(client, "close", sandbox_id=created)
    closed_again = await call(client, "close", sandbox_id=created)
    assert facts(closed_again)["was_already_gone"] is True
    return messages


def check_bad_calls(messages: list[str]) -> None:
    n_range, n_type, bad_id, no_code, extra, missing, bad_b64, rel, tool, no_file, slow = messages
    assert "n" in n_range and "greater than or equal to 1" in n_range
    assert "n" in n_type and "integer" in n_type
    assert "sandbox_id" in bad_id and "pattern" in bad_id
    assert "code" in no_code and "required" in no_code.lower()
    assert "colour" in extra
    assert missing.startswith("SandboxNotFound:")
    assert "base64" in bad_b64
    assert "path" in rel
    assert "no_such_tool" in tool and "create_sandbox" in tool
    assert no_file.startswith("FileNotFound:")
    assert slow.startswith("SandboxTimeout:") and "started" in slow


def test_bad_arguments_are_tool_errors_over_stdio(daemon: ServedDaemon) -> None:
    check_bad_calls(run(stdio_client(daemon), bad_calls))


def test_bad_arguments_are_tool_errors_over_http(mcp_http: McpHttp) -> None:
    check_bad_calls(run(mcp_http.client(), bad_calls))


def test_keep_survives_the_session(daemon: ServedDaemon) -> None:
    async def scenario(client: Client) -> tuple[str, str, list[str]]:
        kept = facts(await call(client, "create_sandbox", keep=True))["sandbox_id"]
        kept_children = facts(await call(client, "fork", sandbox_id=kept, n=2))["children"]
        dropped = facts(await call(client, "create_sandbox"))["sandbox_id"]
        return kept, dropped, kept_children

    kept, dropped, kept_children = run(stdio_client(daemon), scenario)
    try:
        sandboxes = live(daemon)
        assert dropped not in sandboxes
        assert {kept, *kept_children} <= sandboxes  # fork children follow the parent's keep
    finally:
        with daemon.client(KEY) as rest:
            for sandbox_id in (kept, *kept_children):
                rest.delete(f"/v1/sandboxes/{sandbox_id}")


def test_http_without_session_closes_at_server_stop(daemon: ServedDaemon) -> None:
    """The 2026-07-28 protocol has no session: its sandboxes end with the server."""
    server = McpHttp(daemon)
    try:
        made = run(server.client(), lambda client: call(client, "create_sandbox"))
        sandbox_id = facts(made)["sandbox_id"]
        assert sandbox_id in live(daemon)  # between requests the sandbox stays
    finally:
        code = server.stop()
    assert code == 0
    assert sandbox_id not in live(daemon)


def test_http_wrong_or_missing_key_is_refused(mcp_http: McpHttp) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        reply = httpx.post(mcp_http.url, json=body, headers=headers, timeout=30)
        assert reply.status_code == 401
        assert reply.json() == {"error": "invalid api key", "type": "AuthError"}

    async def listing(client: Client) -> None:
        await client.list_tools()

    with pytest.raises(ExceptionGroup) as refused:
        run(mcp_http.client(key="wrong"), listing)
    assert refused.group_contains(MCPError)
    run(mcp_http.client(), listing)  # the right key still works


def test_http_without_configured_keys_wants_the_generated_one(daemon: ServedDaemon) -> None:
    """As for a TCP daemon: no key configured means the one kept in the data directory."""
    data_dir = daemon.data_dir / "mcp-data"
    env = {k: v for k, v in os.environ.items() if k not in ("BRANCHBOX_API_KEY", "BRANCHBOX_URL")}
    server = McpHttp(daemon, env, "--data-dir", str(data_dir))
    try:
        key = (data_dir / "api-key").read_text().strip()
        assert key.startswith("bb_") and (data_dir / "api-key").stat().st_mode & 0o077 == 0
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
        assert httpx.post(server.url, json=body, timeout=30).status_code == 401

        async def listing(client: Client) -> set[str]:
            return {tool.name for tool in (await client.list_tools()).tools}

        assert run(server.client(key=key), listing) == TOOLS
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("address", ["8788", "localhost", "host:port", ":8788", "h:99999"])
def test_http_address_must_be_host_and_port(address: str) -> None:
    done = subprocess.run([sys.executable, "-m", "branchbox", "mcp", "--http", address],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 1
    assert "HOST:PORT" in done.stderr and "Traceback" not in done.stderr
