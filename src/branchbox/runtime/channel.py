"""The daemon's end of a sandbox's control socket (asyncio, frames of agent.protocol).

One reader task per channel routes frames to the request they answer (by
``rid``), so a background command can be waited on while other requests are
answered. The raw socket is used instead of asyncio streams because fork
requests carry file descriptors (SCM_RIGHTS).

Everything that arrives here was written by the sandbox's REPL process, and
user code runs in that process: it can find the socket and write frames of its
own. So every frame is hostile input, and the daemon enforces its budgets
itself instead of trusting the agent's:

- A frame must be well formed: sane lengths, a JSON *object* header, the
  fields of its kind with the right types, a payload only where one belongs,
  and the ``rid`` of a request still open (or abandoned, see below). Anything
  else is a protocol violation: the channel is shut down, which ends only this
  sandbox (its callers get ``ChannelClosed``, its REPL sees the socket close).
- Each request has a budget of output characters (its ``max_output`` plus a
  little) and of frames; a request that goes past it is a violation too. A
  file read or a directory listing has no byte budget (files and directories
  can be large) but is paced by its reader: see backpressure. Such a request
  may send data chunks and its final event, nothing else (output events for
  it, which nobody reads, would go on for ever).
- A header is at most ``protocol.MAX_AGENT_HEADER`` (1 MiB) and
  ``protocol.MAX_AGENT_TOKENS`` values, counted before it is decoded: json.loads of
  tiny values costs the event loop up to ~120 ns each, and at the old 64 MiB one
  frame user code wrote stopped every sandbox for 4.5 s. Longer answers send their
  long strings ahead as ``blob`` events, held per request until the header that
  names their places (``protocol.unspill``): at most ``protocol.MAX_SPILLED`` bytes
  waiting on a channel. A listing's chunk is at most ``LIST_CHUNK`` bytes of JSON.
- Backpressure: each request's queue holds at most :data:`QUEUE_FRAMES` frames
  and :data:`QUEUE_BYTES` bytes. When it is full the reader stops reading the
  socket, the kernel's socket buffer fills and the agent blocks in its send.
  Memory per sandbox is thus bounded by the open requests' queues plus one
  frame in hand.
- A request its caller gave up on (a client that went away) is *abandoned*:
  its frames are read and dropped until its final event, within its budget
  (and at most :data:`ABANDONED_DRAIN` bytes), and ``on_abandon`` is called
  so that the engine can interrupt the REPL.
- The reader yields to the event loop at least every :data:`READ_SLICE` of
  reading: a socket that always has data must not starve other sandboxes and
  the API. Within a slice it reads on, so a caller finds what came meanwhile
  queued, and output events waiting together go to it as one (a line printed at
  a time was an event each, written to the client each: 32 us of the daemon's
  CPU per line).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import signal
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from branchbox.agent import protocol
from branchbox.agent.files import LIST_CHUNK
from branchbox.agent.protocol import ChannelClosed
from branchbox.agent.server import MAX_OUTPUT

if TYPE_CHECKING:
    from branchbox.runtime.cgroups import SandboxCgroup

log = logging.getLogger("branchbox.channel")

QUEUE_FRAMES = 256
"""Frames one request may have waiting for its caller before the reader stops reading."""
QUEUE_BYTES = 8 * 1024 * 1024
"""Bytes one request may have waiting (one larger frame is still taken into an empty queue)."""
MAX_EVENT_DATA = 2 * 1024 * 1024
"""Characters of ``data`` in one stdout/stderr event (the agent sends at most 1 Mi; the
daemon joins queued ones up to this)."""
READ_SLICE = 0.001
"""Seconds the reader goes on reading a socket that has data before it yields."""
OUTPUT_SLACK = 1024 * 1024
"""Characters past a request's ``max_output`` the agent may send (markers, decoder tails)."""
FRAME_SLACK = 1024
"""Frames a request may send beyond one per character (or byte) of its content, and
non-final frames it may send with no content at all (the agent sends none)."""
ABANDONED_DRAIN = 1 << 30
"""Bytes the daemon reads and drops for a request nobody waits for any more; past that
the sandbox is cut off rather than costing the daemon time for ever."""
_OUTPUT_OPS = {"run_code", "exec"}
_UNBOUNDED_OPS = {"read", "list"}  # paced by their readers instead (backpressure)
_FINAL = {"done", "fail"}
_PACED = {"chunk", *_FINAL}  # what an unbounded request may send
_TEXT = {"stdout", "stderr"}


class AgentError(Exception):
    """A request the agent answered with ``fail``: ``kind`` is its error type."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class ProtocolViolation(ValueError):
    """A frame the daemon refuses: the sandbox's channel is shut down."""


