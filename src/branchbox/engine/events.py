"""The daemon's lifecycle event bus: what ``GET /v1/events`` and the ``/ui`` page watch.

The engine publishes one event per create, start (of a stopped sandbox), fork
(of a sandbox or of a checkpoint), merge, close, REPL death (``gone``), pause,
resume, run (``exec``: ``run_code`` and commands), workspace commit, checkpoint
and restore: one ``self.events.publish(kind, record, ...)`` line where each
completes.

Every event is a small JSON-able dict: ``id`` (rising by one per event, per
daemon), ``type``, ``ts`` (epoch seconds), ``sandbox``, ``parent``, ``family``
and the kind's own fields (``children`` of a fork, the ``winner`` of a merge, the
bounded output of a run).

Bounded by design: the bus keeps one ring of the most recent events (by count
and by bytes) and nothing per subscriber but a cursor into it. Publishing never
waits and never grows with the number or the speed of subscribers; a subscriber
that falls so far behind that the ring moved past its cursor is told how many
events it lost (a ``lost`` notice) and goes on from the oldest event still held.
The same ring serves resumption (``since``), so a client that reconnects with
the last id it saw misses nothing the ring still holds.

Everything a run's event carries from the sandbox (code, output, error text) is
hostile input: it is coerced to text and cut to a few KiB before it is kept.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shlex
import time
from collections import deque
from collections.abc import AsyncIterator

from branchbox.engine.records import SandboxRecord

RING_BYTES = 8 << 20
MAX_TEXT = 2048
"""Characters of code, stdout and stderr one ``exec`` event keeps (the tail of output,
where a result or an error is)."""
_RUN_OPS = ("run_code", "exec")


class EventBus:
    """The ring of recent events and the wake-up of everyone waiting for the next one."""

    def __init__(self, max_events: int, max_bytes: int = RING_BYTES) -> None:
        self._ring: deque[tuple[dict, int]] = deque()  # (event, its size in bytes)
        self._bytes = 0
        self._max_events, self._max_bytes = max(1, max_events), max_bytes
        self._ids = itertools.count(1)
        self.last_id = 0
        self._changed = asyncio.Event()

    def publish(self, kind: str, record: SandboxRecord, **fields: object) -> dict:
        """Append an event about ``record``'s sandbox and wake every subscriber; never waits."""
        self.last_id = next(self._ids)
        event = {"id": self.last_id, "type": kind, "ts": time.time(), "sandbox": record.id,
                 "parent": record.parent_id, "family": record.family, **fields}
        size = len(json.dumps(event, default=str))
        self._ring.append((event, size))
        self._bytes += size
        while len(self._ring) > self._max_events or self._bytes > self._max_bytes:
            self._bytes -= self._ring.popleft()[1]
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return event

    def oldest_id(self) -> int:
        """The id of the oldest event held (``last_id + 1`` when none is)."""
        return self._ring[0][0]["id"] if self._ring else self.last_id + 1

    def recent(self, kind: str | None = None) -> list[dict]:
        """The events held, oldest first (only those of type ``kind``, if given)."""
        return [e for e, _ in self._ring if kind is None or e["type"] == kind]

    def after(self, cursor: int) -> tuple[int, list[dict]]:
        """(events lost, events held) after id ``cursor``. An id this bus never gave (a
        client of an earlier daemon) counts as a loss of unknown size, ``-1``."""
        if cursor > self.last_id:
            return -1, self.recent()
        first = self.oldest_id()
        lost = max(0, first - cursor - 1)
        start = max(cursor + 1, first) - first
        return lost, [e for e, _ in itertools.islice(self._ring, start, None)]

    async def subscribe(self, since: int | None = None,
                        keepalive: float = 15.0) -> AsyncIterator[dict | None]:
        """Events after id ``since`` (held ones first), or from now on without it; ``None``
        after ``keepalive`` seconds without one, so a stream can show it is alive.

        A ``{"type": "lost", "count": n, "resume": id}`` notice (no ``id`` of its own)
        comes where ``n`` events were dropped before the subscriber read them (``-1``:
        unknown, ``since`` came from an earlier daemon)."""
        cursor = self.last_id if since is None else since
        while True:
            waiter = self._changed  # taken before reading: a publish after it wakes us
            lost, events = self.after(cursor)
            if lost:
                yield {"type": "lost", "count": lost,
                       "resume": events[0]["id"] if events else self.last_id + 1}
            for event in events:
                yield event
            if events:
                cursor = events[-1]["id"]
            elif lost:  # nothing held after it: go on from now
                cursor = self.last_id
            else:
                try:
                    await asyncio.wait_for(waiter.wait(), keepalive)
                except TimeoutError:
                    yield None

    async def watch_run(self, record: SandboxRecord, op: str, args: dict | None,
                        events: AsyncIterator[tuple[dict, bytes]]
                        ) -> AsyncIterator[tuple[dict, bytes]]:
        """``events`` of an agent request, passed through unchanged; a run (``run_code``,
        ``exec``) also publishes one ``exec`` event when it ends, however it ends."""
        if op not in _RUN_OPS:
            async for item in events:
                yield item
            return
        run = _RunOutput(op, args or {})
        try:
            async for item in events:
                run.feed(item[0])
                yield item
        except BaseException as exc:
            run.failed(exc)
            raise
        finally:
            await events.aclose()  # type: ignore[attr-defined]
            self.publish("exec", record, **run.summary())


