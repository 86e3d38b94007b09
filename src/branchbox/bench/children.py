"""The most live children one parent gets on this machine: fork in batches until the
server refuses, the target is reached, or the host runs low on memory (a benchmark
must not take the machine down with it)."""

from __future__ import annotations

import time
from pathlib import Path

from branchbox.bench.fork import SERVER_LIMIT
from branchbox.bench.measure import Context, Row, close_all, sandbox_pss_mib
from branchbox.sdk import Sandbox, SandboxError

TITLE = "live children of one parent"
LOW_MEMORY_MIB = 2048


def available_mib(meminfo: Path = Path("/proc/meminfo")) -> float:
    line = next(x for x in meminfo.read_text().splitlines() if x.startswith("MemAvailable:"))
    return int(line.split()[1]) / 1024


def run(ctx: Context) -> list[Row]:
    target = ctx.pick(SERVER_LIMIT, 1000)
    kids: list[Sandbox] = []
    stopped_by = f"the target of {target}"
    with ctx.sandbox() as parent:
        parent.run_code("import pandas as pd")
        t0 = time.perf_counter()
        try:
            while len(kids) < target:
                if available_mib() < LOW_MEMORY_MIB:
                    stopped_by = f"host memory available < {LOW_MEMORY_MIB} MiB"
                    break
                ctx.step(f"{len(kids)} live children")
                kids += parent.fork(min(SERVER_LIMIT, target - len(kids)))
        except SandboxError as exc:  # the limit is what we measure
            stopped_by = f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - t0
        try:
            ctx.step(f"PSS of {len(kids)} idle children")
            pss = [sandbox_pss_mib(k) for k in kids[:: max(1, len(kids) // 50)]]
        finally:
            ctx.step(f"closing {len(kids)} children")
            close_all(kids)
    return [
        Row(
            "live children (parent: python + pandas imported)",
            [len(kids)],
            "children",
            note=f"stopped by {stopped_by}",
        ),
        Row("time to fork them all", [seconds], "s", note=f"in calls of ≤{SERVER_LIMIT}"),
        Row("idle child of that parent", pss, "MiB"),
    ]
