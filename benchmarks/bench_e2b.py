"""E2B's SDK against branchbox, beside branchbox's own SDK, on the same daemon.

    python benchmarks/bench_e2b.py [--rounds 10] [--e2b-python .venv-e2b/bin/python]
                                   [--json FILE]

A private daemon on loopback TCP (E2B's SDKs speak only TCP) serves both. Each
operation runs ``--rounds`` times with each SDK: create a sandbox, a small cell,
a command, a 1 MiB write and read, fork into 3, kill. The E2B side runs in the
virtualenv that holds E2B's SDKs (``tests/e2b_sdk.py`` makes it), so what is
measured is the published client, unchanged, through our E2B translation. Prints
p50 and max per operation in milliseconds and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from branchbox import Sandbox
from branchbox.bench.daemon import Daemon

KEY = "bench-e2b-key"
OPS = ("create", "run_code", "command", "write_1MiB", "read_1MiB", "fork_3", "kill")
DEFAULT_E2B_PYTHON = Path(__file__).resolve().parent.parent / ".venv-e2b" / "bin" / "python"

# Runs with E2B's python: the same operations through its SDK; prints {op: [seconds]}.
E2B_SIDE = """
import json, sys, time
from e2b_code_interpreter import Sandbox
rounds, ops = int(sys.argv[1]), json.loads(sys.argv[2])
times = {op: [] for op in ops}
data = b"x" * (1 << 20)

def timed(op, call):
    started = time.perf_counter()
    result = call()
    times[op].append(time.perf_counter() - started)
    return result

for _ in range(rounds):
    sbx = timed("create", Sandbox.create)
    timed("run_code", lambda: sbx.run_code("x = 1; x"))
    timed("command", lambda: sbx.commands.run("true"))
    timed("write_1MiB", lambda: sbx.files.write("/tmp/blob", data))
    timed("read_1MiB", lambda: sbx.files.read("/tmp/blob", format="bytes"))
    kids = timed("fork_3", lambda: sbx.fork(count=3))
    for kid in kids:
        kid.kill()
    timed("kill", sbx.kill)
print(json.dumps(times))
"""


def native(url: str, rounds: int) -> dict[str, list[float]]:
    """The same operations through branchbox's own SDK."""
    times: dict[str, list[float]] = {op: [] for op in OPS}
    data = b"x" * (1 << 20)

    def timed(op: str, call: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        result = call()
        times[op].append(time.perf_counter() - started)
        return result

    def one_round() -> None:
        sbx: Sandbox = timed("create", lambda: Sandbox(url=url, api_key=KEY))
        timed("run_code", lambda: sbx.run_code("x = 1; x"))
        timed("command", lambda: sbx.exec("true"))
        timed("write_1MiB", lambda: sbx.files.write("/tmp/blob", data))
        timed("read_1MiB", lambda: sbx.files.read("/tmp/blob"))
        for kid in timed("fork_3", lambda: sbx.fork(n=3)):
            kid.close()
        timed("kill", sbx.close)

    for _ in range(rounds):
        one_round()
    return times


def summary(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {op: {"p50_ms": round(statistics.median(v) * 1000, 2),
                 "max_ms": round(max(v) * 1000, 2)} for op, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--e2b-python", type=Path, default=DEFAULT_E2B_PYTHON)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not args.e2b_python.exists():
        sys.exit(f"no E2B SDK virtualenv at {args.e2b_python}: run tests/test_e2b_compat.py "
                 "once (it makes it) or pass --e2b-python")
    with Daemon(api_key=KEY) as daemon:
        Sandbox(url=daemon.url, api_key=KEY).close()  # the image and warm pool are ready
        env = {"E2B_API_URL": daemon.url, "E2B_SANDBOX_URL": daemon.url, "E2B_API_KEY": KEY,
               "PATH": "/usr/bin:/bin"}
        side = [str(args.e2b_python), "-c", textwrap.dedent(E2B_SIDE), str(args.rounds),
                json.dumps(OPS)]
        done = subprocess.run(side, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the E2B side failed:\n{done.stderr}")
        results = {"e2b": summary(json.loads(done.stdout)),
                   "branchbox": summary(native(daemon.url, args.rounds))}
    print(f"{'operation':<12} {'E2B SDK p50':>12} {'native p50':>11} {'E2B max':>9} "
          f"{'native max':>11}   (ms, {args.rounds} rounds)")
    for op in OPS:
        e, n = results["e2b"][op], results["branchbox"][op]
        print(f"{op:<12} {e['p50_ms']:>12.1f} {n['p50_ms']:>11.1f} {e['max_ms']:>9.1f} "
              f"{n['max_ms']:>11.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rounds": args.rounds, "machine": platform.node(),
                                         "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
