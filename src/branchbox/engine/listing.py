"""A directory listing as a sandbox's agent sends it, checked batch by batch.

The agent runs in the sandbox, beside the user's code, so what it answers is hostile
input: a batch is passed on only once every entry in it has an entry's fields, each of
its type (a name or path of any characters; a finite time, since a NaN would break the
JSON of the answer already under way).
"""

from __future__ import annotations

import json

from branchbox.engine import errors
from branchbox.engine.answers import ENTRY


def entries(payload: bytes) -> list[dict]:
    """The entries of one "chunk" event of a ``list`` answer (a JSON array)."""
    try:
        batch = json.loads(payload)
    except (ValueError, RecursionError):  # "[" * 60,000: deeper than json.loads goes
        batch = None
    if not isinstance(batch, list) or not all(map(_is_entry, batch)):
        raise errors.EngineError("the sandbox's agent answered a malformed listing")
    return batch


def _is_entry(entry: object) -> bool:
    """An entry's fields, only they, each of its type (the shape a ``stat`` answers)."""
    return (isinstance(entry, dict) and entry.keys() == ENTRY.keys()
            and all(check(entry[key]) for key, check in ENTRY.items()))
