"""The seven exploration patterns, built only on the public SDK.

Each takes a parent ``Sandbox``, forks it, runs candidates in the children (at
once where the pattern allows), merges the winner into the parent, closes the
losers (killing whatever still runs in them) and returns an ``Outcome`` that
records every candidate's result, score, error, duration and sandbox id.
``commit()`` of a workspace stays the caller's decision.

Failures of candidate code are recorded, not raised: a candidate whose code
raised cannot win, and when nothing wins the parent is left as it was. The
wall-clock ``timeout`` of a pattern is the one thing that raises:
``PatternTimeout``, carrying the outcome so far, with every fork closed and
the parent unchanged.
"""

from __future__ import annotations

from branchbox.patterns._beam_search import beam_search
from branchbox.patterns._best_of_n import best_of_n
from branchbox.patterns._cascaded import cascaded
from branchbox.patterns._core import Candidate, Outcome, PatternTimeout
from branchbox.patterns._reflexion import reflexion
from branchbox.patterns._speculate import speculate
from branchbox.patterns._tournament import tournament
from branchbox.patterns._tree_of_thoughts import tree_of_thoughts

__all__ = [
    "Candidate",
    "Outcome",
    "PatternTimeout",
    "beam_search",
    "best_of_n",
    "cascaded",
    "reflexion",
    "speculate",
    "tournament",
    "tree_of_thoughts",
]
