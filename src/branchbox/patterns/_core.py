"""What every pattern shares: the candidate records, the outcome, and the one parallel runner.

A pattern is a ``Run``: it forks sandboxes (``branch``), runs user code in them
on threads (``run``, ``parallel``), closes the ones that can no longer win
(``prune``), and ends by merging its winner into the parent (``finish``).

Why threads over the blocking SDK: user callbacks are plain functions that
take a ``Sandbox``, and nearly all their time is spent waiting on the daemon,
so a thread per candidate gives real parallelism; the SDK sends every call
through one event loop, which serves them concurrently. A candidate's result
stays an object in this process (nothing is pickled or piped), so a large
result cannot block anything.

Killing: a loser is closed on the daemon, which kills everything running in
it; the thread that was waiting on it then gets an error, which is ignored.
Host-side code in a callback cannot be killed: its thread (a daemon thread)
is abandoned, and any call it makes to its closed sandbox fails.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, NamedTuple

from branchbox.sdk import Sandbox, SandboxError

Status = Literal["running", "done", "failed", "won", "lost", "aborted", "timed_out"]
"""``done``: finished, not yet ranked; ``failed``: its code raised; ``won``: merged into the
parent; ``lost``: finished but not chosen; ``aborted``: closed while running because it could
no longer win; ``timed_out``: closed while running when the pattern's timeout passed."""

Success = Callable[[Sandbox, Any], bool]
"""``success(child, result)``: did this candidate succeed?"""
Critique = Callable[[Sandbox, Any], str]
"""``critique(child, result)``: what went wrong, fed to the next attempt."""
Score = Callable[[Sandbox, Any], float | None]
"""``score(child, result)``: higher is better; None disqualifies the candidate (it cannot win,
its result is kept)."""


@dataclass(eq=False)
class Candidate:
    """One candidate of a pattern: where it ran and what came of it.

    ``index`` numbers the candidates of one outcome in the order they were forked;
    ``path`` is the branch taken at each fork level below the pattern's parent (``(i,)`` for
    the flat patterns, ``(2, 0)`` for the first child of the third node in a tree);
    ``round`` is the attempt, wave or tree level. ``feedback`` is the critique of a failed
    attempt (the exception's text if it raised). ``duration`` is seconds of wall-clock time
    in its own code (until it was aborted, if it was).
    """

    index: int
    sandbox_id: str
    path: tuple[int, ...]
    round: int = 0
    result: Any = None
    score: float | None = None
    error: BaseException | None = None
    feedback: str | None = None
    duration: float = 0.0
    status: Status = "running"

    @property
    def ok(self) -> bool:
        """It finished without raising (whatever its score)."""
        return self.status in ("done", "won", "lost")


@dataclass
class Outcome:
    """What a pattern did: every candidate (in ``index`` order) and the winner, if any.

    When ``winner`` is None nothing was merged and the parent is as it was.
    """

    pattern: str
    candidates: list[Candidate]
    winner: Candidate | None
    duration: float

    @property
    def result(self) -> Any:
        """The winner's result (None without a winner)."""
        return None if self.winner is None else self.winner.result


class PatternTimeout(SandboxError, TimeoutError):
    """The pattern's ``timeout`` passed: every sandbox it forked is closed, nothing was merged,
    and the parent is as it was. ``outcome`` records every candidate up to that moment."""

    hint = "the parent is unchanged; pass a larger timeout= or run fewer candidates"

    def __init__(self, message: str, outcome: Outcome) -> None:
        super().__init__(message)
        self.outcome = outcome


class Verdict(NamedTuple):
    """What a job returns for its candidate."""

    result: Any
    score: float | None = None
    feedback: str | None = None


Job = Callable[[Sandbox, Candidate], Verdict]
"""Runs on a candidate's thread: its code, then whatever judges it (score, success)."""


