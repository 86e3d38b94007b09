"""Sandbox creation with the image cached: what an agent waits for before its first line."""

from __future__ import annotations

from branchbox.bench.measure import Context, Row, timed
from branchbox.sdk import Sandbox

TITLE = "sandbox create"


def run(ctx: Context) -> list[Row]:
    ctx.sandbox().close()  # the first one warms the image and store caches
    ctx.step("create + close")
    return [Row("create (image cached)", timed(ctx.sandbox, ctx.pick(5, 20), Sandbox.close))]
