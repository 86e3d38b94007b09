"""The SDK's own deadline for a call with a ``timeout``, slightly above the server's.

The server ends a run at its timeout, and stops it hard a few seconds later
(``engine.run_guard``); a client must still not wait for ever on a server that
hangs, or on a network that drops the answer. So a call given ``timeout``
seconds gives up after ``timeout + CLIENT_GRACE`` with ``SandboxTimeout``; it
closes its connection, which the server takes as abandonment: the call is
interrupted, or never run if it was still queued behind a busy sandbox.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from branchbox.sdk._errors import SandboxTimeout

T = TypeVar("T")

CLIENT_GRACE = 5.0
"""Seconds past a call's timeout the SDK waits: the server's hard stop (3 s) and a margin."""


async def within(timeout: float | None, call: Awaitable[T], what: str) -> T:
    """``await call``, but at most ``timeout + CLIENT_GRACE`` seconds (no bound without a
    timeout: a run may legitimately last hours)."""
    if timeout is None:
        return await call
    limit = timeout + CLIENT_GRACE
    bound = asyncio.timeout(limit)
    try:
        async with bound:
            return await call
    except TimeoutError:
        if not bound.expired():  # the server's own SandboxTimeout
            raise
        raise SandboxTimeout(
            f"{what} got no answer within {limit:g} s ({timeout:g} s timeout + "
            f"{CLIENT_GRACE:g} s); the connection was closed, so the server interrupts the "
            "call (or never runs it, if it was still queued)") from None
