"""merge_into: the parent takes over a child that has diverged (ran code)."""

from __future__ import annotations

import time

from branchbox.bench.measure import Context, Row

TITLE = "merge_into"


def run(ctx: Context) -> list[Row]:
    ctx.step("fork(1) → run → merge_into")
    samples = []
    with ctx.sandbox() as parent:
        parent.run_code("state = 0")
        for _ in range(ctx.pick(5, 20)):
            (child,) = parent.fork(1)
            child.run_code("state += 1")
            t0 = time.perf_counter()
            parent.merge_into(child)
            samples.append(1000 * (time.perf_counter() - t0))
    return [Row("merge_into a diverged child", samples)]
