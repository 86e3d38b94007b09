"""The MCP server's cost over the SDK: the same calls made as MCP tool calls over stdio
(``branchbox mcp`` as a subprocess, driven by the ``mcp`` SDK's client) beside the SDK's
own, against the same daemon, so what an MCP client pays on top shows as a ratio."""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable

import anyio
from mcp import Client, StdioServerParameters

from branchbox.bench.measure import Context, Ratio, Row, close_all, timed

TITLE = "MCP tool calls over stdio against the SDK"


async def _timed(call: Callable[[], Awaitable[object]], reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await call()
        samples.append(1000 * (time.perf_counter() - t0))
    return samples


async def _through_mcp(url: str, reps: int, forks: int) -> dict[str, list[float]]:
    server = StdioServerParameters(command=sys.executable,
                                   args=["-m", "branchbox", "mcp", "--url", url])
    t0 = time.perf_counter()
    async with Client(server) as client:
        await client.list_tools()
        started = [1000 * (time.perf_counter() - t0)]

        async def tool(name: str, **arguments: object) -> dict:
            result = await client.call_tool(name, arguments)
            if result.is_error:
                raise RuntimeError(f"{name} failed: {result.content}")
            return result.structured_content

        sandbox_id = (await tool("create_sandbox"))["sandbox_id"]
        await tool("run_code", sandbox_id=sandbox_id, code="1+1")
        children: list[str] = []

        async def fork() -> None:
            children.extend((await tool("fork", sandbox_id=sandbox_id, n=3))["children"])

        samples = {
            "start": started,
            "run_code": await _timed(lambda: tool("run_code", sandbox_id=sandbox_id,
                                                  code="1+1"), reps),
            "exec": await _timed(lambda: tool("exec", sandbox_id=sandbox_id, command="true"),
                                 reps),
            "fork": await _timed(fork, forks),
        }
    return samples  # the session's end closed its sandboxes


def run(ctx: Context) -> list[Row]:
    reps, forks = ctx.pick(10, 100), ctx.pick(3, 10)
    ctx.step("the SDK's calls")
    with ctx.sandbox() as sb:
        sb.run_code("1+1")
        sdk_run = timed(lambda: sb.run_code("1+1"), reps)
        sdk_exec = timed(lambda: sb.exec("true"), reps)
        sdk_fork = timed(lambda: sb.fork(3), forks, after=close_all)
    ctx.step("the same calls through branchbox mcp")
    mcp = anyio.run(_through_mcp, ctx.url, reps, forks)
    return [
        Row("SDK run_code 1+1", sdk_run),
        Row("MCP run_code 1+1", mcp["run_code"], ratios=[Ratio("SDK run_code 1+1")]),
        Row("SDK exec true", sdk_exec),
        Row("MCP exec true", mcp["exec"], ratios=[Ratio("SDK exec true")]),
        Row("SDK fork(3)", sdk_fork),
        Row("MCP fork(3)", mcp["fork"], ratios=[Ratio("SDK fork(3)")],
            note="children closed at the session's end"),
        Row("MCP server start + list_tools", mcp["start"], note="a python process and imports"),
    ]
