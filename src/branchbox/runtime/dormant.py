"""The daemon's end of a checkpoint's process (``agent/bb_dormant.c``).

A checkpoint runs no Python and speaks no agent protocol: it waits on a
SOCK_SEQPACKET socket, and every message is a wake that it answers with one
native int64 — the pid of the process it forked (which comes up as a fork
child, hello on its own control socket), or -errno. "?" asks whether it is
alive (answer ALIVE). Its first answer, unasked, says it is in place (0) or
why it is not (-errno). Answers come in order, so each waits in a queue; a
daemon that re-attaches may find answers to its predecessor's wakes first,
which ``alive`` reads past.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import socket
import struct

from branchbox.agent.protocol import ChannelClosed
from branchbox.runtime.channel import AgentError

_ANSWER = struct.Struct("=q")
MESSAGE_MAX = 65536  # bb_dormant.c's BUF_MAX
ALIVE = 1 << 62  # bb_dormant.c's answer to "?"


class Dormant:
    """One checkpoint's process, through its socket (``sock``: the fd keeper keeps it
    across a daemon restart, as it keeps a REPL's channel)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self.gone = False
        self.pid = 0  # the process's pid in its family's namespace, once known
        self.host_pid = 0  # and on the host

    def _expect(self) -> asyncio.Future:
        if self.gone:
            raise ChannelClosed("the checkpoint's process is gone")
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        if len(self._waiting) == 1:
            asyncio.get_running_loop().add_reader(self.sock.fileno(), self._on_answer)
        return future

    def _on_answer(self) -> None:
        try:
            data = self.sock.recv(_ANSWER.size)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if len(data) != _ANSWER.size:
            self.lose()
            return
        future = self._waiting.popleft()
        if not self._waiting:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        if not future.done():
            future.set_result(_ANSWER.unpack(data)[0])

    def lose(self) -> None:
        """The process is gone (or spoke out of turn): every wait fails."""
        if not self.gone and self._waiting:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.gone = True
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(ChannelClosed("the checkpoint's process is gone"))
                future.exception()  # seen: an awaiter still gets it; nobody else is told

    def _send(self, message: bytes, fds: list[int] = ()) -> asyncio.Future:
        future = self._expect()
        try:
            if fds:
                socket.send_fds(self.sock, [message], list(fds))
            else:
                self.sock.send(message)
        except BlockingIOError:  # it reads each message as it comes: it is stopped
            self._waiting.remove(future)
            if not self._waiting:
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            raise AgentError("Conflict", "the checkpoint's process is not reading (stopped?)"
                             ) from None
        except OSError:
            self.lose()
        return future

    async def ready(self) -> None:
        """Its first answer: in place, or AgentError with why not."""
        _check(await self._expect(), "the checkpoint could not be made")

    async def alive(self) -> bool:
        """Whether it answers "?" (answers to wakes before it are read past)."""
        try:
            answer = self._send(b"?")
            while await answer != ALIVE:
                answer = self._expect()
            return True
        except (ChannelClosed, AgentError):
            return False

    def wake(self, slot: dict, fds: list[int]):
        """Fork it once for a sandbox (``slot``: a fork slot's fields, ``fds``: its fds,
        which stay the caller's to close). Returns a coroutine to await the answer with,
        ``{"pid"}``."""
        message = json.dumps(slot, separators=(",", ":")).encode()
        if len(message) > MESSAGE_MAX:
            raise ValueError("a wake message is too long")
        return self._forked(self._send(message, fds))

    async def _forked(self, answer: asyncio.Future) -> dict:
        """A wake's answer; an ALIVE before it answered a "?" whose asker died (a
        daemon that re-attached read the one to its own)."""
        while (value := await answer) == ALIVE:
            answer = self._expect()
        return {"pid": _check(value, "the checkpoint could not fork")}

    async def close(self) -> None:
        """Let it go: at end of file it exits (the caller also kills its cgroup)."""
        self.lose()
        self.sock.close()


def _check(value: int, what: str) -> int:
    """An answer, or AgentError for -errno. Any int64 may come (the process is a copy of
    the sandbox's, whose code could have changed it): only a real errno is named."""
    if value < 0:
        why = os.strerror(-value) if -value < 4096 else f"answer {value}"
        raise AgentError("Internal", f"{what}: {why}")
    return value
