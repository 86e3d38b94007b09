"""``Sandbox``: the blocking face of ``AsyncSandbox``.

Every method runs the async core's coroutine on the process's portal loop and
waits for it; the only code here converts what crosses the face (async
sandboxes, handles and iterators into their blocking counterparts). Callbacks
(``on_stdout``...) run on the portal's thread.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import httpx

from branchbox.sdk._async import AsyncCommandHandle, AsyncSandbox
from branchbox.sdk._checkpoints import AsyncCheckpoint
from branchbox.sdk._files import AsyncFiles
from branchbox.sdk._portal import blocking, portal
from branchbox.sdk._results import CommandResult, OutputCallback


class Sandbox:
    """A Linux sandbox with a persistent Python REPL, which can be forked.

    ``with Sandbox() as sb:`` creates it and closes it at the end;
    ``Sandbox.connect(id)`` attaches to one that exists.
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
        """Create the sandbox (starting the local daemon if needed); see ``AsyncSandbox``."""
        core = AsyncSandbox(image, workspace=workspace, env=env, cwd=cwd, timeout=timeout,
                            internet=internet, network=network,
                            egress=egress, memory_mb=memory_mb, disk_mb=disk_mb,
                            snapshot=snapshot, url=url,
                            api_key=api_key,
                            transport=transport)
        self._bind(portal.run(core.start()))

    def _bind(self, core: AsyncSandbox) -> None:
        self._core = core
        self.files = Files(core.files)

    @classmethod
    def _wrap(cls, core: AsyncSandbox) -> Sandbox:
        sandbox = cls.__new__(cls)
        sandbox._bind(core)
        return sandbox

    @classmethod
    def connect(cls, sandbox_id: str, *, url: str | None = None, api_key: str | None = None,
                transport: httpx.AsyncBaseTransport | None = None) -> Sandbox:
        """Attach to an existing sandbox (closing this object closes that sandbox)."""
        return cls._wrap(portal.run(AsyncSandbox.connect(sandbox_id, url=url, api_key=api_key,
                                                         transport=transport)))

    @staticmethod
    def list_all(*, url: str | None = None, api_key: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> builtins.list[dict]:
        """The info of every live sandbox on the server."""
        return portal.run(AsyncSandbox.list_all(url=url, api_key=api_key, transport=transport))

    @property
    def id(self) -> str:
        return self._core.id

    @property
    def parent_id(self) -> str | None:
        return self._core.parent_id

    @property
    def ip(self) -> str | None:
        return self._core.ip

    def get_host(self, port: int) -> str:
        return self._core.get_host(port)

    update_network = blocking(AsyncSandbox.update_network)
    run_code = blocking(AsyncSandbox.run_code)
    commit = blocking(AsyncSandbox.commit)
    save_image = blocking(AsyncSandbox.save_image)

    @staticmethod
    def build_image(name: str, spec: str, context: str | Path | None = None, *,
                    internet: bool | None = None, on_event: Callable[[dict], None] | None = None,
                    url: str | None = None, api_key: str | None = None,
                    transport: httpx.AsyncBaseTransport | None = None) -> dict:
        """See ``AsyncSandbox.build_image``."""
        return portal.run(AsyncSandbox.build_image(
            name, spec, context, internet=internet, on_event=on_event, url=url,
            api_key=api_key, transport=transport))

    @staticmethod
    def list_images(*, url: str | None = None, api_key: str | None = None,
                    transport: httpx.AsyncBaseTransport | None = None) -> builtins.list[dict]:
        """Every image on the server (built-in and saved), with the sandboxes using it."""
        return portal.run(AsyncSandbox.list_images(url=url, api_key=api_key,
                                                   transport=transport))

    @staticmethod
    def remove_image(name: str, *, url: str | None = None, api_key: str | None = None,
                     transport: httpx.AsyncBaseTransport | None = None) -> None:
        """Delete saved image ``name`` (``Conflict`` while a sandbox or image uses it)."""
        portal.run(AsyncSandbox.remove_image(name, url=url, api_key=api_key,
                                             transport=transport))

    snapshot = blocking(AsyncSandbox.snapshot)

    @staticmethod
    def list_snapshots(*, url: str | None = None, api_key: str | None = None,
                       transport: httpx.AsyncBaseTransport | None = None) -> builtins.list[dict]:
        """Every snapshot on the server, oldest first."""
        return portal.run(AsyncSandbox.list_snapshots(url=url, api_key=api_key,
                                                      transport=transport))

    @staticmethod
    def delete_snapshot(name: str, *, url: str | None = None, api_key: str | None = None,
                        transport: httpx.AsyncBaseTransport | None = None) -> None:
        """End snapshot ``name`` (the sandboxes started from it go on)."""
        portal.run(AsyncSandbox.delete_snapshot(name, url=url, api_key=api_key,
                                                transport=transport))

    info = blocking(AsyncSandbox.info)
    close = blocking(AsyncSandbox.close)
    detach = blocking(AsyncSandbox.detach)

    def exec(self, cmd: str | builtins.list[str], *, cwd: str | None = None,
             env: dict[str, str] | None = None, timeout: float | None = None,
             on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
             background: bool = False) -> CommandResult | CommandHandle:
        """See ``AsyncSandbox.exec``; the background handle's methods block."""
        result = portal.run(self._core.exec(cmd, cwd=cwd, env=env, timeout=timeout,
                                            on_stdout=on_stdout, on_stderr=on_stderr,
                                            background=background))
        return CommandHandle(result) if isinstance(result, AsyncCommandHandle) else result

    def fork(self, n: int = 1) -> builtins.list[Sandbox]:
        """``n`` copies of this sandbox as it is now: memory, files, env, cwd."""
        return [Sandbox._wrap(child) for child in portal.run(self._core.fork(n))]

    def start(self) -> Sandbox:
        """See ``AsyncSandbox.start``: a stopped sandbox gets a fresh REPL on its files."""
        portal.run(self._core.start())
        return self

    pause = blocking(AsyncSandbox.pause)
    resume = blocking(AsyncSandbox.resume)

    def checkpoint(self, name: str | None = None) -> Checkpoint:
        """See ``AsyncSandbox.checkpoint``."""
        return Checkpoint(portal.run(self._core.checkpoint(name)))

    def checkpoints(self) -> builtins.list[Checkpoint]:
        """The sandbox's checkpoints, oldest first."""
        return [Checkpoint(cp) for cp in portal.run(self._core.checkpoints())]

    def restore(self, checkpoint: Checkpoint | str) -> None:
        """See ``AsyncSandbox.restore``."""
        target = checkpoint._core if isinstance(checkpoint, Checkpoint) else checkpoint
        portal.run(self._core.restore(target))

    def merge_into(self, winner: Sandbox) -> None:
        """Make this sandbox's id drive ``winner``'s state; ``winner`` is used up."""
        portal.run(self._core.merge_into(winner._core))

    def diff(self, other: Sandbox | str,
             paths: builtins.list[str] | None = None) -> dict[str, builtins.list[str]]:
        """``{"added", "removed", "modified"}``: paths as they differ in ``other``."""
        target = other._core if isinstance(other, Sandbox) else other
        return portal.run(self._core.diff(target, paths))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Sandbox {self._core._id} {self._core._state}>"


class Files:
    """``sandbox.files``; see ``AsyncFiles``."""

    def __init__(self, core: AsyncFiles) -> None:
        self._core = core

    read = blocking(AsyncFiles.read)
    write = blocking(AsyncFiles.write)
    list = blocking(AsyncFiles.list)
    exists = blocking(AsyncFiles.exists)
    stat = blocking(AsyncFiles.stat)
    remove = blocking(AsyncFiles.remove)

    def read_stream(self, path: str) -> Iterator[bytes]:
        """The file's contents in chunks, as they arrive."""
        return portal.iterate(self._core.read_stream(path))


class Checkpoint:
    """A frozen instant of a sandbox; see ``AsyncCheckpoint``."""

    def __init__(self, core: AsyncCheckpoint) -> None:
        self._core = core

    @property
    def id(self) -> str:
        return self._core.id

    @property
    def name(self) -> str | None:
        return self._core.name

    @property
    def created(self) -> float | None:
        return self._core.created

    @property
    def resources(self) -> dict:
        return self._core.resources

    def fork(self, n: int = 1) -> builtins.list[Sandbox]:
        """``n`` new sandboxes as the sandbox was at this instant (children of it)."""
        return [Sandbox._wrap(child) for child in portal.run(self._core.fork(n))]

    delete = blocking(AsyncCheckpoint.delete)

    def __repr__(self) -> str:
        return repr(self._core).replace("AsyncCheckpoint", "Checkpoint", 1)


class CommandHandle:
    """A command running in the background."""

    def __init__(self, core: AsyncCommandHandle) -> None:
        self._core = core

    @property
    def pid(self) -> int:
        return self._core.pid

    wait = blocking(AsyncCommandHandle.wait)
    kill = blocking(AsyncCommandHandle.kill)

    def __repr__(self) -> str:
        return f"<CommandHandle pid={self.pid} in {self._core.sandbox._id}>"
