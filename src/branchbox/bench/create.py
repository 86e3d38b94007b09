"""Sandbox creation with the image cached: what an agent waits for before its first line.

The daemon keeps a few sandboxes started (its warm pool), so a create is a hand-out
when one is ready and a full start (two interpreter start-ups) when a burst has
drained the pool faster than it refills; both are measured, and bursts of creates
at once (agents starting a best-of-N together), each create's own latency.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from branchbox.bench.measure import Context, Row, close_all, timed
from branchbox.sdk import Sandbox

TITLE = "sandbox create"
REFILL_PAUSE = 1.0  # seconds: enough for the daemon to start a replacement


def run(ctx: Context) -> list[Row]:
    ctx.sandbox().close()  # the first one warms the image and store caches
    reps = ctx.pick(5, 20)
    ctx.step("create + close, with a pause for the warm pool to refill")

    def paused_close(sb: Sandbox) -> None:
        sb.close()
        time.sleep(REFILL_PAUSE)

    warm = Row("create, warm pool ready", timed(ctx.sandbox, reps, paused_close))
    ctx.step("create + close, back to back")
    burst = Row("create, back to back", timed(ctx.sandbox, reps, Sandbox.close),
                note="each closed first; the pool refills meanwhile")
    return [warm, burst, Row(f"create, {BURST} at once", _at_once(ctx, ctx.pick(2, 5)),
                             note="each create's own latency, from a refilled pool")]


BURST = 20


def _at_once(ctx: Context, bursts: int) -> list[float]:
    """Milliseconds of each create of ``bursts`` bursts of BURST concurrent creates."""
    samples: list[float] = []

    def one() -> tuple[float, Sandbox]:
        started = time.perf_counter()
        sandbox = ctx.sandbox()
        return (time.perf_counter() - started) * 1000, sandbox

    for n in range(bursts):
        ctx.step(f"{BURST} creates at once ({n + 1}/{bursts})")
        time.sleep(REFILL_PAUSE)
        with ThreadPoolExecutor(BURST) as pool:
            made = list(pool.map(lambda _: one(), range(BURST)))
        samples += [ms for ms, _ in made]
        close_all(sandbox for _, sandbox in made)
    return samples
