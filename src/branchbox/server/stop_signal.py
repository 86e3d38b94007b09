"""SIGTERM as a clean stop for a listener run by uvicorn (the daemon, the MCP server over
HTTP, the gateway).

uvicorn shuts down on SIGTERM, then raises it again under the handler that was in place
before it: exiting with status 0 there is a clean stop, not a death by signal, and the
listener's ``finally`` blocks (a socket file removed) still run.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from types import FrameType


def _exit_cleanly(_signum: int, _frame: FrameType | None) -> None:
    sys.exit(0)


@contextlib.contextmanager
def sigterm_exits_cleanly() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
