"""The zygote: the process that forks every family's launcher (``agent.launching``).

It is a fresh interpreter (never a fork of the threaded daemon; ``-I -S``, nothing
inherited but its socket) started once per daemon, with the launcher's code
imported. The child it forks per family is what a fresh ``python`` per family used
to be, a single-threaded interpreter holding only the fds it was sent, without the
~20 ms (and ~15 ms of CPU) of start-up and imports a cold create used to queue on.
It also starts each image's template (``launching._template``), which forks the
launchers of that image's families from then on. See ``runtime.family`` for the
daemon's side.

The zygote reaps its launchers and exits when the daemon's end hangs up; the
launchers run on (they outlive the daemon) and the host's init reaps them.
"""

from __future__ import annotations

import socket
import sys

from branchbox.agent import launching


def serve() -> None:
    """The zygote: fork a launcher per request until the daemon hangs up."""
    launching.serve(socket.socket(fileno=int(sys.argv[1])), "bb-zygote")
