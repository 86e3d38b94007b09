"""``speculate``: race different candidates; the first to succeed wins."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from branchbox.patterns._core import (
    Candidate,
    Outcome,
    Run,
    Success,
    Verdict,
    checked,
    succeeded,
)
from branchbox.sdk import Sandbox


def speculate(sb: Sandbox, candidates: Sequence[Callable[[Sandbox, int], Any]], *,
              success: Success | None = None, timeout: float | None = None) -> Outcome:
    """Run ``candidates[i](child, i)`` in a fork of ``sb`` each, all at once; the first to
    succeed wins.

    Success is ``success(child, result)`` (by default: the candidate returned without
    raising); it is scored 1.0, anything else 0.0. The moment one succeeds the others are
    closed, killing what runs in them, and the winner is merged into ``sb``; without a success
    nothing is merged. ``commit()`` stays the caller's. ``timeout`` bounds the whole pattern:
    past it every fork is closed and ``PatternTimeout`` is raised, ``sb`` unchanged.
    """
    def job(child: Sandbox, candidate: Candidate) -> Verdict:
        return checked(child, candidates[candidate.index](child, candidate.index), success)

    with Run("speculate", sb, timeout) as run:
        return run.finish(run.run(run.branch(None, len(candidates)), job, until=succeeded))
