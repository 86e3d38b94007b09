"""Which sandbox was forked from which: kept only as far as live sandboxes need it.

merge_into checks that the winner descends from the parent, through ancestors
that may be closed already, so the engine keeps ``id -> (parent id, parent's
generation at the fork)`` past a close. Kept for ever, that is a row per fork
(the fault suite saw ~1 KB per fork/merge round); so the map is pruned to the
lines of ancestors of live sandboxes whenever it has grown well past them:
nothing a merge can still ask about is dropped, and its size stays bounded
by the live sandboxes' lines.
"""

from __future__ import annotations

from collections.abc import Iterable

Lineage = dict[str, tuple[str, int]]

SLACK = 64
"""Entries past twice the live sandboxes before a prune (amortizes its cost)."""


def prune_if_grown(lineage: Lineage, live: Iterable[str], live_count: int) -> None:
    if len(lineage) > 2 * live_count + SLACK:
        prune(lineage, live)


def prune(lineage: Lineage, live: Iterable[str]) -> None:
    """Drop the entries no live sandbox's line of ancestors passes through."""
    needed: set[str] = set()
    for sid in live:
        node = sid
        while node in lineage and node not in needed:
            needed.add(node)
            node = lineage[node][0]
    for sid in [s for s in lineage if s not in needed]:
        del lineage[sid]
