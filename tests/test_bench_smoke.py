"""A smoke run of ``branchbox bench``: the shape of its table and JSON, never its timings
(benchmarks report numbers; tests must not fail on a slow machine)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import require_root
from typer.testing import CliRunner

from branchbox.cli import app


def test_bench_quick_run_code_prints_a_table_and_writes_json(tmp_path: Path) -> None:
    require_root()  # the bench starts its own daemon
    path = tmp_path / "bench.json"
    result = CliRunner().invoke(
        app, ["bench", "--quick", "--only", "run_code", "--json", str(path)]
    )
    assert result.exit_code == 0, result.output
    for header in ("operation", "p50", "p90", "max", "run_code 1+1"):
        assert header in result.output
    data = json.loads(path.read_text())
    assert data["quick"] is True and data["machine"]["cpus"] >= 1
    assert list(data["suites"]) == ["run_code"]
    suite = data["suites"]["run_code"]
    assert suite["error"] is None and suite["rows"]
    for row in suite["rows"]:
        assert row["unit"] == "ms"
        summary = row["summary"]
        assert summary["n"] == len(row["samples"]) > 0
        assert summary["p50"] <= summary["p90"] <= summary["max"]


def test_bench_forks_beside_sandlock_in_one_sitting(tmp_path: Path) -> None:
    """The side-by-side suite measures both: sandlock (a test dependency) is found, forks
    in its own process, and every point has our row and its row, each with samples."""
    require_root()
    path = tmp_path / "bench.json"
    result = CliRunner().invoke(
        app, ["bench", "--quick", "--only", "vs_sandlock", "--json", str(path)]
    )
    assert result.exit_code == 0, result.output
    suite = json.loads(path.read_text())["suites"]["vs_sandlock"]
    assert suite["error"] is None, suite["error"]
    rows = {row["name"]: row for row in suite["rows"]}
    for point in ("fork(1)", "fork(5)", "100 children"):
        ours, theirs = rows[f"{point}: branchbox"], rows[f"{point}: sandlock 0.9.0"]
        assert ours["samples"] and theirs["samples"], (ours, theirs)
        assert [ratio["ref"] for ratio in ours["ratios"]] == [theirs["name"]]
        assert "failed" not in theirs["note"], theirs["note"]
