"""E2B's in-sandbox daemon (envd) API, served by the daemon for the sandbox a request names:
process and filesystem RPCs (Connect, JSON codec), ``/files`` up- and download, ``/health``.

Requests arrive on the daemon's own listener (``E2B_SANDBOX_URL`` mode), named by
``E2b-Sandbox-Id`` or a ``<port>-<id>.<domain>`` Host (see ``e2b_access``). Each call
is one engine call; the translation, field by field, follows E2B's process and
filesystem protos (camelCase JSON, bytes as base64, 64-bit integers as strings):

- Process.Start is a background ``exec`` (with a stdin pipe, or a PTY, if asked), then a
  ``follow`` of it: start (pid), data (stdout/stderr), end (exit code). The
  process outlives the stream, as in E2B: Connect follows it again by pid,
  SendInput/CloseStdin/SendSignal reach it by pid, List shows the running ones.
- Filesystem calls are the agent's file ops; a relative path is under
  ``/home/user``, E2B's home. Watches are inotify watches the agent keeps
  (CreateWatcher/GetWatcherEvents/RemoveWatcher; WatchDir polls one).

Not served: entries in watch events, selecting a process by tag, client-streamed
input, running as another user (commands run as the sandbox's root).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import signal
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from branchbox.engine import errors
from branchbox.engine.sandboxes import Engine
from branchbox.server import connect_rpc
from branchbox.server.connect_rpc import RpcError
from branchbox.server.deps import EngineDep
from branchbox.server.e2b_access import SandboxId
from branchbox.server.e2b_control import E2B_HOME, E2BSandboxRoute
from branchbox.server.files import _limited, _too_large
from branchbox.server.models import check_sandbox_path
from branchbox.server.sandbox_json import SandboxJSON, dumps
from branchbox.server.streams import bytes_response, opened

router = APIRouter(tags=["e2b sandbox"], include_in_schema=False, route_class=E2BSandboxRoute)

_SIGNALS = {"SIGNAL_SIGKILL": signal.SIGKILL, "SIGNAL_SIGTERM": signal.SIGTERM,
            9: signal.SIGKILL, 15: signal.SIGTERM}
_FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY",
               "symlink": "FILE_TYPE_SYMLINK"}
_MAX_DEPTH = 16
_MAX_LISTED = 100_000  # entries of one recursive listing
_WATCH_POLL = 0.05  # seconds between two collections of a WatchDir's events


def _path(raw: object) -> str:
    """A sandbox path from a request: relative ones are under E2B's home."""
    if not isinstance(raw, str) or not raw:
        raise RpcError("invalid_argument", "path must be a non-empty string")
    path = raw if raw.startswith("/") else f"{E2B_HOME}/{raw}"
    try:
        return check_sandbox_path(path)
    except ValueError as exc:
        raise RpcError("invalid_argument", str(exc)) from None


def _pid(message: dict) -> int:
    selector = message.get("process")
    if not isinstance(selector, dict):
        raise RpcError("invalid_argument", "process must select a process by pid")
    pid = selector.get("pid")
    if "tag" in selector and pid is None:
        raise RpcError("unimplemented", "selecting a process by tag is not supported")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise RpcError("invalid_argument", "process.pid must be a positive integer")
    return pid


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# ------------------------------------------------------------------------- processes
def _size(message: dict) -> dict:
    """A PTY message's size as the agent takes it."""
    size = (message.get("pty") or {}).get("size") or {}
    rows, cols = size.get("rows", 24), size.get("cols", 80)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rows, cols)):
        raise RpcError("invalid_argument", "pty.size rows and cols must be integers")
    return {"rows": rows, "cols": cols}


def _start_args(message: dict) -> dict:
    config = message.get("process")
    if not isinstance(config, dict) or not isinstance(config.get("cmd"), str):
        raise RpcError("invalid_argument", "process.cmd must be a string")
    args = config.get("args") or []
    envs = config.get("envs") or {}
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise RpcError("invalid_argument", "process.args must be a list of strings")
    if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
        raise RpcError("invalid_argument", "process.envs must map strings to strings")
    request: dict = {"cmd": [config["cmd"], *args], "env": envs, "background": True,
                     "stdin": bool(message.get("stdin"))}
    if message.get("pty"):
        request["pty"] = _size(message)
    if config.get("cwd"):
        request["cwd"] = _path(config["cwd"])
    return request


