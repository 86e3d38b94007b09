"""``cascaded``: waves of widening fan-out, each told why the last one failed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from branchbox.patterns._core import Candidate, Critique, Job, Outcome, Run, Success, checked
from branchbox.sdk import Sandbox


def cascaded(sb: Sandbox, *, task: Callable[[Sandbox, int, list[str]], Any],
             success: Success | None = None, critique: Critique | None = None,
             widths: Sequence[int] = (1, 2, 4), timeout: float | None = None) -> Outcome:
    """Run waves of ``widths[w]`` candidates, each ``task(child, index, feedback)`` in a fork
    of ``sb``: cheap first, wider only when needed. A wave's candidates run at once and the
    first to succeed wins, as in ``speculate``.

    ``index`` counts candidates across waves (0, then 1 2, then 3 4 5 6 for the default
    widths), so a task can vary its approach; ``feedback`` holds the previous wave's
    critiques, one per candidate (``critique(child, result)`` run in the failed fork, default
    ``str(result)``, or the exception's text if the task raised), empty for the first wave.
    Success is ``success(child, result)`` (default: the task returned), scored 1.0, a failure
    0.0. The winner is merged into ``sb`` and the rest of its wave closed at once; a failed
    wave is closed before the next starts. If no wave succeeds nothing is merged.
    ``commit()`` stays the caller's. Past ``timeout`` seconds every fork is closed and
    ``PatternTimeout`` is raised, ``sb`` unchanged.
    """
    def wave(failed: list[Candidate]) -> Job:
        feedback = [c.feedback or "" for c in failed]
        return lambda child, candidate: checked(
            child, task(child, candidate.index, feedback), success, critique)

    with Run("cascaded", sb, timeout) as run:
        return run.waves(widths, wave)
