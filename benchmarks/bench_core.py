"""Core benchmarks: sandbox create, REPL round trip, exec, files, fork/merge/diff, memory.

End to end through the public SDK, against a daemon started for the run on
its local unix socket (btrfs store), as a user would see it. Prints a table
and writes JSON. The floor for fork is a raw os.fork() of this very process
holding the same amount of Python objects. Timings are reported, never
asserted.

    python benchmarks/bench_core.py [--quick] [--json FILE] [--children N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from branchbox import Sandbox

console = Console(stderr=True)


def timed(fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None,
          teardown: Callable[[object], None] | None = None) -> list[float]:
    """Seconds per call of ``fn`` over ``reps`` runs (setup/teardown excluded)."""
    samples = []
    for _ in range(reps):
        if setup:
            setup()
        t0 = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - t0)
        if teardown:
            teardown(out)
    return samples


def stats(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"n": len(samples), "p50_ms": 1000 * statistics.median(ordered),
            "p90_ms": 1000 * ordered[int(0.9 * (len(ordered) - 1))],
            "max_ms": 1000 * ordered[-1]}


def raw_fork_floor(megabytes: int, reps: int) -> list[float]:
    """os.fork() + child exit of this process while it holds ``megabytes`` of objects."""
    ballast = [bytes(1024) for _ in range(megabytes * 1024)]
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        samples.append(time.perf_counter() - t0)
        os.waitpid(pid, 0)
    del ballast
    gc.collect()
    return samples


def pss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1])
    return total


class Daemon:
    def __init__(self) -> None:
        self.data_dir = Path(tempfile.mkdtemp(prefix="branchbox-bench-"))
        self.data_dir.chmod(0o755)
        self.log = open(self.data_dir / "daemon.log", "wb")  # noqa: SIM115 - lives with us
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "branchbox", "serve", "--data-dir", str(self.data_dir)],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.url = f"unix://{self.data_dir / 'branchbox.sock'}"
        deadline = time.monotonic() + 120
        while not (self.data_dir / "branchbox.sock").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"daemon did not start: {self.data_dir / 'daemon.log'}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def run(quick: bool, max_children: int) -> dict:
    reps = 5 if quick else 20
    daemon = Daemon()
    results: dict = {"machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                                 "python": platform.python_version()}}
    rows = results["rows"] = {}

    def sandbox(**kw) -> Sandbox:
        return Sandbox(url=daemon.url, **kw)

    try:
        sandbox().close()  # the image is cached and the store is warm
        rows["create (image cached)"] = stats(timed(sandbox, reps, teardown=Sandbox.close))
        with sandbox() as sb:
            sb.run_code("1+1")
            rows["run_code 1+1"] = stats(timed(lambda: sb.run_code("1+1"), reps * 10))
            rows["exec true"] = stats(timed(lambda: sb.exec("true"), reps * 5))
            blob = os.urandom(1 << 20)
            rows["write 1 MB file"] = stats(timed(lambda: sb.files.write("/tmp/b", blob), reps))
            rows["read 1 MB file"] = stats(timed(lambda: sb.files.read("/tmp/b"), reps))

            def fork_close(n: int) -> Callable[[], object]:
                return lambda: sb.fork(n)

            def close_all(kids: object) -> None:
                for k in kids:  # type: ignore[attr-defined]
                    k.close()

            rows["fork(1), small parent"] = stats(timed(fork_close(1), reps, teardown=close_all))
            rows["fork(5), small parent"] = stats(timed(fork_close(5), reps, teardown=close_all))
            rows["fork(32), small parent"] = stats(timed(fork_close(32), max(3, reps // 4),
                                                         teardown=close_all))
        gib = 256 if quick else 1024
        with sandbox() as big:
            big.run_code(f"ballast = [bytes(1024) for _ in range({gib} * 1024)]", timeout=600)
            paused, kids_pss = [], []

            def fork5() -> list[Sandbox]:
                kids = big.fork(5)
                paused.append(big.info()["last_fork"]["repl_paused"])
                return kids

            def measure_and_close(kids: object) -> None:
                kids_pss.append(statistics.mean(
                    pss_kib(k.info()["resources"]["host_pids"]) for k in kids))  # type: ignore
                close_all(kids)

            rows[f"fork(5), parent holding {gib} MiB"] = stats(
                timed(fork5, reps, teardown=measure_and_close))
            rows["  parent REPL paused during that fork"] = stats(paused)
            rows[f"raw os.fork(), {gib} MiB process (floor)"] = stats(raw_fork_floor(gib, reps))
            results["pss_per_idle_child_kib"] = statistics.median(kids_pss)
        with sandbox() as parent:
            parent.run_code("state = 0")

            def merge_round() -> float:
                (child,) = parent.fork(1)
                child.run_code("state += 1")
                t0 = time.perf_counter()
                parent.merge_into(child)
                return time.perf_counter() - t0

            rows["merge_into"] = stats([merge_round() for _ in range(reps)])
            parent.exec("mkdir -p /root/tree && cd /root/tree && for d in $(seq 100); do "
                        "mkdir $d; for f in $(seq 100); do echo $d$f > $d/$f; done; done",
                        timeout=600)
            a, b = parent.fork(2)
            a.exec("for f in $(seq 10); do echo a >> /root/tree/1/$f; done")
            b.exec("for f in $(seq 10); do echo b >> /root/tree/2/$f; done")
            rows["diff, 10 changed files in a 10,000-file tree"] = stats(
                timed(lambda: a.diff(b, paths=["/root"]), reps))
            a.close()
            b.close()
        with sandbox() as parent:
            parent.run_code("import pandas as pd")
            kids: list[Sandbox] = []
            t0 = time.perf_counter()
            try:
                while len(kids) < max_children:
                    kids += parent.fork(min(32, max_children - len(kids)))
            except Exception as exc:  # noqa: BLE001 - the limit is what we measure
                results["live_children_stopped_by"] = f"{type(exc).__name__}: {exc}"
            results["live_children"] = len(kids)
            results["live_children_seconds"] = time.perf_counter() - t0
            pss = [pss_kib(k.info()["resources"]["host_pids"]) for k in kids[:: max(1, len(kids)
                                                                               // 50)]]
            results["pss_per_idle_child_of_pandas_parent_kib"] = statistics.median(pss)
            for k in kids:
                k.close()
    finally:
        daemon.stop()
    return results


def show(results: dict) -> None:
    table = Table(title="branchbox core benchmarks (SDK over the local unix socket)")
    for col in ("operation", "n", "p50 ms", "p90 ms", "max ms"):
        table.add_column(col, justify="right" if col != "operation" else "left")
    for name, row in results["rows"].items():
        table.add_row(name, str(row["n"]), f"{row['p50_ms']:.2f}", f"{row['p90_ms']:.2f}",
                      f"{row['max_ms']:.2f}")
    console.print(table)
    for key in ("pss_per_idle_child_kib", "pss_per_idle_child_of_pandas_parent_kib",
                "live_children", "live_children_seconds", "live_children_stopped_by"):
        if key in results:
            console.print(f"{key}: {results[key]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, 256 MiB parent")
    parser.add_argument("--json", type=Path, default=Path("bench-results/core.json"))
    parser.add_argument("--children", type=int, default=1000, help="live children to aim for")
    args = parser.parse_args()
    results = run(args.quick, args.children)
    show(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
