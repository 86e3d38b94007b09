"""Workspace commit micro-benchmark: crash-atomic commit of 1 KB / 100 KB / 1 MB, and abort.

Each run commits one modified file of the given size from an upper layer
into a host dir of 200 small files (the same work every run: the file is
replaced again), through the full path: delta, conflict check, staging with
fsync, journal, apply, fsync of the touched dirs, cleanup. "abort" is a
commit with nothing to do (the delta walk only), and "discard" deletes an
upper layer holding the 1 MB change, which is what closing a sandbox costs.

Three placements: everything on the ext4 host disk (plain copy), everything
on a btrfs loop image (reflink), and the realistic one, upper layer in a
btrfs store and host dir on ext4 (copy across filesystems). p50 over
``--runs`` runs, next to the BranchFS paper's numbers. Needs root (chown,
loop mount). Timings are reported, never asserted.

A second table commits ``--many`` new small files at once (23,000 by default:
the size of commit the fault suite of issue 16 timed at 18-27 s), upper layer in
the btrfs store and host dir on ext4, where the cost is how the commit makes its
staged files durable (one ``fsync`` each, or one ``syncfs`` of the filesystem).

    python benchmarks/bench_commit.py [--runs N] [--many N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.table import Table

from branchbox.storage import loopback
from branchbox.storage.workspace_commit import commit

console = Console(stderr=True)
SIZES = {"1 KB": 1024, "100 KB": 100 * 1024, "1 MB": 1024 * 1024}
BRANCHFS_US = {"1 KB": "317", "100 KB": "514", "1 MB": "2100", "abort": "315–890"}
SHIFT = 1_000_000


@contextmanager
def btrfs_image(under: Path) -> Iterator[Path]:
    """A fresh btrfs filesystem on a sparse image file, mounted; removed afterwards."""
    image, mnt = under / "bench.img", under / "mnt"
    with open(image, "wb") as f:
        f.truncate(2 << 30)
    loopback.format_btrfs(image, "bb-bench")
    mnt.mkdir()
    device = loopback.mount_image(image, mnt, "btrfs")
    try:
        yield mnt
    finally:
        loopback.unmount_image(mnt, device)


def make_tree(host: Path, size: int) -> None:
    for i in range(200):
        sub = host / f"d{i % 10}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i}.txt").write_text(f"file {i}\n")
    (host / "d0" / "target.bin").write_bytes(b"\0" * size)


def make_upper(upper: Path, size: int | None) -> None:
    upper.mkdir(parents=True)
    if size is not None:
        (upper / "d0").mkdir()
        target = upper / "d0" / "target.bin"
        target.write_bytes(os.urandom(size))
        os.chown(target, SHIFT, SHIFT)


def p50_us(fn: Callable[[], object], runs: int, setup: Callable[[], object] | None = None) -> float:
    samples = []
    for _ in range(runs):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(samples)


def measure(store: Path, workspace: Path, runs: int) -> dict[str, float]:
    """p50 µs of each size, abort and discard; upper layers in ``store``, host in ``workspace``."""
    row: dict[str, float] = {}
    for label, size in SIZES.items():
        host, upper = workspace / f"host-{size}", store / f"upper-{size}"
        make_tree(host, size)
        make_upper(upper, size)
        row[label] = p50_us(lambda h=host, u=upper: commit([u], h, since=time.time()), runs)
    empty = store / "upper-empty"
    make_upper(empty, None)
    host = workspace / f"host-{SIZES['1 MB']}"
    row["abort"] = p50_us(lambda: commit([empty], host, since=time.time()), runs)
    doomed = store / "upper-discard"
    row["discard 1 MB"] = p50_us(
        lambda: shutil.rmtree(doomed), runs, setup=lambda: make_upper(doomed, SIZES["1 MB"])
    )
    return row


def make_many(upper: Path, count: int) -> None:
    """``count`` new files of 1 KB in 100 directories of the upper layer."""
    upper.mkdir(parents=True)
    for i in range(count):
        sub = upper / f"m{i % 100}"
        if i < 100:
            sub.mkdir()
        (sub / f"f{i}.txt").write_bytes(os.urandom(1024))
    for path in upper.rglob("*"):
        os.chown(path, SHIFT, SHIFT)


def measure_many(store: Path, workspace: Path, count: int, runs: int) -> float:
    """Seconds (p50) to commit ``count`` new files into an empty host dir."""
    samples = []
    for i in range(runs):
        host, upper = workspace / f"many-{i}", store / f"many-{i}"
        host.mkdir(parents=True)
        make_many(upper, count)
        os.sync()  # the writes above are not the commit's to flush
        t0 = time.perf_counter()
        commit([upper], host, since=time.time())
        samples.append(time.perf_counter() - t0)
        shutil.rmtree(host)
        shutil.rmtree(upper)
    return statistics.median(samples)


def run(runs: int, many: int) -> dict:
    results: dict = {
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "runs": runs,
        "unit": "µs (p50)",
        "branchfs_paper_us": BRANCHFS_US,
        "rows": {},
    }
    base = Path(tempfile.mkdtemp(prefix="bb-bench-commit-", dir="/var/tmp"))
    try:
        ext4 = base / "ext4"
        ext4.mkdir()
        console.print("ext4 host disk …")
        results["rows"]["ext4 (host disk)"] = measure(ext4 / "store", ext4 / "ws", runs)
        with btrfs_image(base) as mnt:
            console.print("btrfs loop image …")
            results["rows"]["btrfs (loop image, reflink)"] = measure(
                mnt / "store", mnt / "ws", runs
            )
            console.print("btrfs store → ext4 host dir …")
            results["rows"]["store btrfs → host ext4"] = measure(mnt / "store2", ext4 / "ws2", runs)
            console.print(f"{many} files, btrfs store → ext4 host dir …")
            results["many"] = {
                "files": many,
                "seconds_p50": measure_many(mnt / "store3", ext4 / "ws3", many, max(1, runs // 10)),
            }
    finally:
        shutil.rmtree(base)
    return results


def show(results: dict) -> None:
    table = Table(title=f"workspace commit, p50 of {results['runs']} runs (µs)")
    columns = [*SIZES, "abort", "discard 1 MB"]
    table.add_column("placement")
    for column in columns:
        table.add_column(column, justify="right")
    for name, row in results["rows"].items():
        table.add_row(name, *(f"{row[c]:.0f}" for c in columns))
    table.add_row("BranchFS (paper)", *(BRANCHFS_US.get(c, "–") for c in columns))
    Console().print(table)
    many = results["many"]
    Console().print(f"commit of {many['files']} new 1 KB files, btrfs store → ext4 host dir: "
                  f"{many['seconds_p50']:.2f} s (p50)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--many", type=int, default=23_000)
    parser.add_argument("--json", type=Path, default=Path("bench-results/commit.json"))
    args = parser.parse_args()
    results = run(args.runs, args.many)
    show(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
