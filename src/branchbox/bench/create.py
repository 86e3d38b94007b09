"""Sandbox creation with the image cached: what an agent waits for before its first line.

The daemon keeps a few sandboxes started (its warm pool), so a create is a hand-out
when one is ready and a full start (two interpreter start-ups) when a burst has
drained the pool faster than it refills; both are measured.
"""

from __future__ import annotations

import time

from branchbox.bench.measure import Context, Row, timed
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
    ctx.step("create + close, back to back (drains the warm pool)")
    burst = Row("create, back to back", timed(ctx.sandbox, reps, Sandbox.close),
                note="mostly full starts once the pool is drained")
    return [warm, burst]
