"""Load: many concurrent clients, each creating, running, forking, merging and closing.

    python benchmarks/bench_load.py [--clients 50] [--rounds 3] [--json FILE] [--url URL]

Each client (one asyncio task, its own SDK connection) does ``--rounds`` times:
create a sandbox, run a cell, fork it 2-4 ways, run a cell in a child, merge that
child back, close everything. It runs against a private daemon (as ``branchbox
bench`` does), so the numbers include HTTP over the unix socket; or, with ``--url``,
against a running server or gateway (its key in ``$BRANCHBOX_API_KEY``). Prints p50/p99/max
per operation and the error count, and writes them as JSON. Issue 16's target on a
2-vCPU machine: p99 create and p99 fork at most 1 s, no errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import time
import traceback
from pathlib import Path

from branchbox import AsyncSandbox
from branchbox.bench.daemon import Daemon

OPS = ("create", "run_code", "fork", "merge_into", "close")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


async def client(url: str, rounds: int, seed: int, times: dict[str, list[float]],
                 errors: list[str]) -> None:
    rng = random.Random(seed)

    async def timed(op: str, call):
        started = time.perf_counter()
        result = await call
        times[op].append(time.perf_counter() - started)
        return result

    for _ in range(rounds):
        sb = None
        try:
            sb = await timed("create", AsyncSandbox(url=url).start())
            await timed("run_code", sb.run_code("x = list(range(10000)); len(x)"))
            children = await timed("fork", sb.fork(rng.randint(2, 4)))
            winner = rng.choice(children)
            await winner.run_code("x.append(1)")
            await timed("merge_into", sb.merge_into(winner))
            for child in children:
                if child is not winner:
                    await timed("close", child.close())
        except Exception as exc:  # counted and shown: the target is zero
            errors.append(f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
        finally:
            if sb is not None:
                try:
                    await timed("close", sb.close())
                except Exception as exc:
                    errors.append(f"close: {type(exc).__name__}: {exc}")


async def load(url: str, clients: int, rounds: int) -> tuple[dict[str, list[float]], list[str],
                                                              float]:
    times: dict[str, list[float]] = {op: [] for op in OPS}
    errors: list[str] = []
    started = time.perf_counter()
    await asyncio.gather(*(client(url, rounds, seed, times, errors) for seed in range(clients)))
    return times, errors, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("bench-results/load.json"))
    parser.add_argument("--url", help="a running server or gateway instead of a private "
                                      "daemon (its key in $BRANCHBOX_API_KEY)")
    args = parser.parse_args()
    with contextlib.nullcontext(args.url) if args.url else Daemon() as target:
        url = target if isinstance(target, str) else target.url
        times, errors, wall = asyncio.run(load(url, args.clients, args.rounds))
    rows = {op: {"n": len(v), "p50_ms": 1000 * statistics.median(v),
                 "p99_ms": 1000 * percentile(v, 0.99), "max_ms": 1000 * max(v)}
            for op, v in times.items() if v}
    print(f"{args.clients} clients x {args.rounds} rounds in {wall:.1f} s, "
          f"{len(errors)} errors")
    print(f"{'operation':<12}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for op, row in rows.items():
        print(f"{op:<12}{row['n']:>6}{row['p50_ms']:>10.1f}{row['p99_ms']:>10.1f}"
              f"{row['max_ms']:>10.1f}")
    for error in sorted(set(errors))[:10]:
        print("error:", error)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "clients": args.clients, "rounds": args.rounds, "seconds": wall,
        "errors": errors, "operations": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