async def _follow(engine: Engine, sandbox_id: str, pid: int, pty: bool | None = None
                  ) -> AsyncIterator[dict]:
    """A background command as E2B's process events: start, data..., end (a PTY command's
    output is ``pty`` data)."""
    if pty is None:
        commands = (await engine.call(sandbox_id, "ps"))["commands"]
        pty = any(c["pid"] == pid and c.get("pty") for c in commands)
    yield {"event": {"start": {"pid": pid}}}
    async for header, _ in engine.stream(sandbox_id, "follow", {"pid": pid}):
        kind = header.get("ev")
        if kind in ("stdout", "stderr"):  # text (the agent decodes UTF-8) as E2B's bytes
            yield {"event": {"data": {"pty" if pty else kind: _b64(header["data"].encode())}}}
        elif kind == "done" and (result := header.get("result") or {}).get("following"):
            code = result.get("exit_code")
            yield {"event": {"end": {"exitCode": code, "exited": True,
                                     "status": f"exit status {code}"}}}


@router.post("/process.Process/Start")
async def process_start(request: Request, sandbox_id: SandboxId, engine: EngineDep
                        ) -> Response:
    async def events(message: dict) -> AsyncIterator[dict]:
        args = _start_args(message)
        started = await engine.call(sandbox_id, "exec", args)
        async for event in _follow(engine, sandbox_id, started["pid"], "pty" in args):
            yield event

    return await connect_rpc.server_stream(request, events)


@router.post("/process.Process/Connect")
async def process_connect(request: Request, sandbox_id: SandboxId, engine: EngineDep
                          ) -> Response:
    return await connect_rpc.server_stream(
        request, lambda message: _follow(engine, sandbox_id, _pid(message)))


def _unary(path: str) -> Callable:
    """Register a unary call at ``path``: ``handler(engine, sandbox_id, message) -> reply``
    (a message, or its JSON)."""

    def register(handler: Callable[[Engine, str, dict], Awaitable[dict | bytes]]
                 ) -> Callable:
        @router.post(path, name=f"e2b{path.replace('/', '_').replace('.', '_')}")
        async def route(request: Request, sandbox_id: SandboxId, engine: EngineDep
                        ) -> Response:
            return await connect_rpc.unary(
                request, lambda message: handler(engine, sandbox_id, message))

        return handler

    return register


@_unary("/process.Process/List")
async def process_list(engine: Engine, sandbox_id: str, _: dict) -> dict:
    processes = []
    for command in (await engine.call(sandbox_id, "ps"))["commands"]:
        argv = command.get("argv")
        if command["running"] and isinstance(argv, list) and argv \
                and all(isinstance(arg, str) for arg in argv):
            processes.append({"pid": command["pid"],
                              "config": {"cmd": argv[0], "args": argv[1:]}})
    return {"processes": processes}


@_unary("/process.Process/SendInput")
async def process_send_input(engine: Engine, sandbox_id: str, message: dict) -> dict:
    given = message.get("input") or {}
    try:
        data = base64.b64decode(given.get("pty") or given.get("stdin") or "", validate=True)
    except ValueError:
        raise RpcError("invalid_argument", "input must be base64") from None
    await engine.call(sandbox_id, "input", {"pid": _pid(message)}, data)
    return {}


@_unary("/process.Process/Update")
async def process_update(engine: Engine, sandbox_id: str, message: dict) -> dict:
    """A PTY's new size."""
    await engine.call(sandbox_id, "resize", {"pid": _pid(message), "pty": _size(message)})
    return {}


@_unary("/process.Process/CloseStdin")
async def process_close_stdin(engine: Engine, sandbox_id: str, message: dict) -> dict:
    await engine.call(sandbox_id, "close_stdin", {"pid": _pid(message)})
    return {}


@_unary("/process.Process/SendSignal")
async def process_send_signal(engine: Engine, sandbox_id: str, message: dict) -> dict:
    signo = _SIGNALS.get(message.get("signal"))  # type: ignore[arg-type]
    if signo is None:
        raise RpcError("invalid_argument", "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM")
    await engine.call(sandbox_id, "kill", {"pid": _pid(message), "signal": int(signo)})
    return {}


