"""The floor for fork(n): raw ``os.fork()`` n times of a plain Python process holding
the same state, with nothing else (no namespaces, layers, cgroups, HTTP).

It runs in its own interpreter (``python -m branchbox.bench.floor MB N REPS``
prints the samples as JSON) so that the state is the only memory it holds,
and because forking the benchmark process itself (threads, sockets, rich's
live display) would not be "nothing else".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def ballast_code(megabytes: int) -> str:
    """Python that makes the REPL hold ``megabytes`` MiB in 1 KiB objects: many objects,
    like a real program's state, not one buffer the kernel could share wholesale."""
    return f"ballast = [bytes(1024) for _ in range({megabytes} * 1024)]"


def fork_children(n: int) -> float:
    """Milliseconds to fork ``n`` children that stay alive until all exist (as fork(n)
    children do), then let them go and reap them outside the timed span."""
    read_end, write_end = os.pipe()
    t0 = time.perf_counter()
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os.close(write_end)  # else the child would hold off its own EOF
            os.read(read_end, 1)
            os._exit(0)
        pids.append(pid)
    elapsed = 1000 * (time.perf_counter() - t0)
    os.close(write_end)  # EOF wakes every child
    os.close(read_end)
    for pid in pids:
        os.waitpid(pid, 0)
    return elapsed


def floor_samples(megabytes: int, n: int, reps: int) -> list[float]:
    """Milliseconds per raw fork of n children, over ``reps`` runs, in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-m", "branchbox.bench.floor", str(megabytes), str(n), str(reps)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    megabytes, n, reps = map(int, sys.argv[1:4])
    exec(ballast_code(megabytes))  # the same statement the sandbox runs
    print(json.dumps([fork_children(n) for _ in range(reps)]))


if __name__ == "__main__":
    main()
