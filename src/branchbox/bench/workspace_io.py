"""Workspace branches against BranchFS's published numbers: branch creation on trees of
100 / 1,000 / 10,000 files, commit and abort of 1 KB / 100 KB / 1 MB of changes, and a
sequential read of a 50 MB file in 64 KB blocks inside a workspace against the same
read on the host.

BranchFS (paper): create 292–317 µs, commit 317 µs / 514 µs / 2.1 ms for
1 KB / 100 KB / 1 MB, abort 315–890 µs, 50 MB read at 19% of native through FUSE
(82% with passthrough). Our numbers include the SDK's HTTP round trip; the read is
timed inside the sandbox, where an agent's code runs.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from branchbox.bench.measure import Context, Ratio, Row, timed
from branchbox.bench.tree import make_tree

TITLE = "workspace branches (BranchFS's measures)"
BLOCK = 64 * 1024
READ_MB = 50
_READ = (
    "import time\n"
    "t0 = time.perf_counter()\n"
    "with open({path!r}, 'rb', buffering=0) as f:\n"
    f"    while f.read({BLOCK}):\n"
    "        pass\n"
    "print(1000 * (time.perf_counter() - t0))\n"
)


def _host_read_ms(path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(BLOCK):
            pass
    return 1000 * (time.perf_counter() - t0)


def run(ctx: Context) -> list[Row]:
    reps = ctx.pick(3, 10)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tmp.chmod(0o755)
        for files in ctx.pick((100, 1000), (100, 1000, 10000)):
            ctx.step(f"workspace branch of a {files}-file tree")
            tree = make_tree(tmp / str(files), max(1, files // 100), min(files, 100))
            rows.append(Row(f"create: Sandbox(workspace=) of a {files}-file tree",
                            timed(lambda tree=tree: ctx.sandbox(workspace=str(tree)), reps,
                                  after=lambda sb: sb.close())))
        repo = tmp / "repo"
        repo.mkdir()
        for size, label in ((1 << 10, "1 KB"), (100 << 10, "100 KB"), (1 << 20, "1 MB")):
            ctx.step(f"commit and abort of {label}")
            commits, aborts = [], []
            for i in range(reps):
                with ctx.sandbox(workspace=str(repo)) as sb:
                    sb.files.write(f"{repo}/change-{size}-{i}", os.urandom(size))
                    t0 = time.perf_counter()
                    sb.commit()
                    commits.append(1000 * (time.perf_counter() - t0))
                sb = ctx.sandbox(workspace=str(repo))
                sb.files.write(f"{repo}/dropped-{size}-{i}", os.urandom(size))
                t0 = time.perf_counter()
                sb.close()  # abort: the changes go with the sandbox
                aborts.append(1000 * (time.perf_counter() - t0))
            rows.append(Row(f"commit() of {label} of changes", commits))
            rows.append(Row(f"abort (close) with {label} of changes", aborts))
        ctx.step(f"sequential read of a {READ_MB} MB file")
        big = repo / "big.bin"
        with open(big, "wb") as f:
            for _ in range(READ_MB * 16):
                f.write(os.urandom(BLOCK))
        _host_read_ms(big)  # warm the page cache: both sides read from memory
        host = Row(f"read {READ_MB} MB in 64 KB blocks on the host",
                   [_host_read_ms(big) for _ in range(reps)])
        with ctx.sandbox(workspace=str(repo)) as sb:
            code = _READ.format(path=str(big))
            inside = [float(sb.run_code(code).stdout) for _ in range(reps)]
        rows += [host, Row(f"read {READ_MB} MB in 64 KB blocks inside a workspace", inside,
                           ratios=[Ratio(host.name)],
                           note="same file, through the workspace's overlay")]
    return rows