# ------------------------------------------------------------------------ filesystem
def _entry(entry: dict) -> dict:
    """Our agent's entry as E2B's EntryInfo. The agent runs in the sandbox: an answer
    that is not an entry is an error, not a crash."""
    try:
        kind = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK}.get(
            entry["type"], 0)
        mode = int(entry["mode"]) & 0o7777
        info = {"name": str(entry["name"]), "path": str(entry["path"]),
                "type": _FILE_TYPES.get(entry["type"], "FILE_TYPE_UNSPECIFIED"),
                "size": str(int(entry["size"])), "mode": mode,
                "permissions": stat.filemode(kind | mode)}
        mtime = float(entry["mtime"])
    except (KeyError, TypeError, ValueError):
        raise RpcError("internal", "the sandbox's agent answered a malformed entry") from None
    with contextlib.suppress(OverflowError, ValueError, OSError):  # a time no clock shows
        info["modifiedTime"] = datetime.fromtimestamp(mtime, UTC).isoformat().replace(
            "+00:00", "Z")
    return info


@_unary("/filesystem.Filesystem/Stat")
async def fs_stat(engine: Engine, sandbox_id: str, message: dict) -> dict:
    return {"entry": _entry(await engine.call(sandbox_id, "stat",
                                              {"path": _path(message.get("path"))}))}


@_unary("/filesystem.Filesystem/ListDir")
async def fs_list(engine: Engine, sandbox_id: str, message: dict) -> bytes:
    """The entries, encoded batch by batch as they come (one answer of 100,000 encoded
    at once would hold the event loop a good part of a second)."""
    depth = message.get("depth") or 1
    if not isinstance(depth, int) or not 1 <= depth <= _MAX_DEPTH:
        raise RpcError("invalid_argument", f"depth must be between 1 and {_MAX_DEPTH}")
    encoded: list[bytes] = []
    listed = 0
    level = [_path(message.get("path"))]
    for _ in range(depth):
        below = []
        for directory in level:
            async with contextlib.aclosing(engine.list_dir(sandbox_id, directory)) as batches:
                async for batch in batches:
                    listed += len(batch)
                    if listed > _MAX_LISTED:
                        raise RpcError("resource_exhausted", f"more than {_MAX_LISTED} "
                                       "entries: list with a smaller depth")
                    if batch:
                        encoded.append(dumps([_entry(entry) for entry in batch])[1:-1])
                    below += [entry["path"] for entry in batch if entry["type"] == "dir"]
        level = below
    return b'{"entries":[' + b",".join(encoded) + b"]}"


@_unary("/filesystem.Filesystem/MakeDir")
async def fs_make_dir(engine: Engine, sandbox_id: str, message: dict) -> dict:
    made = await engine.call(sandbox_id, "mkdir", {"path": _path(message.get("path"))})
    if not made["created"]:
        raise RpcError("already_exists", f"directory exists already: {made['path']}")
    return {"entry": _entry(made)}


@_unary("/filesystem.Filesystem/Move")
async def fs_move(engine: Engine, sandbox_id: str, message: dict) -> dict:
    moved = await engine.call(sandbox_id, "move", {
        "source": _path(message.get("source")),
        "destination": _path(message.get("destination"))})
    return {"entry": _entry(moved)}


@_unary("/filesystem.Filesystem/Remove")
async def fs_remove(engine: Engine, sandbox_id: str, message: dict) -> dict:
    await engine.call(sandbox_id, "remove", {"path": _path(message.get("path")),
                                             "recursive": True})
    return {}


_EVENT_TYPES = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE",
                "remove": "EVENT_TYPE_REMOVE", "rename": "EVENT_TYPE_RENAME",
                "chmod": "EVENT_TYPE_CHMOD"}


def _watch_args(message: dict) -> dict:
    if message.get("includeEntry"):
        raise RpcError("unimplemented", "entries in watch events are not supported")
    return {"path": _path(message.get("path")), "recursive": bool(message.get("recursive"))}


async def _watch_events(engine: Engine, sandbox_id: str, watch_id: str) -> list[dict]:
    """The watch's events as E2B names them. They come from the sandbox's agent, which
    user code can replace: what is not an event of a known type is left out."""
    taken = await engine.call(sandbox_id, "watch_events", {"id": watch_id})
    events = taken.get("events") if isinstance(taken, dict) else None
    if not isinstance(events, list):
        return []
    return [{"name": e["name"], "type": _EVENT_TYPES[e["type"]]} for e in events
            if isinstance(e, dict) and isinstance(e.get("name"), str)
            and isinstance(e.get("type"), str) and e["type"] in _EVENT_TYPES]


