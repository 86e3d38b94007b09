"""``branchbox mcp``: the MCP server, on the official ``mcp`` SDK's low-level ``Server``.

It is a client of a branchbox daemon (through the project's SDK: ``--url``,
``$BRANCHBOX_URL``, else the local daemon, started if none runs), so it adds no
second engine: each tool is one translation onto ``AsyncSandbox``.

Which sandboxes a session holds, and when they are closed:

- stdio: the session is the stream; the server's lifespan is entered once per
  stream, so its ``Holdings`` end when the client closes the pipe.
- streamable HTTP with a session (``Mcp-Session-Id``, the handshake-era
  protocol): each session gets its own ``Holdings``, ended on the connection's
  exit stack (client DELETE, idle timeout, server stop).
- streamable HTTP without one (the 2026-07-28 protocol is one request per
  exchange, with no session at all): the calls share the server's ``Holdings``,
  ended when ``branchbox mcp --http`` stops.

Every failure is a tool result with ``isError`` and the typed message (SDK
exception name, message and hint); nothing a client sends ends the server.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version
from typing import Any

import anyio
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp_types import (
    CallToolRequestParams,
    CallToolResult,
    ListToolsResult,
    PaginatedRequestParams,
    TextContent,
    Tool,
)
from pydantic import ValidationError

from branchbox.mcp_server.calls import CALLS, ToolFailure, partial_output
from branchbox.mcp_server.holdings import Holdings
from branchbox.mcp_server.tools import BY_NAME, TOOLS
from branchbox.sdk import SandboxError

log = logging.getLogger(__name__)

INSTRUCTIONS = (
    "branchbox gives you Linux sandboxes with a persistent Python REPL that fork in "
    "milliseconds. Create a sandbox, set up state with run_code/exec, fork it to try "
    "several approaches in parallel, diff the children, merge_into the best one, commit a "
    "workspace to write the result to the host, and close what you no longer need. "
    "Sandboxes you create are closed when this session ends unless you pass keep=true.")

Context = ServerRequestContext[Holdings]


def build(url: str | None = None, api_key: str | None = None) -> Server[Holdings]:
    """The server; ``url``/``api_key`` name the daemon (None: the SDK's defaults)."""

    @asynccontextmanager
    async def lifespan(_server: Server[Holdings]) -> AsyncIterator[Holdings]:
        holdings = Holdings(url, api_key)
        try:
            yield holdings
        finally:
            with anyio.CancelScope(shield=True):  # also when the server is being cancelled
                await holdings.end()

    async def list_tools(_ctx: Context, _params: PaginatedRequestParams | None
                         ) -> ListToolsResult:
        return ListToolsResult(tools=[
            Tool(name=tool.name, description=tool.description, input_schema=tool.input_schema())
            for tool in TOOLS])

    async def call_tool(ctx: Context, params: CallToolRequestParams) -> CallToolResult:
        tool = BY_NAME.get(params.name)
        if tool is None:
            return failure(f"unknown tool {params.name!r}; the tools are: "
                           f"{', '.join(BY_NAME)}")
        try:
            args = tool.arguments.model_validate(params.arguments or {})
        except ValidationError as exc:
            return failure(f"invalid arguments for {tool.name}: {brief(exc)}")
        try:
            return await CALLS[tool.name](await session_holdings(ctx), args)
        except ToolFailure as exc:
            return failure(str(exc))
        except SandboxError as exc:  # typed: its name, the server's message and a hint
            output = partial_output(getattr(exc, "result", None))
            return failure(f"{type(exc).__name__}: {exc}" + (f"\n{output}" if output else ""))
        except Exception as exc:  # a bug of ours: logged, and still only this call fails
            log.exception("tool %s failed", tool.name)
            return failure(f"internal error in {tool.name}: {type(exc).__name__}: {exc}")

    return Server("branchbox", version=version("branchbox"), instructions=INSTRUCTIONS,
                  lifespan=lifespan, on_list_tools=list_tools, on_call_tool=call_tool)


async def session_holdings(ctx: Context) -> Holdings:
    """The ``Holdings`` of the caller's session (see the module docstring)."""
    # mcp 2.3 hands handlers the request context, whose per-connection state (and its exit
    # stack, the SDK's hook for connection teardown) sits on the session's connection; the
    # SDK's newer Context exposes it publicly, but its runner does not build one yet.
    connection = ctx.session._connection  # noqa: SLF001
    if connection.session_id is None:
        return ctx.lifespan_context
    holdings = connection.state.get("branchbox")
    if holdings is None:
        shared = ctx.lifespan_context
        holdings = connection.state["branchbox"] = Holdings(shared.url, shared.api_key)
        connection.exit_stack.push_async_callback(holdings.end)
    return holdings


def failure(message: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(text=message)], is_error=True)


def brief(exc: ValidationError) -> str:
    """Pydantic's errors as one line per field, without its documentation links."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}"
                     for e in exc.errors(include_url=False))


async def serve_stdio(server: Server[Any]) -> None:
    """Serve one client over stdin/stdout until it closes the stream, or until SIGTERM or
    SIGINT (a client that gives up waiting signals the process group); either way the
    session's sandboxes are closed first."""
    async with anyio.create_task_group() as group:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    group.cancel_scope.cancel()

        group.start_soon(stop_on_signal)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
        group.cancel_scope.cancel()
