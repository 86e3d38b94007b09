"""``best_of_n``: run the same task n times and keep the best-scoring result."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from branchbox.patterns._core import Candidate, Outcome, Run, Score, Verdict, best, scored
from branchbox.sdk import Sandbox


def best_of_n(sb: Sandbox, n: int = 3, *, task: Callable[[Sandbox, int], Any], score: Score,
              timeout: float | None = None) -> Outcome:
    """Run ``task(child, i)`` for i in 0..n-1, each in a fork of ``sb``, all at once; score
    each with ``score(child, result)`` (on the candidate's thread, so scoring is parallel too).

    The highest score wins, ties to the lowest index; a candidate whose task or score raised
    cannot win. The winner is merged into ``sb`` and the rest are closed; if every candidate
    failed nothing is merged. ``commit()`` stays the caller's. Past ``timeout`` seconds every
    fork is closed and ``PatternTimeout`` is raised, ``sb`` unchanged.
    """
    def job(child: Sandbox, candidate: Candidate) -> Verdict:
        return scored(child, task(child, candidate.index), score)

    with Run("best_of_n", sb, timeout) as run:
        candidates = run.branch(None, n)
        run.run(candidates, job)
        return run.finish(best(candidates))