@_unary("/filesystem.Filesystem/CreateWatcher")
async def fs_create_watcher(engine: Engine, sandbox_id: str, message: dict) -> dict:
    made = await engine.call(sandbox_id, "watch", _watch_args(message))
    return {"watcherId": made["id"]}


@_unary("/filesystem.Filesystem/GetWatcherEvents")
async def fs_watcher_events(engine: Engine, sandbox_id: str, message: dict) -> dict:
    return {"events": await _watch_events(engine, sandbox_id, _watcher(message))}


@_unary("/filesystem.Filesystem/RemoveWatcher")
async def fs_remove_watcher(engine: Engine, sandbox_id: str, message: dict) -> dict:
    await engine.call(sandbox_id, "unwatch", {"id": _watcher(message)})
    return {}


def _watcher(message: dict) -> str:
    watcher = message.get("watcherId")
    if not isinstance(watcher, str) or not watcher:
        raise RpcError("invalid_argument", "watcherId must be a non-empty string")
    return watcher


@router.post("/filesystem.Filesystem/WatchDir")
async def fs_watch_dir(request: Request, sandbox_id: SandboxId, engine: EngineDep) -> Response:
    """A watch as a stream: start, then its events as they are collected (every
    ``_WATCH_POLL`` s), until the client goes or its deadline passes."""

    async def events(message: dict) -> AsyncIterator[dict]:
        watch_id = (await engine.call(sandbox_id, "watch", _watch_args(message)))["id"]
        try:
            yield {"start": {}}
            while True:
                for event in await _watch_events(engine, sandbox_id, watch_id):
                    yield {"filesystem": event}
                await asyncio.sleep(_WATCH_POLL)
        finally:
            with contextlib.suppress(errors.EngineError):
                await engine.call(sandbox_id, "unwatch", {"id": watch_id})

    return await connect_rpc.server_stream(request, events)


# ----------------------------------------------------------------------- /files, /health
@router.get("/health", status_code=204, response_class=Response)
async def health(sandbox_id: SandboxId, engine: EngineDep) -> None:
    """The sandbox is there and its REPL alive (502 once it is not, as E2B's proxy says)."""
    await engine.call(sandbox_id, "ping")


@router.get("/files")
async def download(sandbox_id: SandboxId, engine: EngineDep,
                   path: Annotated[str, Query(max_length=4096)]) -> Response:
    """The file's bytes, streamed."""
    try:
        events = await opened(engine.stream(sandbox_id, "read", {"path": _path(path)}))
    except (errors.EngineError, RpcError) as exc:
        return E2BSandboxRoute.failure(exc)  # as envd: a status, {"code", "message"}
    return bytes_response(events)


@router.post("/files")
async def upload(request: Request, sandbox_id: SandboxId, engine: EngineDep,
                 path: Annotated[str | None, Query(max_length=4096)] = None) -> Response:
    """E2B's upload: a multipart form of files (each named by its path, or by ``path``),
    or one octet-stream body for ``path``. Answers the written files' entries."""
    limit: int = request.app.state.max_upload
    declared = request.headers.get("content-length", "")
    written = []
    try:
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            async with request.form(max_part_size=limit) as form:
                for _, part in form.multi_items():
                    if isinstance(part, str):
                        continue
                    target = _path(path or part.filename)
                    await engine.write_file(sandbox_id, target, _chunks(part.read))
                    written.append(target)
        else:
            if path is None:
                raise RpcError("invalid_argument", "an octet-stream upload needs ?path=")
            target = _path(path)
            await engine.write_file(sandbox_id, target, _limited(request.stream(), limit))
            written.append(target)
    except (errors.EngineError, RpcError) as exc:
        return E2BSandboxRoute.failure(exc)  # as envd: a status, {"code", "message"}
    return SandboxJSON([{"name": p.rsplit("/", 1)[-1], "type": "file", "path": p}
                         for p in written])


async def _chunks(read: Callable[[int], Awaitable[bytes]]) -> AsyncIterator[bytes]:
    while chunk := await read(1 << 20):
        yield chunk
