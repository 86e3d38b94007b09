"""Soak (issue 16, finding 9): 10,000 fork -> merge rounds, and what the daemon keeps.

Marked ``soak``: left out of the default run (pyproject's addopts) and run by
``make soak`` (about 10-20 minutes on 2 vCPU). ``BRANCHBOX_SOAK_ROUNDS`` changes the
number of rounds. The daemon must not keep a row, or memory, per round: its
database holds at most the closed-sandbox window (``engine.records.KEEP_CLOSED``)
plus what is live, and its memory after the last round is within a bound of what
it was after the first thousand.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from served import ServedDaemon

from branchbox import Sandbox
from branchbox.engine.records import KEEP_CLOSED

pytestmark = pytest.mark.soak

KEY = "soak-test-key"
ROUNDS = int(os.environ.get("BRANCHBOX_SOAK_ROUNDS", "10000"))
WARMUP = min(1000, ROUNDS // 10)
RSS_GROWTH_MIB = 32  # allocator noise and caches, far below a row or a body per round


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def rows(data_dir: Path) -> int:
    db = sqlite3.connect(f"file:{data_dir / 'sandboxes.db'}?mode=ro", uri=True)
    try:
        return db.execute("SELECT count(*) FROM sandboxes").fetchone()[0]
    finally:
        db.close()


@pytest.mark.timeout(4 * 3600)
def test_fork_merge_rounds_keep_the_daemon_bounded() -> None:
    daemon = ServedDaemon("soak", {**os.environ, "BRANCHBOX_API_KEY": KEY})
    try:
        with Sandbox(url=daemon.url, api_key=KEY) as sb:
            sb.run_code("state = 0")
            before = None
            for done in range(1, ROUNDS + 1):
                (child,) = sb.fork(1)
                child.run_code("state += 1")
                sb.merge_into(child)
                if done == WARMUP:
                    before = rss_mib(daemon.proc.pid)
            assert sb.run_code("state").text == str(ROUNDS)  # every merge took
            after, kept = rss_mib(daemon.proc.pid), rows(daemon.data_dir)
    finally:
        daemon.stop()
    print(f"\n{ROUNDS} rounds: daemon RSS {before:.0f} -> {after:.0f} MiB, {kept} rows")
    assert kept <= KEEP_CLOSED + 256 + 8, f"{kept} database rows after {ROUNDS} rounds"
    assert after - before <= RSS_GROWTH_MIB, \
        f"daemon RSS grew {after - before:.0f} MiB from round {WARMUP} to {ROUNDS}"