@dataclass(eq=False)
class _Request:
    """One open request: its queue and what it has cost so far."""

    op: str | None
    content_budget: int | None  # characters of output or payload bytes; None: unbounded
    frame_budget: int | None
    items: deque = field(default_factory=deque)
    queued_bytes: int = 0
    content: int = 0
    frames: int = 0
    empty: int = 0
    wire: int = 0
    spilled: list[bytes] = field(default_factory=list)  # blobs for its next header
    spilled_bytes: int = 0  # theirs (counted, not kept, once the request is abandoned)
    abandoned: bool = False
    finished: bool = False  # its final event (done or fail) has arrived
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # final event, or channel gone
    space: asyncio.Event = field(default_factory=asyncio.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def charge(self, content: int, size: int, final: bool) -> None:
        self.content += content
        if not content and not final:
            self.empty += 1
            if self.empty > FRAME_SLACK:
                raise ProtocolViolation(f"request {self.op!r} sent more than {FRAME_SLACK} "
                                        "frames without content")
        if self.content_budget is not None and self.content > self.content_budget:
            raise ProtocolViolation(
                f"request {self.op!r} went past its output budget ({self.content_budget})")
        self.charge_frame(size)

    def charge_frame(self, size: int) -> None:
        """Any frame of the request, a blob too (a blob's bytes are charged as content, if
        they are, with the header they belong to)."""
        self.frames += 1
        self.wire += size
        if self.frame_budget is not None and self.frames > self.frame_budget:
            raise ProtocolViolation(f"request {self.op!r} sent more than {self.frame_budget} "
                                    "frames")
        if self.abandoned and self.wire > ABANDONED_DRAIN:
            raise ProtocolViolation(f"abandoned request {self.op!r} kept sending past "
                                    f"{ABANDONED_DRAIN} bytes")

    def full(self) -> bool:
        return bool(self.items) and (len(self.items) >= QUEUE_FRAMES
                                     or self.queued_bytes >= QUEUE_BYTES)


class RequestQueue:
    """The events of one request as its caller sees them (``get``, ``empty``)."""

    def __init__(self, channel: AgentChannel, rid: int, request: _Request) -> None:
        self._channel, self.rid, self._request = channel, rid, request

    def empty(self) -> bool:
        return not self._request.items

    async def get(self) -> tuple[dict, bytes] | None:
        """The next event, or None once the channel is closed and nothing is left."""
        req = self._request
        while not req.items:
            if self._channel.closed.is_set():
                return None
            req.ready.clear()
            await req.ready.wait()  # set by the reader for each frame, and when it ends
        header, payload, size = req.items.popleft()
        req.queued_bytes -= size
        if header["ev"] in _TEXT:  # output already queued behind it joins it
            parts = [header["data"]]
            length = len(parts[0])
            while req.items and (following := req.items[0][0])["ev"] == header["ev"] \
                    and length + len(following["data"]) <= MAX_EVENT_DATA:
                req.queued_bytes -= req.items.popleft()[2]
                parts.append(following["data"])
                length += len(parts[-1])
            if len(parts) > 1:
                header = {**header, "data": "".join(parts)}
        if not req.full():
            req.space.set()
        return header, payload


def _budget(op: str | None, args: dict | None) -> tuple[int | None, int | None]:
    """(content, frames) a request ``op`` with ``args`` may send before it is a violation."""
    if op in _UNBOUNDED_OPS:
        return None, None
    limit = MAX_OUTPUT
    requested = (args or {}).get("max_output")
    if op in _OUTPUT_OPS and isinstance(requested, int) and not isinstance(requested, bool):
        limit = max(0, requested)
    content = limit + OUTPUT_SLACK
    return content, content + FRAME_SLACK


def _routing(header: object) -> tuple[int, str]:
    """(rid, kind) of a frame's header; raises ProtocolViolation."""
    if not isinstance(header, dict):
        raise ProtocolViolation(f"header is a JSON {type(header).__name__}, not an object")
    rid, ev = header.get("rid"), header.get("ev")
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise ProtocolViolation(f"rid must be an integer, got {type(rid).__name__}")
    if not isinstance(ev, str):
        raise ProtocolViolation(f"ev must be a string, got {type(ev).__name__}")
    return rid, ev


def _check(header: dict, payload: bytes, op: str) -> int:
    """The content size of a well-formed event frame (blobs put back) of a request for
    ``op``; raises ProtocolViolation. Output text is made encodable: a lone surrogate
    (which a header's ``\\ud800`` escape makes) becomes U+FFFD, as the agent's own
    decoding of undecodable output does, so every client can encode what it gets."""
    ev = header["ev"]
    if ev in ("stdout", "stderr"):
        data = header.get("data")
        if not isinstance(data, str) or len(data) > MAX_EVENT_DATA or payload \
                or header.keys() - {"rid", "ev", "data"}:
            raise ProtocolViolation(f"malformed {ev} event")
        header["data"] = _encodable(data)
        return len(data)
    if ev == "chunk":
        if op not in _CHUNKED or len(payload) > protocol.CHUNK or header.keys() - {"rid", "ev"}:
            raise ProtocolViolation(f"malformed chunk event for request {op!r}"[:200])
        return len(payload)
    if ev == "done":
        if not isinstance(header.get("result", {}), dict) or payload:
            raise ProtocolViolation("malformed done event")
        return 0
    if ev == "fail":
        err = header.get("error")
        if not (isinstance(err, dict) and isinstance(err.get("type"), str)
                and isinstance(err.get("message", ""), str)) or payload:
            raise ProtocolViolation("malformed fail event")
        return 0
    raise ProtocolViolation(f"unknown event kind {ev!r}"[:200])


_CHUNKED = frozenset({"read", "list"})  # requests answered in raw chunks of bytes
_SURROGATE = re.compile("[\ud800-\udfff]")


def _encodable(text: str) -> str:
    if text.isascii():  # most output: a flag CPython keeps, no pass over the text
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


INTERRUPTIBLE = {"run_code", "read", "list"}
"""Requests the REPL's main thread works on until their end, which SIGINT stops: user
code (KeyboardInterrupt), and a file read or a listing (the agent checks between chunks)."""


def interrupt_repl(cgroup: SandboxCgroup, op: str | None) -> None:
    """Stop an :data:`INTERRUPTIBLE` request nobody waits for any more with SIGINT, so
    the REPL is free for the next call instead of working on for ever (a read of a file
    past 1 GiB went on past what the daemon drains for nobody, and the sandbox's channel
    was cut: its REPL lost). Other requests end on their own or by a ``cancel``.

    The REPL's host pid comes from the sandbox's ``repl`` cgroup leaf; a pidfd taken
    before the membership is checked again makes sure the signal reaches that process and
    not one that reused its pid.
    """
    if op not in INTERRUPTIBLE:
        return
    for directory in cgroup.dirs:
        procs = directory / "repl" / "cgroup.procs"
        try:
            pids = procs.read_text().split()
        except FileNotFoundError:  # on cgroup v1 only the freezer has the leaves
            continue
        for pid in pids:
            try:
                pidfd = os.pidfd_open(int(pid))
            except (ProcessLookupError, ValueError):
                continue
            try:
                if pid in procs.read_text().split():
                    signal.pidfd_send_signal(pidfd, signal.SIGINT)
            except (ProcessLookupError, FileNotFoundError):
                pass
            finally:
                os.close(pidfd)


class AgentChannel:
    def __init__(self, sock: socket.socket, *, resumed: bool = False) -> None:
        """``resumed``: a channel an earlier daemon used (engine.reattach). The REPL may
        still answer that daemon's requests; their frames are read and dropped, up to
        :data:`ABANDONED_DRAIN` bytes, and this daemon's request ids start above any
        the earlier one can have used (microseconds since the epoch)."""
        sock.setblocking(False)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._stale_below = time.time_ns() // 1000 if resumed else 0
        self._stale_bytes = 0
        self._spilled = 0  # bytes of blobs held for headers still to come
        self._rids = itertools.count(self._stale_below + 1)
        self._pending: dict[int, _Request] = {}
        self._orphans: set[_Request] = set()  # abandoned, and the agent is still on them
        self._send_lock = asyncio.Lock()
        self.closed = asyncio.Event()
        self.violation: str | None = None
        self.on_abandon: Callable[[str | None, int], None] | None = None
        """Called (with the op) when a request is given up before its final event."""
        self._reader = self._loop.create_task(self._read_loop())

    async def _recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = await self._loop.sock_recv_into(self.sock, view[got:])
            if not k:
                raise ChannelClosed("control channel closed")
            got += k
        return buf

    async def _read_frame(self) -> tuple[object, bytes, int]:
        prefix = await self._recv_exact(8)
        try:
            hlen, plen = protocol.decode_header(bytes(prefix), protocol.MAX_AGENT_HEADER)
        except ValueError as exc:
            raise ProtocolViolation(str(exc)) from None
        raw = await self._recv_exact(hlen)
        if protocol.tokens(raw) > protocol.MAX_AGENT_TOKENS:  # before json.loads pays them
            raise ProtocolViolation(f"header of more than {protocol.MAX_AGENT_TOKENS} values")
        try:
            # NaN and infinities (a rich JSON result may hold them) become null, as
            # JSON has them: our answers and streams are JSON.
            header = json.loads(raw, parse_constant=_null)
        except (ValueError, RecursionError):  # "[" * 5,000: deeper than json.loads goes
            raise ProtocolViolation("header is not JSON") from None
        del raw
        payload = bytes(await self._recv_exact(plen)) if plen else b""
        return header, payload, 8 + hlen + plen

    async def _read_loop(self) -> None:
        slice_began = time.monotonic()
        try:
            while True:
                if time.monotonic() - slice_began >= READ_SLICE:
                    await asyncio.sleep(0)  # never hold the loop while the socket has data
                    slice_began = time.monotonic()
                header, payload, size = await self._read_frame()
                rid, ev = _routing(header)
                req = self._pending.get(rid)
                if req is None and rid < self._stale_below:  # an earlier daemon's request
                    self._stale_bytes += size
                    if self._stale_bytes > ABANDONED_DRAIN:
                        raise ProtocolViolation("an earlier daemon's requests kept sending "
                                                f"past {ABANDONED_DRAIN} bytes")
                    continue
                if req is None:
                    raise ProtocolViolation(f"event for request {rid}, which is not open")
                if req.finished:
                    raise ProtocolViolation(f"event for request {rid} after its final event")
                if req.op in _UNBOUNDED_OPS and ev not in _PACED:  # unbudgeted: data only
                    raise ProtocolViolation(f"{ev} event for request {req.op!r}"[:200])
                if ev == "blob":
                    self._take_blob(req, header, payload, size)
                    continue
                if req.spilled_bytes or "blobs" in header:
                    spilled = self._unspill(req, header)
                    size += spilled
                    # An abandoned request's blobs were not kept: its header, dropped, is
                    # not put back together, only counted.
                    content = spilled if req.abandoned else _check(header, payload, req.op)
                else:
                    content = _check(header, payload, req.op)
                if req.op == "list" and ev == "chunk" and len(payload) > LIST_CHUNK:
                    raise ProtocolViolation(f"a listing's chunk of {len(payload)} bytes")
                req.charge(content, size, ev in _FINAL)
                if ev in _FINAL:
                    req.finished = True
                    req.space.set()
                    req.ended.set()
                    self._orphans.discard(req)
                if req.abandoned:
                    if ev in _FINAL:
                        self._pending.pop(rid, None)
                else:
                    while req.full() and not req.abandoned:  # backpressure onto the socket
                        req.space.clear()
                        await req.space.wait()
                    if not req.abandoned:
                        req.items.append((header, payload, size))
                        req.queued_bytes += size
                        req.ready.set()
                    elif ev in _FINAL:
                        self._pending.pop(rid, None)
                del header, payload
        except ProtocolViolation as exc:
            self.violation = str(exc)
            log.warning("closing a sandbox's control channel: %s", exc)
        except (ChannelClosed, OSError):
            pass
        except Exception:  # a bug here must still end only this channel
            log.exception("control channel reader failed")
            self.violation = "internal error reading the channel"
        finally:
            if self.violation is not None:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
            self.closed.set()
            for req in self._pending.values():
                self._release(req)
                req.ready.set()
                req.space.set()
                req.ended.set()
            self._orphans.clear()

    def _take_blob(self, req: _Request, header: dict, payload: bytes, size: int) -> None:
        """Hold a blob event's payload for the request's next header (an abandoned
        request's is only counted: nobody will read what it belongs to)."""
        if header.keys() - {"rid", "ev"} or not payload:
            raise ProtocolViolation("malformed blob event")
        req.charge_frame(size)
        req.spilled_bytes += len(payload)
        if req.spilled_bytes > protocol.MAX_SPILLED:
            raise ProtocolViolation(f"more than {protocol.MAX_SPILLED} bytes of blobs for "
                                    "one header")
        if req.abandoned:
            return
        self._spilled += len(payload)
        if self._spilled > protocol.MAX_SPILLED:
            raise ProtocolViolation(f"more than {protocol.MAX_SPILLED} bytes of blobs waiting "
                                    "for their headers")
        req.spilled.append(payload)

    def _unspill(self, req: _Request, header: dict) -> int:
        """Put the request's blobs back into ``header`` (an abandoned request's: only drop
        their names); the bytes they add to its frame."""
        size, data = req.spilled_bytes, b"".join(req.spilled)
        self._release(req)
        if req.abandoned:
            header.pop("blobs", None)
            return size
        try:
            protocol.unspill(header, data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolViolation(f"blobs: {exc}"[:200]) from None
        return size

    def _release(self, req: _Request) -> None:
        """Let go of the blobs ``req`` holds (their header came, or the request ended, was
        abandoned or replaced)."""
        self._spilled -= sum(map(len, req.spilled))
        req.spilled.clear()
        req.spilled_bytes = 0

    async def send(self, header: dict, payload: bytes = b"", fds: list[int] = ()) -> None:
        data = protocol.encode(header, payload)
        async with self._send_lock:
            if fds:
                while True:
                    try:
                        sent = socket.send_fds(self.sock, [data], list(fds))
                        break
                    except BlockingIOError:
                        await asyncio.sleep(0.0005)
                data = data[sent:]
            if data:
                await self._loop.sock_sendall(self.sock, data)

    def open_request(self, op: str | None = None, args: dict | None = None
                     ) -> tuple[int, RequestQueue]:
        rid = next(self._rids)
        return rid, self._open(rid, op, args)

    def expect(self, rid: int) -> RequestQueue:
        """Route frames with ``rid`` to a new queue (rid 0: a fork child's hello)."""
        return self._open(rid, None, None)

    def _open(self, rid: int, op: str | None, args: dict | None) -> RequestQueue:
        content, frames = _budget(op, args)
        req = _Request(op, content, frames)
        if (replaced := self._pending.get(rid)) is not None:
            self._release(replaced)
        self._pending[rid] = req
        return RequestQueue(self, rid, req)

    def close_request(self, rid: int) -> None:
        """The caller is done with ``rid``. If its final event has not come yet, the
        request is abandoned: what still comes is dropped, and ``on_abandon`` runs."""
        req = self._pending.get(rid)
        if req is None or req.abandoned:
            return
        if req.finished or self.closed.is_set():
            self._release(self._pending.pop(rid))
            return
        self._release(req)  # what it spilled so far is never read
        req.abandoned = True
        self._orphans.add(req)
        req.items.clear()
        req.queued_bytes = 0
        req.space.set()  # a reader blocked on this queue reads (and drops) again
        if req.content_budget is None:
            req.content_budget = req.content + ABANDONED_DRAIN
        if self.on_abandon is not None:
            try:
                self.on_abandon(req.op, rid)
            except Exception:
                log.exception("interrupting an abandoned request failed")

    def orphaned_code(self) -> bool:
        """Whether a ``run_code`` abandoned is still going (the REPL runs it for nobody)."""
        return any(req.op == "run_code" and not req.ended.is_set() for req in self._orphans)

    def orphans(self) -> list[asyncio.Event]:
        """The ``ended`` events of abandoned requests the agent is still working on: until
        they are set, the REPL is busy with a call nobody waits for."""
        return [req.ended for req in self._orphans]

    async def events(self, rid: int, queue: RequestQueue) -> AsyncIterator[tuple[dict, bytes]]:
        """Yield the events of request ``rid`` up to and including its ``done``."""
        try:
            while True:
                item = await queue.get()
                if item is None:
                    raise ChannelClosed("the sandbox's REPL process is gone")
                header, payload = item
                ev = header.get("ev")
                if ev == "fail":
                    err = header.get("error") or {}
                    raise AgentError(err.get("type", "Internal"), err.get("message", ""))
                yield header, payload
                if ev == "done":
                    return
        finally:
            self.close_request(rid)

    async def stream(
        self, op: str, args: dict | None = None, payload: bytes = b"", fds: list[int] = ()
    ) -> AsyncIterator[tuple[dict, bytes]]:
        rid, queue = self.open_request(op, args)
        try:
            await self.send({"op": op, "rid": rid, **(args or {})}, payload, fds)
        except BaseException:
            if (req := self._pending.pop(rid, None)) is not None:
                self._release(req)
            raise
        async for item in self.events(rid, queue):
            yield item

    async def call(
        self, op: str, args: dict | None = None, payload: bytes = b"", fds: list[int] = ()
    ) -> dict:
        result: dict = {}
        async for header, _ in self.stream(op, args, payload, fds):
            if header.get("ev") == "done":
                result = header.get("result") or {}
        return result

    async def close(self) -> None:
        """Stop reading and close the socket; never raises (even if the reader failed)."""
        self._reader.cancel()
        await asyncio.wait([self._reader])
        self.sock.close()
        self.closed.set()
        for req in self._pending.values():
            req.ended.set()
        self._orphans.clear()


def _null(_constant: str) -> None:
    """What ``NaN``, ``Infinity`` and ``-Infinity`` in a header decode to."""
    return None
