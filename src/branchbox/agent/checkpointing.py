"""The REPL side of a checkpoint: a fork of the REPL that runs nothing until it is woken.

A checkpoint is this process at one instant, kept for later. The daemon sends
``checkpoint`` with a SOCK_SEQPACKET socket and the checkpoint's cgroup fds;
the REPL looks at what it holds (as for the first slot of a fork: fds,
listening sockets, shared memory, from the daemon's reading of /proc) and
forks through ``bb_dormant`` (``bb_dormant.c``): the kept process never runs
Python again, so its memory stays the REPL's pages, shared copy-on-write, and
a checkpoint costs the pages the REPL changes afterwards, not a few MiB of its
own. Each wake the daemon sends it (a restore, a fork of the checkpoint) forks
it once more, and that process comes back *here*, inside this handler, with
the wake's slot: it becomes a sandbox exactly as a fork child does
(``forking.become_child``), from the instant this handler ran.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket

from . import forking, private_memory, protocol
from .server import RequestError

_LIBRARY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "bb-dormant.so")  # beside bbagent/ in the agent layer
_MESSAGE_MAX = 65536  # bb_dormant.c's BUF_MAX and FDS_MAX
_FDS_MAX = 64
_P = ctypes.POINTER
_dormant = None


def _bb_dormant():
    """The C function, loaded once (through PyDLL: the GIL stays held across the fork,
    as for os.fork)."""
    global _dormant
    if _dormant is None:
        fn = ctypes.PyDLL(_LIBRARY).bb_dormant
        fn.restype = ctypes.c_long
        fn.argtypes = [ctypes.c_int, _P(ctypes.c_int), ctypes.c_int, _P(ctypes.c_int),
                       ctypes.c_int, _P(ctypes.c_long), ctypes.c_long, ctypes.c_char_p,
                       ctypes.c_long, _P(ctypes.c_int), ctypes.c_int, _P(ctypes.c_long)]
        _dormant = fn
    return _dormant


def _ints(ctype, values: list[int]):
    return (ctype * max(len(values), 1))(*values)


def handle_checkpoint(agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """fds = [the checkpoint's socket, *its cgroup.procs fds]. Answers the checkpoint's
    pid; the checkpoint itself tells the daemon on its socket once it is in place."""
    batch = None
    try:
        if not fds or len(fds) != 1 + int(req.get("njoin", -1)):
            raise RequestError("InvalidRequest", "checkpoint got the wrong number of fds")
        sock, join = fds[0], fds[1:]
        batch = forking.open_batch(agent, fds, req.get("inherit") or {})
        copies = private_memory.instant_copies(batch.shared, batch.swap)
        held = sorted({*agent.own_fds(), *forking.inherited(), *batch.close,
                       *(fd for fd, *_ in batch.reopen)} - set(fds))
        message = ctypes.create_string_buffer(_MESSAGE_MAX)
        received = (ctypes.c_int * _FDS_MAX)()
        got = (ctypes.c_long * 2)()
        call = _bb_dormant()
        # Everything built before the fork: nothing is allocated between the
        # interpreter's before-fork hooks and the clone.
        args = (sock, _ints(ctypes.c_int, join), len(join), _ints(ctypes.c_int, held),
                len(held), _ints(ctypes.c_long, copies), len(copies), message, _MESSAGE_MAX,
                received, _FDS_MAX, got)
        pid = forking.fork_with(lambda: call(*args))
    except BaseException:
        for fd in fds:
            os.close(fd)
        if batch is not None:
            forking.end_batch(agent, batch)
        raise
    if pid == 0:  # woken, long after: a restore or a fork of the checkpoint
        _wake(agent, batch, message.raw[:got[0]], list(received[:got[1]]))
        return  # back to the request loop, on the new sandbox's own socket
    for fd in fds:
        os.close(fd)
    agent.done(req["rid"], {"pid": pid})
    forking.end_batch(agent, batch)


def _wake(agent, batch, message: bytes, fds: list[int]) -> None:
    """Become the sandbox whose slot comes on the control socket the wake carried (fds
    = [it]): the daemon wakes the checkpoint before it makes the sandbox's body, so this
    process is forked and back in Python meanwhile, and sends the rest of the slot
    (its fork slot without the control socket) once the body is made. A wake or slot
    that does not parse, or the socket's end, ends this process (the daemon reads its
    control socket closing as a failed child). The checkpoint's socket is closed
    already (bb_dormant.c)."""
    slot = None
    if len(fds) == 1:
        ctrl = socket.socket(fileno=fds[0])
        try:
            if json.loads(message) == {"early": True}:
                header, _, rest = protocol.recv(ctrl)
                slot = forking.slot_from(header, [ctrl.detach(), *rest])
        except (OSError, ValueError, protocol.ChannelClosed):
            slot = None
    if slot is None:
        os._exit(70)
    forking.become_child(agent, slot, batch)