class _RunOutput:
    """The bounded record of one run: what ran, the tail of its output, how it ended."""

    def __init__(self, op: str, args: dict) -> None:
        self.op = op
        source = args.get("code") if op == "run_code" else args.get("cmd")
        if isinstance(source, list):
            source = shlex.join(str(part) for part in source)
        self.source = _cut(str(source or ""), head=True)
        self.background = bool(args.get("background"))
        self.started = time.monotonic()
        self.out = {"stdout": _Tail(), "stderr": _Tail()}
        self.result: dict = {}
        self.answered = False

    def feed(self, header: dict) -> None:
        kind = header.get("ev")
        if kind in self.out:
            self.out[kind].add(header.get("data", ""))
        elif kind == "done":
            self.answered = True
            result = header.get("result")
            self.result = result if isinstance(result, dict) else {}

    def failed(self, exc: BaseException) -> None:
        if self.answered:  # closed after its answer (a caller that read all it needed)
            return
        if isinstance(exc, GeneratorExit | asyncio.CancelledError):
            name, message = "Abandoned", "the caller went away; the run was interrupted"
        else:
            name = type(exc).__name__
            message = getattr(exc, "message", None) or str(exc) or name
        self.result = {"error": {"name": name, "value": message}}

    def summary(self) -> dict:
        error = self.result.get("error")
        if isinstance(error, dict):
            error = {"name": _cut(str(error.get("name", ""))),
                     "value": _cut(str(error.get("value", "")))}
        exit_code = self.result.get("exit_code")
        return {"op": self.op, "code": self.source, "background": self.background,
                "stdout": self.out["stdout"].text(), "stderr": self.out["stderr"].text(),
                "text": _cut(str(self.result["text"])) if self.result.get("text") else None,
                "error": error or None,
                "exit_code": exit_code if isinstance(exit_code, int) else None,
                "duration": round(time.monotonic() - self.started, 6)}


class _Tail:
    """The last ``MAX_TEXT`` characters of a stream, kept in constant memory."""

    def __init__(self) -> None:
        self._pieces: deque[str] = deque()
        self._len = 0
        self.cut = False

    def add(self, data: object) -> None:
        piece = data if isinstance(data, str) else str(data)
        if len(piece) > MAX_TEXT:
            piece, self.cut = piece[-MAX_TEXT:], True
        self._pieces.append(piece)
        self._len += len(piece)
        while self._len - len(self._pieces[0]) >= MAX_TEXT:
            self._len -= len(self._pieces.popleft())
            self.cut = True

    def text(self) -> str:
        text = "".join(self._pieces)
        if self.cut or len(text) > MAX_TEXT:
            return "…" + text[-MAX_TEXT:]
        return text


def _cut(text: str, head: bool = False) -> str:
    if len(text) <= MAX_TEXT:
        return text
    return text[:MAX_TEXT] + "…" if head else "…" + text[-MAX_TEXT:]
