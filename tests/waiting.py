"""Waiting for something a test cannot be told about (a background thread's work, a
process's death), polling: the timeout bounds the wait, it is never what is tested."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def eventually(condition: Callable[[], bool], within: float = 30) -> bool:
    """Whether ``condition()`` became true within ``within`` seconds (polled every 0.1 s)."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def ended(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie, or reaped already)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, or going while read (ESRCH)
        return True
    return stat[stat.rindex(")") + 2] == "Z"