def scored(child: Sandbox, result: Any, score: Score) -> Verdict:
    """The verdict of a scored candidate; a NaN score fails it, as NaN cannot be ranked."""
    value = score(child, result)
    if value is not None and math.isnan(value := float(value)):
        raise ValueError("the score function returned NaN")
    return Verdict(result, value)


def checked(child: Sandbox, result: Any, success: Success | None,
            critique: Critique | None = None) -> Verdict:
    """Score 1.0 if ``success(child, result)`` (by default: the code returned), else 0.0 with
    feedback from ``critique`` (by default ``str(result)``)."""
    if success is None or success(child, result):
        return Verdict(result, 1.0)
    return Verdict(result, 0.0, critique(child, result) if critique else str(result))


def succeeded(candidate: Candidate) -> bool:
    """The race condition of the success patterns (``checked`` scores successes 1.0)."""
    return candidate.score == 1.0


def ranked(candidates: Iterable[Candidate | None]) -> list[Candidate]:
    """The finished candidates with a score, best first: highest score, ties to the lowest
    index."""
    finished = [c for c in candidates if c is not None and c.ok and c.score is not None]
    return sorted(finished, key=lambda c: (-(c.score or 0.0), c.index))


def best(candidates: Iterable[Candidate | None]) -> Candidate | None:
    """The first of ``ranked``, or None."""
    return next(iter(ranked(candidates)), None)


class _Expired(Exception):
    """The pattern's deadline passed (turned into ``PatternTimeout`` by ``Run``)."""


