"""Ops the daemon sends when it hands a running REPL a new identity or request.

merge_into gives the winner's body the parent's id (hostname); the warm pool
hands a started sandbox to a create request (its env, cwd and workspace mount).
"""

from __future__ import annotations

import os
import socket
import time

from . import sysc
from .server import RequestError


def handle_sethostname(agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """After merge_into the body answers to the parent's id: take its hostname too."""
    socket.sethostname(req["hostname"])
    os.environ["HOSTNAME"] = req["hostname"]
    agent.done(req["rid"], {})


def handle_configure(agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """A warm sandbox handed out to a create request takes that request's env and cwd
    (a sandbox started from a snapshot, only env: it stays where the snapshot was)."""
    os.environ.update(req.get("env") or {})
    time.tzset()  # TZ is read at time's import: a warm REPL's was the defaults'
    if "cwd" not in req:
        agent.done(req["rid"], {})
        return
    cwd = req["cwd"] or "/root"
    try:
        os.makedirs(cwd, exist_ok=True)
        os.chdir(cwd)
    except (OSError, ValueError) as exc:  # a file on the way, a name too long, a NUL
        shown = cwd if len(cwd) <= 80 else cwd[:77] + "..."
        reason = getattr(exc, "strerror", None) or str(exc)
        raise RequestError("InvalidRequest", f"cwd {shown!r} is not usable as a directory: "
                           f"{reason}") from None
    agent.done(req["rid"], {})


def handle_attach(agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """Attach a detached mount the daemon built (a workspace) at ``path`` in this sandbox."""
    (tree,) = fds
    try:
        os.makedirs(req["path"], exist_ok=True)
        sysc.move_mount_fd(tree, req["path"])
    finally:
        os.close(tree)
    agent.done(req["rid"], {})
