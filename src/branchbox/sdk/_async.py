"""``AsyncSandbox``: the one implementation of the SDK; ``Sandbox`` is its blocking face.

A sandbox object is *new* until ``start()`` (or ``async with``) creates it on
the server, then *open* until ``close()``, ``detach()`` or being merged into
another sandbox; after that every call but ``close()`` fails.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import quote

import httpx

from branchbox.sdk import _build
from branchbox.sdk._checkpoints import AsyncCheckpoint
from branchbox.sdk._deadline import within
from branchbox.sdk._errors import InvalidRequest, SandboxError, SandboxNotFound
from branchbox.sdk._files import AsyncFiles
from branchbox.sdk._http import Api
from branchbox.sdk._results import (
    CommandResult,
    Execution,
    Output,
    OutputCallback,
    collect,
    command_result,
    execution,
)

State = Literal["new", "open", "closed", "detached", "merged"]


class AsyncSandbox:
    """A Linux sandbox with a persistent Python REPL, which can be forked.

    ``async with AsyncSandbox() as sb:`` creates it and closes it at the end;
    ``await AsyncSandbox.connect(id)`` attaches to one that exists.
    """

    def __init__(self, image: str = "default", *, workspace: str | Path | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None,
                 timeout: float | None = None, internet: bool | None = None,
                 network: dict[str, builtins.list[str]] | None = None,
                 egress: bool | None = None,
                 memory_mb: int | None = None, disk_mb: int | None = None,
                 snapshot: str | None = None,
                 url: str | None = None,
                 api_key: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        """Describe the sandbox; nothing happens on the server until ``start()``.

        ``timeout`` is the sandbox's lifetime in seconds (closed by the server after
        it); ``disk_mb`` bounds what its files may take, in MiB (the server's
        default otherwise; fork children inherit it); ``url``/``api_key`` override
        ``$BRANCHBOX_URL``/``$BRANCHBOX_API_KEY``;
        ``internet`` (``egress`` is an alias) turns egress through NAT on or off (None:
        the server's default, off unless ``branchbox serve --internet``); ``network`` is
        ``{"allow_out": [...], "deny_out": [...]}`` of CIDRs or host names (allow wins);
        fork children inherit the policy;
        ``snapshot`` starts it from that snapshot's instant (``snapshot()``): its memory,
        files, image, cwd and limits, with ``env`` added (only env, timeout and the
        network policy may be given with it);
        ``transport`` is handed to httpx (tests pass ``httpx.ASGITransport(app)``).
        """
        self._spec: dict[str, Any] | None = _given(
            image=image, env=env, cwd=cwd, timeout=timeout,
            internet=internet if internet is not None else egress, network=network,
            memory_mb=memory_mb,
            disk_mb=disk_mb, snapshot=snapshot,
            workspace=None if workspace is None else str(Path(workspace).absolute()))
        self._bind(Api(url, api_key, transport), None, None, "new")

    def _bind(self, api: Api, sandbox_id: str | None, parent_id: str | None,
              state: State) -> None:
        self._api = api
        self._id = sandbox_id
        self.parent_id = parent_id
        self._state: State = state
        self._ip: str | None = None
        self.files = AsyncFiles(self)

    @classmethod
    def _attached(cls, api: Api, sandbox_id: str, parent_id: str | None) -> AsyncSandbox:
        sandbox = cls.__new__(cls)
        sandbox._spec = None
        sandbox._bind(api, sandbox_id, parent_id, "open")
        return sandbox

    @classmethod
    async def connect(cls, sandbox_id: str, *, url: str | None = None,
                      api_key: str | None = None,
                      transport: httpx.AsyncBaseTransport | None = None) -> AsyncSandbox:
        """Attach to an existing sandbox (closing this object closes that sandbox)."""
        api = Api(url, api_key, transport)
        try:
            await api.ready()
            info = await api.call("GET", f"/v1/sandboxes/{sandbox_id}")
        except BaseException:
            await api.release()
            raise
        sandbox = cls._attached(api, info["id"], info.get("parent_id"))
        sandbox._ip = info.get("address")
        return sandbox

    @classmethod
    async def list_all(cls, *, url: str | None = None, api_key: str | None = None,
                       transport: httpx.AsyncBaseTransport | None = None) -> builtins.list[dict]:
        """The info of every live sandbox on the server."""
        return (await _server_call(url, api_key, transport, "GET", "/v1/sandboxes"))[
            "sandboxes"]

    async def start(self) -> AsyncSandbox:
        """Create the sandbox on the server (``async with`` does this); for one attached
        with ``connect`` that is ``stopped`` (its processes gone with a host or daemon
        restart, its files kept), a fresh REPL on its files. Returns self."""
        if self._state == "open":
            info = await self._api.call("POST", self._url("/start"))
            self._ip = info.get("address")
        elif self._state == "new":
            assert self._spec is not None
            try:
                await self._api.ready()
                info = await self._api.call("POST", "/v1/sandboxes", json=self._spec)
            except BaseException:
                self._state = "closed"
                await self._api.release()
                raise
            self._id, self._state = info["id"], "open"
            self._ip = info.get("address")
        return self

    @property
    def id(self) -> str:
        """``sbx_`` + 32 hex digits."""
        if self._id is None:
            raise SandboxError("this sandbox has not been started",
                               hint="use `async with AsyncSandbox() as sb` or `await sb.start()`")
        return self._id

    def _url(self, suffix: str = "") -> str:
        if self._state != "open":
            raise SandboxError(f"sandbox {self._id} is {self._state}",
                               hint="create or connect to a sandbox to use it")
        return f"/v1/sandboxes/{self.id}{suffix}"

    async def run_code(self, code: str, *, timeout: float | None = None,
                       on_stdout: OutputCallback | None = None,
                       on_stderr: OutputCallback | None = None) -> Execution:
        """Run Python in the sandbox's REPL, whose variables persist between calls.

        An exception in the code is reported in ``.error``, not raised. Past ``timeout``
        seconds the code is interrupted (the REPL keeps its state) and ``SandboxTimeout``
        is raised. Code that ignores the interrupt (C code, a caught KeyboardInterrupt) is
        killed with its REPL a few seconds later: ``SandboxTimeout`` says so, and the
        sandbox is dead (``ReplGone``) from then on. Without an answer within ``timeout``
        + 5 s the SDK gives up by itself (``SandboxTimeout``).
        """
        body = _given(code=code, timeout=timeout)
        self._url()  # this sandbox must be open
        out = await within(timeout, collect(self._api.run("run_code", self.id, body), on_stdout,
                                            on_stderr), "run_code")
        return execution(out, timeout)

    async def exec(self, cmd: str | builtins.list[str], *, cwd: str | None = None,
                   env: dict[str, str] | None = None, timeout: float | None = None,
                   on_stdout: OutputCallback | None = None,
                   on_stderr: OutputCallback | None = None,
                   background: bool = False) -> CommandResult | AsyncCommandHandle:
        """Run a command: a string for the shell, or a list of arguments.

        Returns its ``CommandResult`` (a non-zero exit code is not an error), or with
        ``background=True`` at once a handle to ``wait()`` for or ``kill()`` it. Raises
        ``CommandNotFound`` if the program does not exist in the sandbox.
        """
        body = _given(cmd=cmd, cwd=cwd, env=env, timeout=timeout)
        if background:
            reply = await self._api.call("POST", self._url("/commands"),
                                         json={**body, "background": True})
            return AsyncCommandHandle(self, reply.get("pid"))
        self._url()
        out = await within(timeout, collect(self._api.run("commands", self.id, body), on_stdout,
                                            on_stderr), "exec")
        return command_result(out, timeout)

    async def fork(self, n: int = 1) -> builtins.list[AsyncSandbox]:
        """``n`` copies of this sandbox as it is now: memory, files, env, cwd."""
        body = {"n": n}
        return self._children(await self._api.answer("fork", self.id, body,
                                                     self._url("/fork"), body))

    def _children(self, reply: dict) -> builtins.list[AsyncSandbox]:
        """The new children a fork answered with (``children``, ``addresses``)."""
        children = [AsyncSandbox._attached(self._api.retain(), child, self.id)
                    for child in reply["children"]]
        for child in children:
            child._ip = (reply.get("addresses") or {}).get(child.id)
        return children

    async def pause(self) -> dict:
        """Freeze everything in the sandbox (no CPU; its timeout stops counting) until
        ``resume()``; calls that need its REPL meanwhile raise ``Conflict``. Returns its
        info (``state``: ``paused``)."""
        return await self._api.call("POST", self._url("/pause"))

    async def resume(self) -> dict:
        """Thaw a paused sandbox (a no-op for a running one). Returns its info."""
        return await self._api.call("POST", self._url("/resume"))

    async def checkpoint(self, name: str | None = None) -> AsyncCheckpoint:
        """Keep this instant (REPL memory, files, env, cwd), frozen, for ``restore`` and
        ``fork``; it shares memory and files with the sandbox copy-on-write."""
        body = _given(name=name)
        info = await self._api.answer("checkpoint", self.id, body, self._url("/checkpoints"),
                                      body)
        return AsyncCheckpoint(self, info)

    async def checkpoints(self) -> builtins.list[AsyncCheckpoint]:
        """The sandbox's checkpoints, oldest first."""
        reply = await self._api.call("GET", self._url("/checkpoints"))
        return [AsyncCheckpoint(self, info) for info in reply["checkpoints"]]

    async def restore(self, checkpoint: AsyncCheckpoint | str) -> None:
        """Make the sandbox that checkpoint's instant again (same id, same address); the
        checkpoint stays. Branches forked before can no longer be merged into it."""
        cid = checkpoint if isinstance(checkpoint, str) else checkpoint.id
        await self._api.answer("restore", self.id, {"checkpoint": cid},
                               self._url(f"/checkpoints/{cid}/restore"))

    @property
    def ip(self) -> str | None:
        """The sandbox's own address on the daemon's bridge (it keeps it across merges)."""
        return self._ip

    def get_host(self, port: int) -> str:
        """A base URL a client can use to reach ``port`` in the sandbox: the daemon's port
        proxy (``/v1/sandboxes/{id}/ports/{port}``, same auth) when the daemon is
        reached over TCP or in-process; the sandbox's own address when the daemon is
        local over its unix socket (the host reaches sandboxes directly)."""
        if not 1 <= port <= 65535:
            raise SandboxError(f"port must be between 1 and 65535, not {port}")
        if self._api.is_local_socket() and self._ip:
            return f"http://{self._ip}:{port}"
        return f"{self._api.base_url()}/v1/sandboxes/{self.id}/ports/{port}"

    async def update_network(self, *, internet: bool | None = None,
                             allow_out: builtins.list[str] | None = None,
                             deny_out: builtins.list[str] | None = None) -> dict:
        """Change the egress policy now (open connections included); what is not given
        keeps its value. Returns the policy as applied (host names resolved)."""
        return await self._api.call("PATCH", self._url("/network"), json=_given(
            internet=internet, allow_out=allow_out, deny_out=deny_out))

    async def merge_into(self, winner: AsyncSandbox) -> None:
        """Make this sandbox's id drive ``winner``'s state; ``winner`` is used up."""
        await self._api.answer("merge_into", self.id, {"winner": winner.id},
                               self._url(f"/merge_into/{winner.id}"))
        await winner._let_go("merged")

    async def diff(self, other: AsyncSandbox | str,
                   paths: builtins.list[str] | None = None) -> dict[str, builtins.list[str]]:
        """``{"added", "removed", "modified"}``: paths as they differ in ``other``."""
        body = _given(other=other if isinstance(other, str) else other.id, paths=paths)
        return await self._api.call("POST", self._url("/diff"), json=body)

    async def commit(self) -> dict:
        """Write the workspace's changes into its host directory (``StaleBranchError`` if a
        sibling committed first)."""
        return await self._api.call("POST", self._url("/commit"))

    async def save_image(self, name: str) -> dict:
        """This sandbox's filesystem as it is now (not its memory) as image ``name``:
        ``AsyncSandbox(image=name)`` starts from it, sharing its layers. Returns the
        image's info; ``Conflict`` if the name is taken."""
        return await self._api.call("POST", self._url("/save_image"), json={"name": name})

    @staticmethod
    async def build_image(name: str, spec: str, context: str | Path | None = None, *,
                          internet: bool | None = None,
                          on_event: Callable[[dict], None] | None = None,
                          url: str | None = None, api_key: str | None = None,
                          transport: httpx.AsyncBaseTransport | None = None) -> dict:
        """Build image ``name`` from ``spec`` (a Dockerfile subset: FROM, RUN, ENV, WORKDIR,
        COPY) with directory ``context`` for COPY; ``on_event`` gets each ``step`` and
        ``output`` line. Returns the image's info; ``ImageBuildFailed`` (with the step's
        output) if a step fails, and then no image exists."""
        body = _build.context_tar(spec, context)
        api = Api(url, api_key, transport)
        try:
            await api.ready()
            return await _build.build(api, name, body, internet, on_event)
        finally:
            await api.release()

    @staticmethod
    async def list_images(*, url: str | None = None, api_key: str | None = None,
                          transport: httpx.AsyncBaseTransport | None = None
                          ) -> builtins.list[dict]:
        """Every image on the server (built-in and saved), with the sandboxes using it."""
        return (await _server_call(url, api_key, transport, "GET", "/v1/images"))["images"]

    @staticmethod
    async def remove_image(name: str, *, url: str | None = None, api_key: str | None = None,
                           transport: httpx.AsyncBaseTransport | None = None) -> None:
        """Delete saved image ``name`` (``Conflict`` while a sandbox or image uses it)."""
        await _server_call(url, api_key, transport, "DELETE", f"/v1/images/{_segment(name)}")

    async def snapshot(self, name: str | None = None) -> dict:
        """This instant of the sandbox (memory, files, env, cwd), kept after the sandbox
        closes as snapshot ``name`` (made up if None; an older one of that name is
        replaced): ``AsyncSandbox(snapshot=name)`` starts from it, in milliseconds.
        Returns the snapshot's info. Snapshots last while the server does."""
        return await self._api.call("POST", self._url("/snapshots"), json=_given(name=name))

    @staticmethod
    async def list_snapshots(*, url: str | None = None, api_key: str | None = None,
                             transport: httpx.AsyncBaseTransport | None = None
                             ) -> builtins.list[dict]:
        """Every snapshot on the server, oldest first."""
        return (await _server_call(url, api_key, transport, "GET", "/v1/snapshots"))[
            "snapshots"]

    @staticmethod
    async def delete_snapshot(name: str, *, url: str | None = None, api_key: str | None = None,
                              transport: httpx.AsyncBaseTransport | None = None) -> None:
        """End snapshot ``name`` (the sandboxes started from it go on)."""
        await _server_call(url, api_key, transport, "DELETE",
                           f"/v1/snapshots/{_segment(name)}")

    async def info(self) -> dict:
        """State, parent, children, created time, address, resource use."""
        return await self._api.call("GET", self._url())

    async def close(self) -> None:
        """Destroy the sandbox. Idempotent; a no-op for one merged into its parent."""
        if self._state == "open":
            with contextlib.suppress(SandboxNotFound):  # expired or closed elsewhere: done
                await self._api.answer("close", self.id, {}, self._url(), method="DELETE",
                                       open_only=True)
        await self._let_go("closed")

    async def detach(self) -> None:
        """Forget this object but leave the sandbox running (``connect`` finds it again)."""
        await self._let_go("detached")

    async def _let_go(self, state: State) -> None:
        if self._state in ("new", "open"):
            self._state = state
            await self._api.release()

    async def __aenter__(self) -> AsyncSandbox:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._id or '(not started)'} {self._state}>"


