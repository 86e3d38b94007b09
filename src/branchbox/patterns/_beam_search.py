"""``beam_search``: nested forks, keeping only the best few nodes of each level."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from branchbox.patterns._core import Candidate, Outcome, Run, Score, Verdict, ranked, scored
from branchbox.sdk import Sandbox


def beam_search(sb: Sandbox, *, step: Callable[[Sandbox, tuple[int, ...]], Any],
                evaluate: Score, width: int = 2, branching: int = 2, depth: int = 3,
                timeout: float | None = None) -> Outcome:
    """Fork each node of the beam (at first just ``sb``) ``branching`` ways, run
    ``step(child, path)`` in every child at once and score it with ``evaluate(child,
    result)``; the ``width`` best children (ties to the lowest index) are the next beam, the
    others are closed at once. Repeat ``depth`` times.

    ``path`` names the node: the branch taken at each level, e.g. ``(1, 0)``. The best node
    of the last level that had a success wins (a level where every node raised ends the
    search early). The winner is merged into ``sb``; if the first level already failed
    nothing is merged. ``commit()`` stays the caller's. Past ``timeout`` seconds every fork
    is closed and ``PatternTimeout`` is raised, ``sb`` unchanged.
    """
    def job(child: Sandbox, node: Candidate) -> Verdict:
        return scored(child, step(child, node.path), evaluate)

    with Run("beam_search", sb, timeout) as run:
        beam: list[Candidate | None] = [None]
        for level in range(depth):
            grown = run.expand(beam, branching, level, job)
            if not (survivors := ranked(grown)[:width]):
                break
            beam = list(survivors)
            run.prune(beam)
        return run.finish(beam[0])
