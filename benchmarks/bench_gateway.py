"""The gateway's cost: run_code and fork through it against straight to the node, and
creates per second across three nodes against one.

    python benchmarks/bench_gateway.py [--rounds 200] [--json FILE]

Three private daemons (each its own data directory and loopback port, as nodes) and a
``branchbox gateway`` in front of them. The added latency is measured on one sandbox,
called in alternating blocks straight (with the node key) and through the gateway (with
the client key), so both see the same machine. Creates: 30 by 6 threads, through the
gateway (spread over three nodes) and straight to one node. On one 2-vCPU machine the
three nodes share the same CPUs, so creates per second show the gateway's overhead and
spreading, not a cluster's capacity.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from branchbox import Sandbox
from branchbox.bench.daemon import Daemon, Gateway
from branchbox.engine.node import TAG_FILE, tag_of

NODE_KEY, CLIENT_KEY = "bench-node-key", "bench-client-key"
CREATES, THREADS = 30, 6


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return 1000 * (time.perf_counter() - started)


def latency(direct: Sandbox, routed: Sandbox, rounds: int) -> dict[str, dict[str, list[float]]]:
    """run_code and fork(1) of the same sandbox, in alternating blocks of 10."""
    out: dict[str, dict[str, list[float]]] = {
        op: {"direct": [], "gateway": []} for op in ("run_code", "fork")}

    def fork(sb: Sandbox) -> None:
        for child in sb.fork(1):
            child.close()

    for block in range(rounds // 10):
        for way, sb in (("direct", direct), ("gateway", routed))[::1 if block % 2 else -1]:
            for _ in range(10):
                out["run_code"][way].append(timed(lambda sb=sb: sb.run_code("1 + 1")))
            if block % 4 == 0:  # forks are ~10x dearer: a quarter as many
                for _ in range(5):
                    out["fork"][way].append(timed(lambda sb=sb: fork(sb)))
    return out


def creates_per_second(url: str, key: str) -> float:
    """Creates per second of CREATES creates by THREADS threads (closed afterwards)."""
    with ThreadPoolExecutor(THREADS) as pool:
        started = time.perf_counter()
        made = list(pool.map(lambda _: Sandbox(url=url, api_key=key), range(CREATES)))
        took = time.perf_counter() - started
        list(pool.map(lambda sb: sb.close(), made))
    return CREATES / took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", type=Path, default=Path("bench-results/gateway.json"))
    args = parser.parse_args()
    with ExitStack() as stack:
        nodes = [stack.enter_context(Daemon(api_key=NODE_KEY, node=f"node-{i}"))
                 for i in range(3)]
        gateway = stack.enter_context(Gateway([n.url for n in nodes], CLIENT_KEY, NODE_KEY))
        routed = stack.enter_context(Sandbox(url=gateway.url, api_key=CLIENT_KEY))
        node = next(n for n in nodes if _holds(n, routed.id))
        direct = Sandbox.connect(routed.id, url=node.url, api_key=NODE_KEY)
        times = latency(direct, routed, args.rounds)
        direct.detach()
        rates = {"gateway, 3 nodes": creates_per_second(gateway.url, CLIENT_KEY),
                 "straight to 1 node": creates_per_second(nodes[0].url, NODE_KEY)}
    rows = {f"{op} {way}": {"n": len(v), "p50_ms": statistics.median(v),
                            "p99_ms": percentile(v, 0.99)}
            for op, ways in times.items() for way, v in ways.items()}
    print(f"{'operation':<20}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}")
    for name, row in rows.items():
        print(f"{name:<20}{row['n']:>6}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}")
    for op in times:
        added = rows[f"{op} gateway"]["p50_ms"] - rows[f"{op} direct"]["p50_ms"]
        print(f"gateway adds {added:.2f} ms to {op} (p50)")
    for name, rate in rates.items():
        print(f"creates per second, {name}: {rate:.1f} ({CREATES} by {THREADS} threads)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "operations": rows, "creates_per_second": rates}, indent=2))
    print(f"wrote {args.json}")


def _holds(node: Daemon, sandbox_id: str) -> bool:
    """Whether ``node`` holds the sandbox (its id's tag is the node's own)."""
    return tag_of(sandbox_id) == (node.data_dir / TAG_FILE).read_text().strip()


if __name__ == "__main__":
    main()
