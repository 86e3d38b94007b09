"""fork(n) beside sandlock's, in one sitting: the peer that forks fastest on one host.

sandlock (Landlock + seccomp, no namespaces) forks copy-on-write clones of an init
process: ``Sandbox(init_fn=..., work_fn=...).fork(n)`` runs ``init_fn`` once in a
confined child, forks it ``n`` times, runs ``work_fn`` in each clone and returns
once every clone has exited. Its time here includes that init and clones that run
nothing. Ours is the SDK's fork of a live sandbox until every child serves; ours
stay live (each with its own filesystem layer, namespaces, cgroup and address)
and are closed outside the timed span, while sandlock's end by themselves.

sandlock runs in a fresh interpreter of the bench's environment (``python -m
branchbox.bench.vs_sandlock N REPS`` prints its samples), installed there from the
host's package index when it is missing. If it cannot be installed, its rows say
why and ours are measured all the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from branchbox.bench.children import LOW_MEMORY_MIB, available_mib
from branchbox.bench.fork import SERVER_LIMIT, fork_many
from branchbox.bench.measure import Context, Ratio, Row, close_all

TITLE = "fork(n) beside sandlock"
SANDLOCK = "sandlock==0.9.0"  # the version the issue measured against
INSTALL_TIMEOUT = 300.0
MEASURE_TIMEOUT = 600.0


def run(ctx: Context) -> list[Row]:
    ctx.step(f"making sure {SANDLOCK} is installed")
    missing = _ensure_sandlock()
    if missing:
        ctx.progress.console.print(f"[yellow]sandlock is not measured: {missing}[/yellow]")
    rows: list[Row] = []
    with ctx.sandbox() as parent:
        parent.run_code("x = 1")
        for n in ctx.pick((1, 5), (1, 5, 32, 100)):
            reps = ctx.pick(3, 10 if n <= 5 else 5)
            ctx.step(f"fork({n}): branchbox")
            ours = []
            for _ in range(reps):
                forked = fork_many(parent, n)
                close_all(forked.children)
                ours.append(forked.ms)
            ctx.step(f"fork({n}): sandlock")
            rows += _pair(f"fork({n})", ours, n, reps, missing, forked.calls)
        rows += _many(ctx, parent, ctx.pick(100, 1000), missing)
    return rows


def _many(ctx: Context, parent, target: int, missing: str) -> list[Row]:
    """``target`` children at once: ours all live together (forked in calls of the
    server's limit), sandlock's forked in one call."""
    ctx.step(f"{target} children: branchbox")
    kids = []
    ms = 0.0
    calls = 0
    try:
        while len(kids) < target and available_mib() > LOW_MEMORY_MIB:
            forked = fork_many(parent, min(target - len(kids), SERVER_LIMIT))
            kids += forked.children
            ms += forked.ms
            calls += 1
    finally:
        made = len(kids)
        close_all(kids)
    if made < target:
        return [Row(f"{target} children", [], note=f"stopped at {made}: host memory "
                                                   f"available < {LOW_MEMORY_MIB} MiB")]
    ctx.step(f"{target} children: sandlock")
    return _pair(f"{target} children", [ms], target, 1, missing, calls)


def _pair(point: str, ours: list[float], n: int, reps: int, missing: str,
          calls: int) -> list[Row]:
    """Our row for ``point`` and sandlock's, measured now, each beside the other."""
    peer = f"{point}: sandlock {SANDLOCK.split('==')[1]}"
    note = "" if calls == 1 else f"{calls} calls: the server allows n ≤ {SERVER_LIMIT} per call"
    mine = Row(f"{point}: branchbox", ours, params={"n": n, "kind": "branchbox"},
               ratios=[] if missing else [Ratio(peer)], note=note)
    if missing:
        return [mine, Row(peer, [], params={"n": n, "kind": "sandlock"}, note=missing)]
    try:
        samples = _sandlock_samples(n, reps)
        note = "its init included; its clones run nothing and exit"
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        samples, note = [], f"sandlock failed: {exc}"
    return [mine, Row(peer, samples, params={"n": n, "kind": "sandlock"}, note=note)]


def _ensure_sandlock() -> str:
    """"" once sandlock imports in the bench's interpreter, else why it does not."""
    if _imports():
        return ""
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", SANDLOCK],
                              capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"pip install {SANDLOCK} failed: {exc}"
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"pip install {SANDLOCK} failed: {tail[0]}"
    return "" if _imports() else f"{SANDLOCK} installed but does not import"


def _imports() -> bool:
    return subprocess.run([sys.executable, "-c", "import sandlock"],
                          capture_output=True).returncode == 0


def _sandlock_samples(n: int, reps: int) -> list[float]:
    out = subprocess.run([sys.executable, "-m", "branchbox.bench.vs_sandlock", str(n),
                          str(reps)], check=True, capture_output=True, text=True,
                         timeout=MEASURE_TIMEOUT)
    return json.loads(out.stdout)


def _nothing(*_: object) -> None:
    """A clone's work, and the init: nothing, so only the forks are measured."""


def main() -> None:
    """Milliseconds per sandlock fork(n) over REPS runs, as JSON (in a fresh process)."""
    import sandlock  # noqa: PLC0415 - only in this process, which the suite made sure has it

    n, reps = map(int, sys.argv[1:3])
    sandlock.Sandbox(init_fn=_nothing, work_fn=_nothing).fork(1)  # its library loaded
    samples = []
    for _ in range(reps):
        box = sandlock.Sandbox(init_fn=_nothing, work_fn=_nothing)
        t0 = time.perf_counter()
        clones = box.fork(n)
        samples.append(1000 * (time.perf_counter() - t0))
        if len(clones) != n:
            raise SystemExit(f"sandlock made {len(clones)} of {n} clones")
    print(json.dumps(samples))


if __name__ == "__main__":
    main()
