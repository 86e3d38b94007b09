"""What runs return (``Execution``, ``CommandResult``), read off the server's NDJSON stream.

A run streams ``{"type": "stdout"|"stderr", "data"}`` lines while it runs and
ends with one line carrying the result (``result`` for code, ``exit`` for a
command), or with an ``error`` line if it failed after it had started.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from branchbox.sdk._errors import (
    CommandNotFound,
    SandboxTimeout,
    error_from_line,
    error_from_reply,
)

OutputCallback = Callable[[str], Any]
"""Called with each piece of output as it arrives; may be a plain function or a coroutine."""


@dataclass(frozen=True)
class ExecutionError:
    """An exception raised by the code, as the REPL reported it."""

    name: str
    value: str
    traceback: str


@dataclass
class Execution:
    """The outcome of ``run_code``."""

    stdout: str = ""
    stderr: str = ""
    text: str | None = None  # repr of the last expression, if there was one
    results: dict[str, Any] = field(default_factory=dict)  # mime type -> data
    figures: list[dict[str, str]] = field(default_factory=list)  # matplotlib, base64 PNG
    error: ExecutionError | None = None
    duration: float = 0.0
    truncated: bool = False  # output over the server's limit was cut
    warnings: list[str] = field(default_factory=list)


@dataclass
class CommandResult:
    """The outcome of a command (``exec``, or ``wait`` on a background one)."""

    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    duration: float = 0.0
    truncated: bool = False


@dataclass
class Output:
    """A finished run as the server sent it: all its output and its final line."""

    stdout: str
    stderr: str
    final: dict


async def collect(lines: AsyncGenerator[dict, None], on_stdout: OutputCallback | None,
                  on_stderr: OutputCallback | None) -> Output:
    """Read a run's stream to its end, passing output to the callbacks as it comes."""
    parts: dict[str, list[str]] = {"stdout": [], "stderr": []}
    callbacks = {"stdout": on_stdout, "stderr": on_stderr}
    final: dict | None = None
    async with aclosing(lines):
        async for line in lines:
            kind = line.get("type")
            if kind in parts:
                data = line.get("data", "")
                parts[kind].append(data)
                callback = callbacks[kind]
                if callback is not None and inspect.isawaitable(reply := callback(data)):
                    await reply
            elif kind == "error":
                raise error_from_line(line)
            elif kind in ("result", "exit"):
                # The last line; reading on to the end of the body (instead of returning
                # here) lets the connection go back to the pool rather than be closed.
                final = line
    if final is None:
        raise error_from_reply(502, "the server's stream ended before the run's result")
    return Output("".join(parts["stdout"]), "".join(parts["stderr"]), final)


def execution(out: Output, timeout: float | None) -> Execution:
    """The run's ``Execution``; raises ``SandboxTimeout`` (carrying it) if it timed out."""
    final = out.final
    error = final.get("error")
    result = Execution(
        stdout=out.stdout, stderr=out.stderr, text=final.get("text"),
        results=final.get("results") or {}, figures=final.get("figures") or [],
        error=ExecutionError(str(error.get("name", "")), str(error.get("value", "")),
                             str(error.get("traceback") or "")) if error else None,
        duration=float(final.get("duration") or 0.0), truncated=bool(final.get("truncated")),
        warnings=list(final.get("warnings") or []))
    if result.truncated:
        result.warnings.append("output was truncated: write large output to a file and "
                               "read it with files.read()")
    if final.get("timed_out"):
        raise _timed_out(f"the code ran longer than its timeout of {timeout} s and was "
                         "interrupted", result)
    return result


def command_result(out: Output, timeout: float | None = None) -> CommandResult:
    """The command's ``CommandResult``; raises ``CommandNotFound`` or ``SandboxTimeout``."""
    final = out.final
    result = CommandResult(
        stdout=out.stdout, stderr=out.stderr, exit_code=final.get("exit_code"),
        duration=float(final.get("duration") or 0.0), truncated=bool(final.get("truncated")))
    if final.get("command_not_found"):
        exc = CommandNotFound(f"command not found (exit status {result.exit_code}): "
                              f"{result.stderr.strip()[-200:]}")
        exc.result = result
        raise exc
    if final.get("timed_out"):
        raise _timed_out(f"the command ran longer than its timeout of {timeout} s and was "
                         "killed", result)
    return result


def _timed_out(message: str, result: Execution | CommandResult) -> SandboxTimeout:
    exc = SandboxTimeout(message)
    exc.result = result
    return exc

