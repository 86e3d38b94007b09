"""What each tool does: one SDK call (or two) on the session's sandboxes, and its result.

A result has two faces: ``content`` for the model (readable text, and images as
MCP image content) and ``structured_content`` for programs (the same facts as
JSON). A failure is raised (``SandboxError`` from the SDK, ``ToolFailure`` from
here); ``server.py`` turns it into an MCP tool error.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

from mcp_types import CallToolResult, ContentBlock, ImageContent, TextContent

from branchbox.mcp_server import tools
from branchbox.mcp_server.holdings import Holdings
from branchbox.sdk import CommandResult, Execution, SandboxNotFound

# Images an MCP client can show, by their first bytes.
_IMAGE_MAGIC = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg",
                b"GIF87a": "image/gif", b"GIF89a": "image/gif"}
_IMAGE_TYPES = frozenset(_IMAGE_MAGIC.values())


class ToolFailure(Exception):
    """A call this layer refuses before it reaches the daemon; the message says why."""


def result(facts: dict[str, Any], text: str | None = None,
           images: list[ImageContent] | None = None) -> CallToolResult:
    content: list[ContentBlock] = [TextContent(text=text if text is not None else
                                               json.dumps(facts, indent=1))]
    return CallToolResult(content=[*content, *(images or [])], structured_content=facts)


def transcript(sections: list[tuple[str, str | None]]) -> str:
    """Labelled blocks of output, the empty ones left out: what a person reads in a terminal."""
    shown = [f"[{label}]\n{body.rstrip()}" for label, body in sections if body]
    return "\n".join(shown) or "(no output)"


def execution_facts(run: Execution) -> dict[str, Any]:
    return {
        "stdout": run.stdout, "stderr": run.stderr, "text": run.text,
        "error": None if run.error is None else {
            "name": run.error.name, "value": run.error.value, "traceback": run.error.traceback},
        # Images travel as image content, not twice as base64 text.
        "results": {mime: data for mime, data in run.results.items()
                    if mime not in _IMAGE_TYPES},
        "duration": run.duration, "truncated": run.truncated, "warnings": run.warnings,
    }


def execution_images(run: Execution) -> list[ImageContent]:
    """Every figure and image result once (the REPL repeats the first figure in results)."""
    found = [(mime, data) for figure in run.figures for mime, data in figure.items()]
    found += [(mime, data) for mime, data in run.results.items() if mime in _IMAGE_TYPES]
    unique = dict.fromkeys((mime, data) for mime, data in found if isinstance(data, str))
    return [ImageContent(data=data, mime_type=mime) for mime, data in unique]


def command_facts(run: CommandResult) -> dict[str, Any]:
    return {"stdout": run.stdout, "stderr": run.stderr, "exit_code": run.exit_code,
            "duration": run.duration, "truncated": run.truncated}


def partial_output(run: object) -> str:
    """What a timed-out or failed run printed before it stopped, for the error message."""
    if isinstance(run, Execution | CommandResult):
        return transcript([("stdout", run.stdout), ("stderr", run.stderr)])
    return ""


async def create_sandbox(held: Holdings, args: tools.CreateSandbox) -> CallToolResult:
    sandbox = await held.create(keep=args.keep, image=args.image, workspace=args.workspace,
                                internet=args.internet)
    return result({"sandbox_id": sandbox.id, "address": sandbox.ip, "keep": args.keep})


async def run_code(held: Holdings, args: tools.RunCode) -> CallToolResult:
    run = await (await held.get(args.sandbox_id)).run_code(args.code, timeout=args.timeout)
    error = None if run.error is None else (run.error.traceback or
                                            f"{run.error.name}: {run.error.value}")
    text = transcript([("stdout", run.stdout), ("stderr", run.stderr), ("error", error),
                       ("value", run.text), *(("warning", w) for w in run.warnings)])
    return result(execution_facts(run), text, execution_images(run))


async def exec_command(held: Holdings, args: tools.Exec) -> CallToolResult:
    run = await (await held.get(args.sandbox_id)).exec(args.command, cwd=args.cwd, env=args.env,
                                                       timeout=args.timeout)
    assert isinstance(run, CommandResult)  # not background
    text = transcript([("stdout", run.stdout), ("stderr", run.stderr),
                       ("exit code", str(run.exit_code))])
    return result(command_facts(run), text)


async def read_file(held: Holdings, args: tools.ReadFile) -> CallToolResult:
    sandbox = await held.get(args.sandbox_id)
    data = bytearray()
    async with aclosing(sandbox.files.read_stream(args.path)) as chunks:
        async for chunk in chunks:
            data += chunk
            if len(data) > args.max_bytes:
                break  # the rest is never fetched
    truncated = len(data) > args.max_bytes
    data = data[:args.max_bytes]
    facts: dict[str, Any] = {"path": args.path, "bytes": len(data), "truncated": truncated}
    mime = next((m for magic, m in _IMAGE_MAGIC.items() if data.startswith(magic)), None)
    if mime is not None and not truncated:
        return result({**facts, "mime_type": mime}, f"{args.path}: {mime}, {len(data)} bytes",
                      [ImageContent(data=base64.b64encode(data).decode(), mime_type=mime)])
    try:  # incremental: a character cut in two by max_bytes is dropped, not an error
        text = codecs.getincrementaldecoder("utf-8")().decode(bytes(data), final=not truncated)
    except UnicodeDecodeError:
        encoded = base64.b64encode(data).decode()
        return result({**facts, "encoding": "base64", "content": encoded})
    note = f"\n[truncated at {args.max_bytes} bytes]" if truncated else ""
    return result({**facts, "encoding": "utf-8", "content": text}, text + note)


async def write_file(held: Holdings, args: tools.WriteFile) -> CallToolResult:
    if args.encoding == "base64":
        try:
            data = base64.b64decode(args.content, validate=True)
        except binascii.Error as exc:
            raise ToolFailure(f"content is not valid base64 ({exc}); send text with "
                              "encoding 'utf-8' or fix the base64") from exc
    else:
        data = args.content.encode()
    await (await held.get(args.sandbox_id)).files.write(args.path, data)
    return result({"path": args.path, "bytes": len(data)})


async def list_files(held: Holdings, args: tools.ListFiles) -> CallToolResult:
    entries = await (await held.get(args.sandbox_id)).files.list(args.path)
    return result({"path": args.path, "entries": entries})


async def fork(held: Holdings, args: tools.Fork) -> CallToolResult:
    children = await (await held.get(args.sandbox_id)).fork(args.n)
    held.adopt(children, args.sandbox_id, args.keep)
    return result({"parent_id": args.sandbox_id, "children": [c.id for c in children]})


async def diff(held: Holdings, args: tools.Diff) -> CallToolResult:
    changes = await (await held.get(args.sandbox_id)).diff(args.other_id, args.paths)
    return result({"sandbox_id": args.sandbox_id, "other_id": args.other_id, **changes})


async def merge_into(held: Holdings, args: tools.MergeInto) -> CallToolResult:
    if args.winner_id == args.sandbox_id:
        raise ToolFailure("a sandbox cannot merge into itself; winner_id must be one of its "
                          "fork children")
    parent = await held.get(args.sandbox_id)
    await parent.merge_into(await held.get(args.winner_id))
    held.forget(args.winner_id)
    return result({"sandbox_id": args.sandbox_id, "merged": args.winner_id})


async def commit(held: Holdings, args: tools.OnSandbox) -> CallToolResult:
    return result({"sandbox_id": args.sandbox_id,
                   **(await (await held.get(args.sandbox_id)).commit() or {})})


async def checkpoint(held: Holdings, args: tools.Checkpoint) -> CallToolResult:
    saved = await (await held.get(args.sandbox_id)).checkpoint(args.name)
    return result({"sandbox_id": args.sandbox_id, "checkpoint_id": saved.id,
                   "name": saved.name})


async def restore(held: Holdings, args: tools.Restore) -> CallToolResult:
    await (await held.get(args.sandbox_id)).restore(args.checkpoint_id)
    return result({"sandbox_id": args.sandbox_id, "restored": args.checkpoint_id})


async def close(held: Holdings, args: tools.OnSandbox) -> CallToolResult:
    try:
        await (await held.get(args.sandbox_id)).close()
    except SandboxNotFound:
        gone = True
    else:
        gone = False
    held.forget(args.sandbox_id)
    return result({"sandbox_id": args.sandbox_id, "closed": True, "was_already_gone": gone})


Call = Callable[[Holdings, Any], Awaitable[CallToolResult]]
CALLS: dict[str, Call] = {
    "create_sandbox": create_sandbox, "run_code": run_code, "exec": exec_command,
    "read_file": read_file, "write_file": write_file, "list_files": list_files,
    "fork": fork, "diff": diff, "merge_into": merge_into, "commit": commit,
    "checkpoint": checkpoint, "restore": restore, "close": close,
}
