"""Podflare's event shape and the bounded per-sandbox log behind ``GET .../replay``.

Podflare's ``/exec`` streams ``{"type": "stdout"|"stderr"|"exit", "data", "seq",
"ts"}``, one output *line* per event without its newline (its SDK joins them
with ``"\\n"``), and keeps the recent events of each sandbox for replay. Runs
through the native endpoints are logged in the same shape, so a replay shows
everything that ran in the sandbox, whichever API started it.

The log is the server's: the engine need not know who watches its output.
Memory is bounded three ways: events per sandbox, bytes per sandbox, and the
number of sandboxes remembered (the least recently active are forgotten, which
also covers sandboxes the engine closed on its own, by timeout).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

MAX_EVENTS = 1000  # what Podflare's SDK documents for replay
MAX_LINE = 1 << 20
"""Characters of output one event carries: a longer line (or output that never ends a
line) goes out in pieces of this size, so a partial line is never held without bound."""
MAX_BYTES = 1 << 20
MAX_SANDBOXES = 256
GROUPED_AFTER = 4096
"""Lines in one agent event past which its whole lines go out several to an event,
joined by newlines (as Podflare's SDK joins events, so the text it shows is the same):
an event a line cost the daemon's event loop ~3 us a line, and a run printing 16 MB
of empty lines held every sandbox for seconds at a time (23 s of CPU in all)."""


@dataclass
class _Log:
    events: deque[dict] = field(default_factory=deque)
    size: int = 0
    seq: itertools.count = field(default_factory=itertools.count)


class EventLog:
    """Recent Podflare-shaped events of each sandbox; ``seq`` rises per sandbox across runs,
    so a client can order events from several calls."""

    def __init__(self, max_events: int = MAX_EVENTS, max_bytes: int = MAX_BYTES,
                 max_sandboxes: int = MAX_SANDBOXES) -> None:
        self._logs: OrderedDict[str, _Log] = OrderedDict()
        self._max_events, self._max_bytes = max_events, max_bytes
        self._max_sandboxes = max_sandboxes

    def record(self, sandbox_id: str, kind: str, data: str | int) -> dict:
        """Append one event (stamped with its ``seq`` and ``ts`` in ms) and return it."""
        log = self._logs.get(sandbox_id)
        if log is None:
            log = self._logs[sandbox_id] = _Log()
            if len(self._logs) > self._max_sandboxes:
                self._logs.popitem(last=False)
        self._logs.move_to_end(sandbox_id)
        event = {"type": kind, "data": data, "seq": next(log.seq), "ts": int(time.time() * 1000)}
        log.events.append(event)
        log.size += _size(event)
        while len(log.events) > self._max_events or log.size > self._max_bytes:
            log.size -= _size(log.events.popleft())
        return event

    def recent(self, sandbox_id: str) -> list[dict]:
        log = self._logs.get(sandbox_id)
        return list(log.events) if log else []

    def forget(self, sandbox_id: str) -> None:
        self._logs.pop(sandbox_id, None)


def _size(event: dict) -> int:
    data = event["data"]
    return len(data) if isinstance(data, str) else 8


class PodflareEvents:
    """Agent events of one run as Podflare's ``(type, data)`` pairs: whole lines of output,
    then the exit status (a Python exception is its traceback on stderr and status 1)."""

    def __init__(self, language: str) -> None:
        self._language = language
        # The unfinished line of each stream, as pieces: appending stays linear in the
        # output however it is cut (re-joining it per event would be quadratic).
        self._partial: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._partial_len = {"stdout": 0, "stderr": 0}

    def feed(self, header: dict) -> list[tuple[str, str | int]]:
        kind = header.get("ev")
        if kind in self._partial:
            data = header.get("data", "")
            return self._lines(kind, data if isinstance(data, str) else str(data))
        if kind != "done":
            return []
        result = header.get("result") or {}
        out = self._flush()  # the run is over: the rest of a line without its newline
        error = result.get("error") if self._language == "python" else None
        if error:
            text = error.get("traceback") or f"{error.get('name')}: {error.get('value')}\n"
            out += self._lines("stderr", text) + self._flush()
            return [*out, ("exit", 1)]
        code = result.get("exit_code", 0) if self._language == "bash" else 0
        return [*out, ("exit", -1 if code is None else code)]

    def _lines(self, kind: str, text: str) -> list[tuple[str, str | int]]:
        if text.count("\n") <= GROUPED_AFTER:
            return self._each_line(kind, text)
        first, last = text.find("\n"), text.rfind("\n")
        return [*self._each_line(kind, text[: first + 1]),  # ends the line begun before
                *((kind, piece) for piece in _grouped(text[first + 1 : last])),
                *self._each_line(kind, text[last + 1 :])]  # begins the next

    def _each_line(self, kind: str, text: str) -> list[tuple[str, str | int]]:
        out: list[tuple[str, str | int]] = []
        pieces = self._partial[kind]
        first, *rest = text.split("\n")
        for i, segment in enumerate((first, *rest)):
            if i:  # a newline ended the line before this segment
                out.append((kind, "".join(pieces)))
                pieces.clear()
                self._partial_len[kind] = 0
            while self._partial_len[kind] + len(segment) > MAX_LINE:
                cut = MAX_LINE - self._partial_len[kind]
                out.append((kind, "".join([*pieces, segment[:cut]])))
                pieces.clear()
                self._partial_len[kind] = 0
                segment = segment[cut:]
            if segment:
                pieces.append(segment)
                self._partial_len[kind] += len(segment)
        return out

    def _flush(self) -> list[tuple[str, str | int]]:
        out: list[tuple[str, str | int]] = [
            (k, "".join(pieces)) for k, pieces in self._partial.items() if pieces]
        for k in self._partial:
            self._partial[k] = []
            self._partial_len[k] = 0
        return out


def _grouped(text: str) -> list[str]:
    """``text``, whole lines joined by newlines, in pieces of at most MAX_LINE characters
    cut at newlines (a line longer than that is cut within, as an event a line cuts it)."""
    pieces = []
    at = 0
    while len(text) - at > MAX_LINE:
        cut = text.rfind("\n", at, at + MAX_LINE + 1)
        if cut < at:  # no newline within the limit: a long line, cut where the limit is
            pieces.append(text[at : at + MAX_LINE])
            at += MAX_LINE
        else:
            pieces.append(text[at:cut])
            at = cut + 1
    pieces.append(text[at:])
    return pieces
