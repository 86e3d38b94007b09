"""Showing results: rich tables with p50/p90/max and ratios, JSON, and the fork chart.

Ratios are computed here, from the rows' p50s, so the table and the JSON
always agree.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from branchbox.bench import Results
from branchbox.bench.measure import Ratio, Row

NOT_AVAILABLE = "n/a"


def ratio_value(row: Row, ratio: Ratio, rows: dict[str, Row]) -> float | None:
    """This row's p50 over the reference's (or the inverse for ``faster``); None if
    either was not measured."""
    mine, theirs = row.summary(), rows[ratio.ref].summary()
    if mine is None or theirs is None or not mine["p50"] or not theirs["p50"]:
        return None
    return theirs["p50"] / mine["p50"] if ratio.faster else mine["p50"] / theirs["p50"]


def ratio_text(value: float | None, ratio: Ratio) -> str:
    if value is None:
        return f"vs {ratio.ref}: {NOT_AVAILABLE}"
    if not ratio.faster:
        return f"{times(value)} {ratio.ref}"
    if value < 1:
        return f"{times(1 / value)} slower than {ratio.ref}"
    return f"{times(value)} faster than {ratio.ref}"


def times(value: float) -> str:
    return f"{value:.0f}×" if value >= 100 else f"{value:.1f}×" if value >= 10 else f"{value:.2g}×"


def number(value: float, unit: str) -> str:
    if unit == "children":
        return f"{value:.0f}"
    digits = 2 if value < 10 else 1 if value < 1000 else 0
    return f"{value:,.{digits}f} {unit}"


def all_rows(results: Results) -> dict[str, Row]:
    return {row.name: row for suite in results.suites for row in suite.rows}


def show(results: Results, console: Console) -> None:
    """One table per suite (and per extra table a suite asks for), then failures."""
    rows = all_rows(results)
    m = results.machine
    console.print(
        f"branchbox bench{' --quick' if results.quick else ''}: {m['cpus']} CPUs, "
        f"{m['memory_gib']} GiB, Linux {m['kernel']}, Python {m['python']}"
    )
    for suite in results.suites:
        tables: dict[str, list[Row]] = {}
        for row in suite.rows:
            tables.setdefault(row.table or suite.title, []).append(row)
        for title, group in tables.items():
            table = Table(title=f"{title}  [dim]({suite.name})[/dim]", title_justify="left")
            table.add_column("operation")
            for col in ("runs", "p50", "p90", "max"):
                table.add_column(col, justify="right")
            table.add_column("compared")
            for row in group:
                summary = row.summary()
                values = (
                    [NOT_AVAILABLE] * 4
                    if summary is None
                    else [str(summary["n"])]
                    + [number(summary[k], row.unit) for k in ("p50", "p90", "max")]
                )
                compared = [ratio_text(ratio_value(row, r, rows), r) for r in row.ratios]
                table.add_row(row.name, *values, "\n".join(compared + [row.note] * bool(row.note)))
            console.print(table)
    for suite in results.suites:
        if suite.error:
            console.print(f"[red]{suite.name} failed:[/red] {suite.error}")


def as_json(results: Results) -> dict[str, Any]:
    rows = all_rows(results)
    suites = {}
    for suite in results.suites:
        rendered = []
        for row in suite.rows:
            data = row.as_json()
            data["ratios"] = [{**asdict(r), "value": ratio_value(row, r, rows)} for r in row.ratios]
            rendered.append(data)
        suites[suite.name] = {
            "title": suite.title,
            "seconds": suite.seconds,
            "error": suite.error,
            "rows": rendered,
        }
    return {"machine": results.machine, "quick": results.quick, "suites": suites}


def write_json(results: Results, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(as_json(results), indent=2) + "\n")


def plot(results: Results, path: Path) -> bool:
    """Fork latency (p50) against n and against parent memory, with the floor dashed.
    Returns False when the run measured no fork rows (say ``--only create``). Only the
    fork suite's rows count: other suites' fork rows (the network suite's) have no
    parent size to place them by."""
    points = [
        r
        for r in all_rows(results).values()
        if r.params.get("kind") in ("fork", "floor") and "parent_mb" in r.params
        and r.summary()
    ]
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")  # no display; and before pyplot is imported
    import matplotlib.pyplot as plt

    def p50(row: Row) -> float:
        summary = row.summary()
        assert summary is not None  # filtered above
        return summary["p50"]

    states = sorted({r.params["parent_mb"] for r in points})
    sizes = sorted({r.params["n"] for r in points})
    fig, (by_n, by_mb) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, style in (("fork", "-o"), ("floor", "--")):
        mine = [r for r in points if r.params["kind"] == kind]
        label = "branchbox fork(n)" if kind == "fork" else "raw os.fork() ×n"
        # One colour per series, shared by our line and its floor.
        for color, mb in enumerate(states):
            line = sorted((r.params["n"], p50(r)) for r in mine if r.params["parent_mb"] == mb)
            by_n.plot(
                *zip(*line, strict=True),
                style,
                color=f"C{color}",
                label=f"{label}, parent {mb} MiB",
            )
        for color, n in enumerate(sizes):
            line = sorted((r.params["parent_mb"], p50(r)) for r in mine if r.params["n"] == n)
            by_mb.plot(*zip(*line, strict=True), style, color=f"C{color}", label=f"{label}, n={n}")
    by_n.set(
        xscale="log",
        yscale="log",
        xlabel="children n",
        ylabel="p50 latency (ms)",
        title="fork latency vs n",
    )
    by_mb.set(
        yscale="log",
        xlabel="parent state (MiB)",
        ylabel="p50 latency (ms)",
        title="fork latency vs parent memory",
    )
    for ax in (by_n, by_mb):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    m = results.machine
    fig.suptitle(
        f"branchbox bench: {m['cpus']} CPUs, {m['memory_gib']} GiB, Linux {m['kernel']}", fontsize=9
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
