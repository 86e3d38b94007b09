"""Entry point of the in-sandbox agent: ``python3 -m bbagent <fd>``.

``fd`` is this process's end of the control channel, a unix stream socket
whose other end the daemon holds. The process is the sandbox's REPL: user
code runs in it, so its standard descriptors are arranged for that first.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
from collections.abc import Callable

from .checkpointing import handle_checkpoint
from .commands import Commands
from .files import (
    Uploads,
    handle_exists,
    handle_list,
    handle_mkdir,
    handle_move,
    handle_read,
    handle_remove,
    handle_stat,
)
from .forking import (
    handle_drop_listener,
    handle_fork,
    handle_fork_slot,
    hold_fork_hooks,
    spawner_fd,
)
from .handover import handle_attach, handle_configure, handle_sethostname
from .repl import Repl
from .server import Agent, handle_ping
from .watches import Watches


def register_ops(agent: Agent, spawner: Callable[[], int] | None = None) -> None:
    """Register the ops that need no sandbox around the process (all but the fork family).

    ``spawner()`` gives the socket commands are started through (see ``spawner.py``).
    """
    repl = Repl(agent)
    commands = Commands(agent, spawner)
    uploads = Uploads(agent)
    agent.register("ping", handle_ping)
    agent.register("run_code", repl.handle_run_code)
    agent.register("context", repl.handle_context)
    agent.register("exec", commands.handle_exec)
    agent.register("wait", commands.handle_wait)
    agent.register("kill", commands.handle_kill)
    agent.register("ps", commands.handle_ps)
    agent.register("cancel", commands.handle_cancel)
    agent.register("follow", commands.handle_follow)
    agent.register("input", commands.handle_input)
    agent.register("close_stdin", commands.handle_close_stdin)
    agent.register("resize", commands.handle_resize)
    agent.register("read", handle_read)
    agent.register("write", uploads.handle_write)
    agent.register("list", handle_list)
    agent.register("exists", handle_exists)
    agent.register("remove", handle_remove)
    agent.register("stat", handle_stat)
    agent.register("mkdir", handle_mkdir)
    agent.register("move", handle_move)
    watches = Watches(agent)
    agent.register("watch", watches.handle_watch)
    agent.register("watch_events", watches.handle_watch_events)
    agent.register("unwatch", watches.handle_unwatch)


def run(ctrl_fd: int) -> None:
    """Serve the control channel on ``ctrl_fd`` until the daemon closes it."""
    ctrl_fd = _above_stdio(ctrl_fd)
    _standard_fds()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=ctrl_fd)
    sock.setblocking(True)
    sock.set_inheritable(False)  # user code's os.system() must not inherit the channel
    agent = Agent(sock)
    # A ^C meant for user code that arrives between calls must not end the agent; during
    # a file read or a listing it stops that (the daemon's caller went away).
    signal.signal(signal.SIGINT, agent.note_interrupt)
    register_ops(agent, spawner=spawner_fd)
    agent.register("fork_slot", handle_fork_slot)
    agent.register("fork", handle_fork)
    hold_fork_hooks()  # before any user code registers one
    agent.register("checkpoint", handle_checkpoint)
    agent.register("drop_listener", handle_drop_listener)
    agent.register("sethostname", handle_sethostname)
    agent.register("configure", handle_configure)
    agent.register("attach", handle_attach)
    agent.serve()


def _above_stdio(fd: int) -> int:
    """``fd``, moved above 2 if it is a standard descriptor (which are about to be replaced)."""
    if fd > 2:
        return fd
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return moved


def _standard_fds() -> None:
    """stdin reads /dev/null; stdout and stderr are open (run_code captures them per call).

    Without this a closed fd 1 would be handed out by the next open(), and
    output meant for the terminal would land in some file.
    """
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd == 0 or not _is_open(fd):
            os.dup2(null, fd)
    if null > 2:
        os.close(null)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
