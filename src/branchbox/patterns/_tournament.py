"""``tournament``: n candidates, then pairwise elimination by a judge."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from branchbox.patterns._core import Candidate, Outcome, Run, Verdict
from branchbox.sdk import Sandbox

Judge = Callable[[Sandbox, Any, Sandbox, Any], bool]
"""``judge(a, a_result, b, b_result)``: True if ``a`` is at least as good as ``b``."""


def tournament(sb: Sandbox, n: int = 4, *, task: Callable[[Sandbox, int], Any], judge: Judge,
               timeout: float | None = None) -> Outcome:
    """Run ``task(child, i)`` for i in 0..n-1, each in a fork of ``sb``, all at once; then
    eliminate pairwise until one is left.

    Each round pairs the survivors in index order (0 v 1, 2 v 3...; an odd one out goes
    through) and asks ``judge(a, a_result, b, b_result)`` with ``a`` the lower index, so a
    tie (True) goes to the lower index. A round's matches are judged at once; each match's
    loser is closed as soon as its verdict is in. A candidate whose task raised forfeits.
    ``score`` records the matches a candidate won. The last one standing is merged into
    ``sb``; if every task raised nothing is merged. ``commit()`` stays the caller's. An
    exception from ``judge`` closes every fork and propagates. Past ``timeout`` seconds every
    fork is closed and ``PatternTimeout`` is raised, ``sb`` unchanged.
    """
    def job(child: Sandbox, candidate: Candidate) -> Verdict:
        return Verdict(task(child, candidate.index), 0.0)

    with Run("tournament", sb, timeout) as run:
        entrants = run.branch(None, n)
        run.run(entrants, job)
        alive = [c for c in entrants if c.ok]
        run.prune(alive)
        while len(alive) > 1:
            matches = list(zip(alive[0::2], alive[1::2], strict=False))
            calls = [functools.partial(judge, run.sandbox(a), a.result, run.sandbox(b), b.result)
                     for a, b in matches]
            through = alive[len(matches) * 2:]  # the odd one out
            for position, first_wins, error, _ in run.parallel(calls):
                if error is not None:
                    raise error
                a, b = matches[position]
                winner, loser = (a, b) if first_wins else (b, a)
                winner.score = (winner.score or 0.0) + 1
                through.append(winner)
                run.discard([loser])
            alive = sorted(through, key=lambda c: c.index)
        return run.finish(alive[0] if alive else None)
