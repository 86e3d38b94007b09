"""1,000 fork → run → merge_into rounds on one parent, as an agent exploring for a
long time does: round 1,000 must cost what round 1 did (layer chains stay bounded)."""

from __future__ import annotations

import time

from branchbox.bench.measure import Context, Ratio, Row

TITLE = "fork → merge rounds"


def run(ctx: Context) -> list[Row]:
    rounds = ctx.pick(40, 1000)
    window = rounds // 10
    samples = []
    with ctx.sandbox() as parent:
        parent.run_code("state = 0")
        for i in range(rounds):
            if i % 10 == 0:
                ctx.step(f"round {i + 1}/{rounds}")
            t0 = time.perf_counter()
            (child,) = parent.fork(1)
            child.run_code("state += 1")
            parent.merge_into(child)
            samples.append(1000 * (time.perf_counter() - t0))
        state = parent.run_code("state").text
        layers = parent.info()["layers"]
    first = Row(f"rounds 1–{window}", samples[:window])
    note = f"state after the last round: {state}; frozen layers: {layers}"
    return [
        Row("round 1", samples[:1]),
        first,
        Row(
            f"rounds {rounds - window + 1}–{rounds}",
            samples[-window:],
            ratios=[Ratio(first.name)],
            note=note,
        ),
        Row(f"round {rounds}", samples[-1:]),
    ]
