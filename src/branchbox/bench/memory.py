"""What a child costs in memory, idle and after it writes 10 MiB, from
/proc/PID/smaps_rollup of the sandbox's host processes.

PSS splits each shared page among its sharers, so an idle child of a big
parent shows a share of the parent's state; "private" is what only the child
maps (what closing it gives back); the family's PSS growth over the parent's
alone, per child, is the honest marginal cost.
"""

from __future__ import annotations

from branchbox.bench.floor import ballast_code
from branchbox.bench.measure import (
    Context,
    Row,
    close_all,
    sandbox_private_mib,
    sandbox_pss_mib,
)
from branchbox.sdk import Sandbox

TITLE = "memory per child"
CHILDREN = 5


def run(ctx: Context) -> list[Row]:
    megabytes = ctx.pick(100, 1024)
    ctx.step(f"parent building {megabytes} MiB of state")
    with ctx.sandbox() as parent:
        parent.run_code(ballast_code(megabytes), timeout=600)
        alone = sandbox_pss_mib(parent)
        kids = parent.fork(CHILDREN)
        try:
            ctx.step("memory of idle children")
            idle = _measure(parent, kids, alone)
            ctx.step("memory after each child writes 10 MiB")
            for kid in kids:
                kid.run_code("touched = b'x' * (10 << 20)")
            touched = _measure(parent, kids, alone)
        finally:
            close_all(kids)
    rows = [Row(f"parent holding {megabytes} MiB, alone (PSS)", [alone], "MiB")]
    for when, (pss, private, marginal) in (("idle", idle), ("after writing 10 MiB", touched)):
        rows += [
            Row(f"child {when}: PSS", pss, "MiB"),
            Row(f"child {when}: private", private, "MiB"),
            Row(
                f"child {when}: family PSS growth per child",
                [marginal],
                "MiB",
                note=f"(parent + {CHILDREN} children − parent alone) / {CHILDREN}",
            ),
        ]
    return rows


def _measure(
    parent: Sandbox,
    kids: list[Sandbox],
    alone: float,
) -> tuple[list[float], list[float], float]:
    pss = [sandbox_pss_mib(k) for k in kids]
    family = sandbox_pss_mib(parent) + sum(pss)
    return pss, [sandbox_private_mib(k) for k in kids], (family - alone) / len(kids)
