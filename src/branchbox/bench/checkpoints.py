"""Checkpoints of a big parent: checkpoint and restore through the SDK, what each
checkpoint adds to the family's memory, and a snapshot of it that sandboxes start from.

Targets (issue 13): checkpoint and restore p50 ≤ 10 ms for a parent holding 1 GiB,
family PSS growth ≤ 1 MiB per checkpoint. A checkpoint is a fork of the REPL that
runs nothing (engine.checkpoints), so its own pages are few: the row charged to its
cgroup. Its page tables are a copy of the REPL's, made by the fork before the process
joins its own cgroup (so charged to the sandbox's): their own row, since PSS leaves
kernel memory out. The family grows by more, because every page the parent writes
after a checkpoint is copied (copy-on-write keeps the checkpoint's instant): here, the
pages one ``run_code`` and one checkpoint call of the parent touch.
"""

from __future__ import annotations

import time

from branchbox import Sandbox
from branchbox.bench.floor import ballast_code
from branchbox.bench.measure import (
    Context,
    Row,
    page_tables_mib,
    rollup_mib,
    sandbox_pss_mib,
)

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
        listed = parent.checkpoints()
        held = [cp.resources.get("host_pids") or [] for cp in listed]
        charged = [(cp.resources.get("memory_bytes") or 0) / 2**20 for cp in listed]
        family = sandbox_pss_mib(parent) + sum(rollup_mib(pids, ("Pss",)) for pids in held)
        tables = [page_tables_mib(pids) for pids in held]
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
        ctx.step(f"a snapshot, {rounds} sandboxes started from it")
        t0 = time.perf_counter()
        name = parent.snapshot()["name"]
        kept = [1000 * (time.perf_counter() - t0)]
        started = []
        try:
            for _ in range(rounds):
                t0 = time.perf_counter()
                with ctx.sandbox(snapshot=name) as fresh:
                    started.append(1000 * (time.perf_counter() - t0))
                    if fresh.run_code("step").text != str(rounds - 1):
                        raise RuntimeError("a sandbox started from a snapshot lacks its state")
        finally:
            Sandbox.delete_snapshot(name, url=ctx.url)
    label = f"parent holding {megabytes} MiB"
    return [
        Row(f"checkpoint, {label}", took, note="target p50 ≤ 10 ms at 1 GiB"),
        Row(f"restore, {label}", back, note="target p50 ≤ 10 ms at 1 GiB"),
        Row(f"family PSS growth per checkpoint, {label}", [growth], "MiB",
            note=f"(parent + {rounds} checkpoints − parent alone) / {rounds}; target ≤ 1 MiB"),
        Row(f"memory charged to a checkpoint's cgroup, {label}", charged, "MiB",
            note="its own pages; pages the parent copied are the parent's"),
        Row(f"page tables of a checkpoint's process, {label}", tables, "MiB",
            note="a copy of the REPL's, charged to the sandbox's cgroup; not in PSS"),
        Row(f"snapshot, {label}", kept, note="a checkpoint kept beyond its sandbox"),
        Row(f"create from that snapshot, {label}", started,
            note="Sandbox(snapshot=...): a fork of it, a new sandbox"),
    ]
