"""The agent's request loop: one thread, one selector, nothing a fork could tear.

The daemon sends requests ``{"op", "rid", ...}`` over the control socket; a
handler answers with events and exactly one ``done`` or ``fail`` for that rid.
Work that outlives its request (running commands, their timeouts) is driven by
the same loop through :meth:`Agent.watch` and :meth:`Agent.call_later`, so the
process has a single thread and may ``os.fork()`` between any two callbacks:
that is how a sandbox forks, with the fork handler calling
:meth:`Agent.reset_after_fork` in the child.

Also here, because every op module needs them: request-field checks
(:func:`param`, :func:`timeout_param`, :func:`output_limit`) and the bounded
output policy (:data:`MAX_OUTPUT`, :class:`OutputLimit`).
"""

from __future__ import annotations

import errno
import math
import os
import selectors
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from . import protocol

MAX_OUTPUT = 16 * 1024 * 1024
"""Default cap on stdout + stderr bytes sent (or kept) per run_code / exec request."""

Handler = Callable[["Agent", dict, bytes, list[int]], None]

# The channel is gone: stop serving instead of failing requests nobody will read.
_CLOSED = (protocol.ChannelClosed, BrokenPipeError, ConnectionResetError)


# A sandbox's resources running out, met by any handler (a file write, a command's spawn):
# typed, so the caller gets a status that says so (507, 429) instead of a traceback.
_EXHAUSTED = {errno.ENOSPC: "NoSpace", errno.EDQUOT: "NoSpace", errno.EAGAIN: "ResourceLimit",
              errno.EMFILE: "ResourceLimit", errno.ENFILE: "ResourceLimit",
              errno.ENOMEM: "ResourceLimit"}


def _exhausted_message(exc: OSError) -> str:
    """What ran out, for an OSError whose errno is in ``_EXHAUSTED``."""
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno == errno.EDQUOT:
        return f"the sandbox's disk limit (disk_mb) is reached{where}: {exc.strerror}"
    if exc.errno == errno.ENOSPC:
        return f"no space left on the sandbox's disk{where}: {exc.strerror}"
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return (f"out of open files{where}: {exc.strerror} (the REPL's own open-file "
                "limit: close some of the files its code holds open)")
    if exc.errno == errno.ENOMEM:
        return f"out of memory{where}: {exc.strerror} (the sandbox's memory limit, memory_mb)"
    return (f"the sandbox's process limit is reached{where}: {exc.strerror} (too many "
            "processes or threads are running in it)")


class RequestError(Exception):
    """Raised by a handler to answer its request with ``fail`` of type ``type``."""

    def __init__(self, type: str, message: str) -> None:
        super().__init__(message)
        self.type = type
        self.message = message


_MISSING: Any = object()