class Run:
    """One pattern invocation: its deadline, its candidates, and the sandboxes it holds open.

    Use it as a context manager: leaving it by an exception closes every sandbox it still
    holds, and the deadline becomes ``PatternTimeout``.
    """

    def __init__(self, pattern: str, parent: Sandbox, timeout: float | None) -> None:
        self.pattern = pattern
        self.parent = parent
        self.timeout = timeout
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        self.candidates: list[Candidate] = []
        self._open: dict[int, Sandbox] = {}  # candidate index -> its sandbox, until closed
        self._since: dict[int, float] = {}  # candidate index -> when its code started

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            return
        expired = isinstance(exc, _Expired)
        self.prune([], "timed_out" if expired else "aborted")
        if expired:
            raise PatternTimeout(f"{self.pattern} did not finish within its timeout of "
                                 f"{self.timeout} s", self.outcome(None)) from None

    def sandbox(self, candidate: Candidate) -> Sandbox:
        """The candidate's sandbox (while the run holds it open)."""
        return self._open[candidate.index]

    def branch(self, source: Candidate | None, n: int, round: int = 0) -> list[Candidate]:
        """Fork ``source``'s sandbox (None: the parent) ``n`` ways into new candidates."""
        self._check_deadline()
        children = (self.parent if source is None else self.sandbox(source)).fork(n)
        made = []
        for position, child in enumerate(children):
            path = (() if source is None else source.path) + (position,)
            candidate = Candidate(len(self.candidates), child.id, path, round)
            self.candidates.append(candidate)
            self._open[candidate.index] = child
            made.append(candidate)
        return made

    def expand(self, frontier: Sequence[Candidate | None], n: int, round: int,
               job: Job) -> list[Candidate]:
        """Fork every node of ``frontier`` ``n`` ways and run ``job`` in all the children at
        once (tree and beam search)."""
        children = [child for node in frontier for child in self.branch(node, n, round)]
        self.run(children, job)
        return children

    def run(self, candidates: Sequence[Candidate], job: Job,
            until: Callable[[Candidate], bool] | None = None) -> Candidate | None:
        """Run ``job`` in every candidate's sandbox at once and record what comes of each.

        With ``until``, the first candidate to finish for which it holds wins the race: the
        others are closed at once (those still running become ``aborted``) and it is
        returned. Returns None when every candidate has finished without that.
        """
        calls = [self._call(job, c) for c in candidates]
        for position, value, error, seconds in self.parallel(calls):
            candidate = candidates[position]
            candidate.duration = seconds
            if error is None:
                candidate.result, candidate.score, candidate.feedback = value
                candidate.status = "done"
            else:
                candidate.error, candidate.status = error, "failed"
                candidate.feedback = f"{type(error).__name__}: {error}"
            if until is not None and error is None and until(candidate):
                self.discard([c for c in candidates if c is not candidate])
                return candidate
        return None

    def waves(self, widths: Iterable[int], job: Callable[[list[Candidate]], Job]) -> Outcome:
        """Waves of forks of the parent, one after the other (reflexion, cascaded): each wave
        races on ``succeeded`` and its winner ends the pattern; a failed wave is closed before
        the next starts, whose job is ``job(the failed wave)``."""
        failed: list[Candidate] = []
        for wave, width in enumerate(widths):
            tried = self.branch(None, width, round=wave)
            if winner := self.run(tried, job(failed), until=succeeded):
                return self.finish(winner)
            self.discard(tried)
            failed = tried
        return self.finish(None)

    def _call(self, job: Job, candidate: Candidate) -> Callable[[], Verdict]:
        child = self._open[candidate.index]
        self._since[candidate.index] = time.monotonic()
        return lambda: job(child, candidate)

    def parallel(self, calls: Sequence[Callable[[], Any]]
                 ) -> Iterator[tuple[int, Any, BaseException | None, float]]:
        """Start every call on its own thread; yield ``(position, value, error, seconds)`` as
        each finishes, until all have or the deadline passes. Threads only hand results to
        this one, so the records are written by one thread and a late finisher changes
        nothing."""
        done: queue.SimpleQueue[tuple[int, Any, BaseException | None, float]] = \
            queue.SimpleQueue()
        for position, call in enumerate(calls):
            threading.Thread(target=_report, args=(position, call, done), daemon=True,
                             name=f"branchbox-{self.pattern}-{position}").start()
        for _ in calls:
            try:
                yield done.get(timeout=self._remaining())
            except queue.Empty:
                raise _Expired from None

    def prune(self, keep: Iterable[Candidate | None], running: Status = "aborted") -> None:
        """Close every sandbox the run holds except those of ``keep``."""
        kept = {c.index for c in keep if c is not None}
        self.discard([self.candidates[i] for i in self._open if i not in kept], running)

    def discard(self, candidates: Iterable[Candidate], running: Status = "aborted") -> None:
        """Close these candidates' sandboxes (killing what runs in them): a finished one is
        ``lost``, one still running gets the status ``running`` (``aborted``/``timed_out``)."""
        now = time.monotonic()
        for candidate in candidates:
            sandbox = self._open.pop(candidate.index, None)
            if sandbox is None:
                continue
            if candidate.status == "running":
                candidate.status = running
                candidate.duration = now - self._since.get(candidate.index, now)
            elif candidate.status == "done":
                candidate.status = "lost"
            sandbox.close()

    def finish(self, winner: Candidate | None) -> Outcome:
        """Merge ``winner`` (if any) into the parent, close every other sandbox, and return
        the outcome."""
        if winner is not None:
            self._check_deadline()
            self.parent.merge_into(self._open.pop(winner.index))
            winner.status = "won"
        self.prune([])
        return self.outcome(winner)

    def outcome(self, winner: Candidate | None) -> Outcome:
        return Outcome(self.pattern, self.candidates, winner, time.monotonic() - self.started)

    def _remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def _check_deadline(self) -> None:
        if self._remaining() == 0.0:
            raise _Expired


def _report(position: int, call: Callable[[], Any],
            done: queue.SimpleQueue[tuple[int, Any, BaseException | None, float]]) -> None:
    """A thread's body: run ``call`` and hand over its value or exception, with its time."""
    started = time.monotonic()
    try:
        value, error = call(), None
    except BaseException as exc:  # any failure is the candidate's record, not this thread's
        value, error = None, exc
    done.put((position, value, error, time.monotonic() - started))