class AsyncCommandHandle:
    """A command running in the background."""

    def __init__(self, sandbox: AsyncSandbox, pid: int) -> None:
        if type(pid) is not int or pid <= 0:  # it goes into URL paths: never a path itself
            raise SandboxError(f"the server answered a command pid of {pid!r}, not a number")
        self.sandbox = sandbox
        self.pid = pid

    async def wait(self, timeout: float | None = None) -> CommandResult:
        """Its result once it exits (``SandboxTimeout`` if that takes over ``timeout`` s)."""
        reply = await self.sandbox._api.call(
            "POST", self.sandbox._url(f"/commands/{self.pid}/wait"), json=_given(timeout=timeout))
        return command_result(Output(reply.get("stdout", ""), reply.get("stderr", ""), reply),
                              timeout)

    async def kill(self, signal: int = 9) -> None:
        """Send ``signal`` (default SIGKILL) to the command."""
        await self.sandbox._api.call("POST", self.sandbox._url(f"/commands/{self.pid}/kill"),
                                     json={"signal": signal})

    def __repr__(self) -> str:
        return f"<{type(self).__name__} pid={self.pid} in {self.sandbox._id}>"


async def _server_call(url: str | None, api_key: str | None,
                       transport: httpx.AsyncBaseTransport | None, method: str,
                       path: str) -> Any:
    """One call that names no sandbox (a listing, an image's or a snapshot's removal), on
    a connection of its own."""
    api = Api(url, api_key, transport)
    try:
        await api.ready()
        return await api.call(method, path)
    finally:
        await api.release()


def _segment(name: str) -> str:
    """``name`` as one path segment, never another route (httpx resolves dot segments:
    ``../sandboxes/<id>`` would have closed a sandbox)."""
    if name in (".", ".."):
        raise InvalidRequest(f"{name!r} names nothing", hint="images and snapshots are "
                             "named with a-z 0-9 . _ -, starting with a letter or digit")
    return quote(name, safe="")


def _given(**fields: Any) -> dict[str, Any]:
    """A request body of the arguments that were given: None means the server's default."""
    return {name: value for name, value in fields.items() if value is not None}
