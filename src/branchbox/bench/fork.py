"""fork(n) for n = 1, 5, 32, 100 of parents holding 0, 100 MiB and 1 GiB, each beside
its floor (raw ``os.fork()`` n times of a plain process holding the same), how
long the parent's REPL is paused by each fork, and where a one-call fork's time
goes: the engine's phases (``last_fork["phases"]``) and what is left outside the
engine (SDK, HTTP, server).

The time is the SDK's fork call until every child is running; the read of the daemon's
timings after it and the closing of the children are outside the timed span.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from branchbox.bench.floor import ballast_code, floor_samples
from branchbox.bench.measure import Context, Ratio, Row, close_all
from branchbox.sdk import Sandbox

TITLE = "fork(n) against the floor"
PAUSE_TITLE = "parent REPL paused during fork(n)"
HUGE_TITLE = "parent REPL heap on 2 MiB pages (AnonHugePages)"
PHASES_TITLE = "where a fork's time goes (engine phases, then outside the engine)"
SERVER_LIMIT = 32  # the server's default largest n per call (API.md)


@dataclass
class Forked:
    """What one fork(n) gave: the children, the milliseconds the fork calls took (the
    ``info()`` reads of the daemon's timings after each are not counted), the daemon's
    ``last_fork`` (its ``repl_paused`` summed over the calls), and how many calls."""

    children: list[Sandbox]
    ms: float
    last: dict
    calls: int


def fork_many(parent: Sandbox, n: int) -> Forked:
    """fork(n) in one call if the server allows it, else in calls of SERVER_LIMIT."""
    sizes = [SERVER_LIMIT] * (n // SERVER_LIMIT) + [n % SERVER_LIMIT] * bool(n % SERVER_LIMIT)
    out = Forked([], 0.0, {}, len(sizes))
    paused = 0.0
    for size in sizes:
        t0 = time.perf_counter()
        out.children += parent.fork(size)
        out.ms += 1000 * (time.perf_counter() - t0)
        out.last = parent.info()["last_fork"]
        paused += out.last["repl_paused"]
    if out.calls > 1:  # one call's phases are not the whole fork's
        out.last = {"repl_paused": paused}
    return out


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    for megabytes in ctx.pick((0, 100), (0, 100, 1024)):
        ctx.step(f"parent building {megabytes} MiB of state")
        with ctx.sandbox() as parent:
            parent.run_code(ballast_code(megabytes), timeout=600)
            rows.append(_huge_pages(parent, megabytes))
            for n in ctx.pick((1, 5, 32), (1, 5, 32, 100)):
                rows += _cell(ctx, parent, megabytes, n)
    return rows


def _huge_pages(parent: Sandbox, megabytes: int) -> Row:
    """How much of the parent REPL's memory is on huge pages: a fork copies one page
    table entry per 2 MiB of it instead of 512 (agent/huge_heap.py)."""
    huge = parent.info()["resources"].get("repl_anon_huge_bytes", 0)
    return Row(f"parent holding {megabytes} MiB", [huge / (1 << 20)], "MiB", table=HUGE_TITLE,
               params={"parent_mb": megabytes, "kind": "anon_huge"})


def _cell(ctx: Context, parent: Sandbox, megabytes: int, n: int) -> list[Row]:
    """The rows of one (parent state, n) point: floor, fork, pause."""
    reps = ctx.pick(2, 10 if n <= 5 else 5 if n <= SERVER_LIMIT else 3)
    ctx.step(f"fork({n}), parent holding {megabytes} MiB")
    samples: list[float] = []
    pauses: list[float] = []
    engine: list[dict] = []  # each one-call fork's last_fork
    for _ in range(reps):
        forked = fork_many(parent, n)
        close_all(forked.children)
        samples.append(forked.ms)
        pauses.append(1000 * forked.last["repl_paused"])
        if "phases" in forked.last:
            engine.append(forked.last)
    params = {"n": n, "parent_mb": megabytes}
    note = "" if forked.calls == 1 else (f"{forked.calls} calls: the server allows "
                                         f"n ≤ {SERVER_LIMIT} per call")
    floor = Row(
        f"raw os.fork() ×{n}, {megabytes} MiB process",
        floor_samples(megabytes, n, reps),
        params={**params, "kind": "floor"},
        note="the floor",
    )
    return [
        floor,
        *_phases(engine, samples, n, megabytes),
        Row(
            f"fork({n}), parent holding {megabytes} MiB",
            samples,
            params={**params, "kind": "fork"},
            ratios=[Ratio(floor.name)],
            note=note,
        ),
        Row(
            f"paused: fork({n}), parent holding {megabytes} MiB",
            pauses,
            table=PAUSE_TITLE,
            params={**params, "kind": "pause"},
            note=note,
        ),
    ]


def _phases(engine: list[dict], samples: list[float], n: int, megabytes: int) -> list[Row]:
    """One row per engine phase of these forks, and the rest of each call: the SDK, HTTP
    and the server around the engine (the call's time less the engine's total)."""
    if not engine or len(engine) != len(samples):
        return []
    point = f"fork({n}), parent holding {megabytes} MiB"
    params = {"n": n, "parent_mb": megabytes}
    rows = [Row(f"{point}: {name}", [1000 * last["phases"][name] for last in engine],
                table=PHASES_TITLE, params={**params, "kind": f"phase_{name}"})
            for name in engine[0]["phases"]]
    outside = [ms - 1000 * last["total"] for ms, last in zip(samples, engine, strict=True)]
    return [*rows, Row(f"{point}: SDK, HTTP, server", outside, table=PHASES_TITLE,
                       params={**params, "kind": "phase_outside"})]
