"""Checkpoints of a big parent: checkpoint and restore through the SDK, and what each
checkpoint adds to the family's memory.

Targets (issue 13): checkpoint and restore p50 ≤ 10 ms for a parent holding 1 GiB,
family PSS growth ≤ 1 MiB per checkpoint. A checkpoint is a frozen fork child, so
its cost is a fork's (the page-table copy grows with the parent's mapped memory);
its memory is shared with the parent until one of them writes.
"""

from __future__ import annotations

import time

from branchbox.bench.floor import ballast_code
from branchbox.bench.measure import Context, Row, rollup_mib, sandbox_pss_mib

TITLE = "checkpoints"


def run(ctx: Context) -> list[Row]:
    megabytes = ctx.pick(100, 1024)
    rounds = ctx.pick(5, 20)
    ctx.step(f"parent building {megabytes} MiB of state")
    with ctx.sandbox() as parent:
        parent.run_code(ballast_code(megabytes) + "; step = 0", timeout=600)
        alone = sandbox_pss_mib(parent)
        ctx.step(f"{rounds} checkpoints")
        took, cps = [], []
        for i in range(rounds):
            parent.run_code(f"step = {i}")
            t0 = time.perf_counter()
            cps.append(parent.checkpoint(f"step {i}"))
            took.append(1000 * (time.perf_counter() - t0))
        held = [cp.resources.get("host_pids") or [] for cp in parent.checkpoints()]
        family = sandbox_pss_mib(parent) + sum(rollup_mib(pids, ("Pss",)) for pids in held)
        growth = (family - alone) / rounds
        ctx.step(f"{rounds} restores")
        back = []
        for i in range(rounds):
            parent.run_code("step = -1")
            t0 = time.perf_counter()
            parent.restore(cps[i])
            back.append(1000 * (time.perf_counter() - t0))
        if parent.run_code("step").text != str(rounds - 1):
            raise RuntimeError("restore did not bring the checkpoint's state back")
    label = f"parent holding {megabytes} MiB"
    return [
        Row(f"checkpoint, {label}", took, note="target p50 ≤ 10 ms at 1 GiB"),
        Row(f"restore, {label}", back, note="target p50 ≤ 10 ms at 1 GiB"),
        Row(f"family PSS growth per checkpoint, {label}", [growth], "MiB",
            note=f"(parent + {rounds} checkpoints − parent alone) / {rounds}; target ≤ 1 MiB"),
    ]