def param(req: dict, name: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    """Field ``name`` of a request, checked against ``kind``.

    An absent or null field yields ``default``; without a default it is an
    InvalidRequest. ``True`` is not accepted where an int is asked for.
    """
    value = req.get(name)
    if value is None:
        if default is _MISSING:
            raise RequestError("InvalidRequest", f"missing field {name!r}")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        wanted = " or ".join(k.__name__ for k in kinds)
        raise RequestError("InvalidRequest", f"field {name!r} must be {wanted}")
    return value


def timeout_param(req: dict, name: str = "timeout") -> float | None:
    """A positive, finite number of seconds, or None for no limit.

    Zero is refused rather than read as "no limit" (setitimer's meaning) or
    "already expired": both would surprise someone.
    """
    value = param(req, name, (int, float), None)
    if value is not None and not (math.isfinite(value) and value > 0):
        raise RequestError("InvalidRequest", f"field {name!r} must be a positive number")
    return value


def output_limit(req: dict) -> OutputLimit:
    """The output budget of a request: its ``max_output`` bytes, else :data:`MAX_OUTPUT`."""
    limit = param(req, "max_output", int, MAX_OUTPUT)
    if limit < 0:
        raise RequestError("InvalidRequest", "field 'max_output' must not be negative")
    return OutputLimit(limit)


class OutputLimit:
    """Bytes of stdout and stderr (together) one request may still send or keep.

    What does not fit is dropped and counted, so the final marker can say how
    much was lost.
    """

    def __init__(self, limit: int) -> None:
        self.size = limit
        self.remaining = limit
        self.dropped = 0

    def reserve(self, n: int) -> int:
        """Account for ``n`` bytes of output; returns how many of them may be kept."""
        kept = min(n, self.remaining)
        self.remaining -= kept
        self.dropped += n - kept
        return kept

    def take(self, data: bytes) -> bytes:
        """The part of ``data`` that fits."""
        return data[: self.reserve(len(data))]

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def marker(self) -> str:
        """The text appended (as stderr) when output was dropped."""
        return f"\n[branchbox: output truncated, {self.dropped} bytes dropped]\n"


class Timer:
    """A callback the loop runs once at ``deadline`` (time.monotonic), unless cancelled."""

    __slots__ = ("deadline", "callback", "cancelled")

    def __init__(self, deadline: float, callback: Callable[[], None]) -> None:
        self.deadline = deadline
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Agent:
    """Serves requests from the control socket until the daemon closes it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._handlers: dict[str, Handler] = {}
        self._timers: list[Timer] = []
        self._fork_hooks: list[Callable[[], None]] = []
        self._sending = 0
        self.interrupted = False  # a SIGINT came since this request began
        self._selector = self._new_selector()

    def _new_selector(self) -> selectors.BaseSelector:
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ, self._on_request)
        return selector

    def own_fds(self) -> set[int]:
        """The agent's own fds (its socket, its selector): a fork child replaces them with
        its own, they are not the user's to be told about."""
        return {self.sock.fileno(), self._selector.fileno()}

    def watched_fds(self) -> set[int]:
        """The fds the agent's loop watches for its handlers (commands' pipes and pidfds)."""
        return {key.fd for key in self._selector.get_map().values()} - self.own_fds()

    # -- what handlers and op modules use -------------------------------------------------

    def register(self, op: str, handler: Handler) -> None:
        """Route requests with ``"op": op`` to ``handler(agent, req, payload, fds)``.

        The handler sends its own events and final done/fail (or raises
        :class:`RequestError`; any other exception becomes an "Internal" fail
        carrying the traceback). It owns the file descriptors in ``fds``.
        """
        self._handlers[op] = handler

    def watch(self, fileobj: Any, callback: Callable[[], None]) -> None:
        """Call ``callback()`` from the loop whenever ``fileobj`` is readable."""
        self._selector.register(fileobj, selectors.EVENT_READ, callback)

    def unwatch(self, fileobj: Any) -> None:
        """Stop watching ``fileobj``; do this before closing it."""
        self._selector.unregister(fileobj)

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback()`` from the loop after ``delay`` seconds."""
        timer = Timer(time.monotonic() + delay, callback)
        self._timers.append(timer)
        return timer

    def at_fork(self, hook: Callable[[], None]) -> None:
        """Have :meth:`reset_after_fork` call ``hook()`` in a forked child.

        The hook drops state that belongs to the parent: it closes this
        process's copies of descriptors and forgets table entries. It must not
        signal or wait for the parent's processes, and need not unwatch
        anything (the inherited selector is already gone when it runs).
        """
        self._fork_hooks.append(hook)

    def note_interrupt(self, signum: int, frame: Any) -> None:
        """SIGINT outside run_code: the daemon gave up on the request under way (a file
        read or a listing nobody reads any more); its handler stops at its next check.
        A Python handler, not SIG_IGN, which commands would inherit."""
        self.interrupted = True

    def check_interrupted(self) -> None:
        """Raise if the daemon gave up on the request under way (see note_interrupt)."""
        if self.interrupted:
            raise RequestError("Cancelled", "the caller went away")

    @property
    def sending(self) -> bool:
        """True while a frame is being written: a signal handler must not raise now,
        or the daemon would receive half a frame."""
        return self._sending > 0

    def event(self, rid: int, ev: str, payload: bytes = b"", **fields: Any) -> None:
        """Send a non-final event ``{"rid", "ev", **fields}`` with optional raw payload."""
        self._send({"rid": rid, "ev": ev, **fields}, payload)

    def done(self, rid: int, result: dict) -> None:
        """The final event of a request; an answer too large for one frame is a
        PayloadTooLarge failure instead (the daemon closes a channel that sends one, and
        the REPL with it: a listing of a directory of 700,000 files did)."""
        try:
            self._send({"rid": rid, "ev": "done", "result": result})
        except protocol.FrameTooLarge as exc:
            self.fail(rid, "PayloadTooLarge", f"the answer is {exc}")

    def fail(self, rid: int | None, type: str, message: str) -> None:
        """The final event of a failed request (rid None: the request had no usable rid)."""
        self._send({"rid": rid, "ev": "fail", "error": {"type": type, "message": message}})

    def _send(self, header: dict, payload: bytes = b"") -> None:
        """Send a frame, its long strings first as blob events if the daemon would
        refuse its header (``protocol.spill``); raises FrameTooLarge before sending
        anything if even that is too large."""
        head, blobs = protocol.spill(header)
        self._sending += 1
        try:
            for blob in blobs:
                for at in range(0, len(blob), protocol.CHUNK):
                    protocol.send(self.sock, {"rid": header["rid"], "ev": "blob"},
                                  blob[at : at + protocol.CHUNK])
            protocol.send_frame(self.sock, protocol.frame(head, payload))
        finally:
            self._sending -= 1

    # -- the loop ---------------------------------------------------------------------------

    def serve(self) -> None:
        """Run until the control channel closes."""
        try:
            while True:
                for key, _mask in self._selector.select(self._next_timeout()):
                    # An earlier callback of this batch may have unwatched this key (a finished
                    # command closes its pipes) or forked (the child has a fresh selector):
                    # then it is not ours to run.
                    if self._selector.get_map().get(key.fd) is key:
                        self._run_callback(key.data)
                self._fire_timers()
        except _CLOSED:
            return

    def _run_callback(self, callback: Callable[[], None]) -> None:
        try:
            callback()
        except _CLOSED:
            raise
        except Exception:
            # A bug in the bookkeeping of one command must not take down the process that
            # holds the user's REPL state; the agent's own stderr is its log.
            traceback.print_exc()

    def _next_timeout(self) -> float | None:
        self._timers = [t for t in self._timers if not t.cancelled]
        if not self._timers:
            return None
        return max(0.0, min(t.deadline for t in self._timers) - time.monotonic())

    def _fire_timers(self) -> None:
        now = time.monotonic()
        for timer in [t for t in self._timers if t.deadline <= now]:
            if not timer.cancelled:  # an earlier timer's callback may have cancelled it
                timer.cancel()
                self._run_callback(timer.callback)

    def _on_request(self) -> None:
        header, payload, fds = protocol.recv(self.sock)
        rid = header.get("rid")
        op = header.get("op")
        handler = self._handlers.get(op) if isinstance(op, str) else None
        if handler is None or not isinstance(rid, int) or isinstance(rid, bool):
            for fd in fds:
                os.close(fd)
            problem = "rid must be an integer" if handler else f"unknown op {op!r}"
            self.fail(rid, "InvalidRequest", problem)
            return
        self.interrupted = False  # a SIGINT before this request was for an earlier one
        try:
            handler(self, header, payload, fds)
        except RequestError as exc:
            self.fail(rid, exc.type, exc.message)
        except OSError as exc:
            if exc.errno in _EXHAUSTED:  # the caller's to fix, not a bug: no traceback
                self.fail(rid, _EXHAUSTED[exc.errno], _exhausted_message(exc))
            else:
                self.fail(rid, "Internal", traceback.format_exc())
        except BaseException:  # even SystemExit from a handler must not end the agent
            self.fail(rid, "Internal", traceback.format_exc())

    def reset_after_fork(self, new_sock: socket.socket) -> None:
        """In a forked child: drop everything inherited from the parent, serve ``new_sock``.

        The parent's control socket, command pipes, timers and tables are closed
        or forgotten here, never signalled or waited for: the processes are the
        parent's. The inherited epoll instance is shared with the parent, so it
        is closed rather than unregistered from (epoll_ctl on it would remove
        the parent's registrations too). The loop picks up the new selector on
        its next iteration.
        """
        self._selector.close()
        self.sock.close()
        for hook in self._fork_hooks:
            hook()
        self._timers.clear()
        new_sock.set_inheritable(False)  # user code's os.system() must not inherit the channel
        self.sock = new_sock
        self._selector = self._new_selector()


def handle_ping(agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
    """``ping`` → ``{"pid", "protocol"}``: liveness, which process answers (it changes on
    fork), and the protocol version of its agent."""
    agent.done(req["rid"], {"pid": os.getpid(), "protocol": protocol.VERSION})
