"""``branchbox bench``: the performance story, measured side by side in one run.

Each suite is a small module (``TITLE`` and ``run(ctx) -> list[Row]``) run
against a private daemon (see ``daemon.py``) through the public SDK, so the
numbers are what a user sees. The comparisons the numbers need (raw
``os.fork()`` as the floor; fresh sandboxes re-running a setup; ``cp -r`` and
``git worktree``) run in the same process, on the same machine, at the same
time, and are shown as ratios. ``--only NAME`` runs one suite on its own.
"""

from __future__ import annotations

import os
import platform
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from branchbox.bench import (
    checkpoints,
    children,
    create,
    diff,
    fork,
    images,
    mcp_calls,
    memory,
    merge,
    network,
    restart,
    rounds,
    run_code,
    vs_sandlock,
    without_fork,
    workspace,
    workspace_io,
)
from branchbox.bench.daemon import Daemon
from branchbox.bench.measure import Context, Row

SUITES: dict[str, ModuleType] = {
    module.__name__.rsplit(".", 1)[1]: module
    for module in (
        create,
        run_code,
        fork,
        vs_sandlock,
        merge,
        checkpoints,
        restart,
        network,
        diff,
        memory,
        children,
        rounds,
        without_fork,
        workspace,
        workspace_io,
        mcp_calls,
        images,
    )
}


@dataclass
class SuiteResult:
    name: str
    title: str
    seconds: float
    rows: list[Row] = field(default_factory=list)
    error: str | None = None  # one failing suite does not cost the others' numbers


@dataclass
class Results:
    machine: dict[str, object]
    quick: bool
    suites: list[SuiteResult]


def machine() -> dict[str, object]:
    """What a reader needs to judge the numbers."""
    meminfo = Path("/proc/meminfo").read_text().split()
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(int(meminfo[1]) / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def run_suites(names: Sequence[str], quick: bool, console: Console) -> Results:
    """Run the named suites in order against one private daemon, showing progress."""
    results = Results(machine(), quick, [])
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Daemon() as daemon, Progress(*columns, console=console) as progress:
        overall = progress.add_task("suites", total=len(names))
        for name in names:
            module = SUITES[name]
            progress.update(overall, description=f"[bold]{name}[/bold]")
            task = progress.add_task("starting", total=None)
            t0 = time.perf_counter()
            suite = SuiteResult(name, module.TITLE, 0.0)
            try:
                suite.rows = module.run(Context(daemon.url, quick, progress, task))
            except Exception as exc:  # noqa: BLE001 - reported, and the next suite runs
                suite.error = f"{type(exc).__name__}: {exc}"
                console.print(f"[red]suite {name} failed:[/red]\n{traceback.format_exc()}")
            suite.seconds = time.perf_counter() - t0
            results.suites.append(suite)
            # Also the only progress a log file gets (no live display off a terminal).
            progress.console.log(
                f"{name}: {'failed' if suite.error else 'done'} in {suite.seconds:.0f} s"
            )
            progress.remove_task(task)
            progress.advance(overall)
    return results
