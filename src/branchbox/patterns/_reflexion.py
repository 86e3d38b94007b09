"""``reflexion``: try, critique the failure, and try again with the critique in hand."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from branchbox.patterns._core import Candidate, Critique, Job, Outcome, Run, Success, checked
from branchbox.sdk import Sandbox


def reflexion(sb: Sandbox, *, task: Callable[[Sandbox, int, str | None], Any],
              success: Success | None = None, critique: Critique | None = None,
              retries: int = 3, timeout: float | None = None) -> Outcome:
    """Run ``task(child, attempt, feedback)`` in a fresh fork of ``sb`` until it succeeds, at
    most ``retries + 1`` times, one attempt after the other (each needs the last one's
    critique).

    ``feedback`` is None for the first attempt, then the previous attempt's critique:
    ``critique(child, result)`` run in the failed fork (default ``str(result)``), or the
    exception's text if the task raised. Success is ``success(child, result)`` (default: the
    task returned), scored 1.0, a failure 0.0. A failed attempt's fork is closed before the
    next starts, so every attempt starts from ``sb`` as it was. The first success is merged
    into ``sb``; if none succeeds nothing is merged. ``commit()`` stays the caller's. Past
    ``timeout`` seconds the running attempt is closed and ``PatternTimeout`` is raised, ``sb``
    unchanged.
    """
    def attempt(failed: list[Candidate]) -> Job:
        feedback = failed[0].feedback if failed else None
        return lambda child, candidate: checked(
            child, task(child, candidate.round, feedback), success, critique)

    with Run("reflexion", sb, timeout) as run:
        return run.waves([1] * (retries + 1), attempt)
