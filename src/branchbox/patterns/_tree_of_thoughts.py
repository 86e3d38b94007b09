"""``tree_of_thoughts``: grow a tree of nested forks, expanding every promising node."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from branchbox.patterns._core import (
    Candidate,
    Outcome,
    Run,
    Score,
    Verdict,
    best,
    ranked,
    scored,
)
from branchbox.sdk import Sandbox


def tree_of_thoughts(sb: Sandbox, *, step: Callable[[Sandbox, tuple[int, ...]], Any],
                     evaluate: Score, branching: int = 2, depth: int = 2,
                     threshold: float | None = None, timeout: float | None = None) -> Outcome:
    """Breadth-first search over nested forks: fork ``sb`` ``branching`` ways, run
    ``step(child, path)`` in each and score it with ``evaluate(child, result)``; then fork
    every node scoring at least ``threshold`` (every node, without one) the same way, down to
    ``depth`` levels. A level's nodes run at once.

    ``path`` names the node: the branch taken at each level, ``(1,)`` then ``(1, 0)``..., so
    ``step`` knows which thought to try; a node's fork carries everything its ancestors did.
    The best node of the whole tree wins (highest score, ties to the lowest index, so to the
    shallower): a child that scores worse than its parent does not replace it. A node that
    raised is pruned. Nodes that can no longer win or grow are closed after each level. The
    winner is merged into ``sb``; if every node failed nothing is merged. ``commit()`` stays
    the caller's. Past ``timeout`` seconds every fork is closed and ``PatternTimeout`` is
    raised, ``sb`` unchanged.
    """
    def job(child: Sandbox, node: Candidate) -> Verdict:
        return scored(child, step(child, node.path), evaluate)

    with Run("tree_of_thoughts", sb, timeout) as run:
        frontier: list[Candidate | None] = [None]
        leader: Candidate | None = None
        for level in range(depth):
            grown = run.expand(frontier, branching, level, job)
            leader = best([leader, *grown])
            frontier = [node for node in ranked(grown)
                        if threshold is None or (node.score or 0.0) >= threshold]
            run.prune([leader, *frontier])
            if not frontier:
                break
        return run.finish(leader)
