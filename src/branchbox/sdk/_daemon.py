"""Starting the local daemon when the SDK finds none, so ``Sandbox()`` just works.

The daemon is started as ``python -m branchbox serve --data-dir DIR`` in its
own session (a Ctrl-C in the caller's terminal does not reach it, and it
outlives the caller), logging to ``DIR/daemon.log``. Only the default local
daemon is ever started: a server named by URL is someone else's to run.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import httpx

from branchbox.sdk._errors import SandboxError
from branchbox.server.address import socket_path

START_TIMEOUT = 60.0
_POLL_INTERVAL = 0.2


async def healthy(client: httpx.AsyncClient) -> bool:
    try:
        reply = await client.get("/v1/healthz", timeout=5.0)
    except httpx.TransportError:
        return False
    return reply.status_code == 200


async def ensure_daemon(client: httpx.AsyncClient, data_dir: Path) -> None:
    """Return once the daemon of ``data_dir`` answers, starting it first if needed."""
    if await healthy(client):
        return
    sock = socket_path(data_dir)
    if os.geteuid() != 0:
        raise SandboxError(f"no branchbox daemon answers on {sock}, and branchbox needs root "
                           "to start one", hint="run as root (sandboxes need namespaces, "
                           "cgroups and mounts), or set BRANCHBOX_URL to a running daemon")
    pid, log = _spawn(data_dir)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        await asyncio.sleep(_POLL_INTERVAL)
        if await healthy(client):
            return
        exited, status = os.waitpid(pid, os.WNOHANG)
        # A daemon that exits may have lost a race with another starter: look once more.
        if exited and not await healthy(client):
            raise SandboxError(f"the branchbox daemon exited while starting (status "
                               f"{os.waitstatus_to_exitcode(status)})", hint=f"see {log}")
    raise SandboxError(f"the branchbox daemon did not answer within {START_TIMEOUT:.0f} s",
                       hint=f"see {log}")


def _spawn(data_dir: Path) -> tuple[int, Path]:
    """Start the daemon detached; posix_spawn, so no Popen object warns when it outlives us."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "daemon.log"
    argv = [sys.executable, "-m", "branchbox", "serve", "--data-dir", str(data_dir)]
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    return os.posix_spawn(sys.executable, argv, os.environ, file_actions=actions,
                          setsid=True), log
