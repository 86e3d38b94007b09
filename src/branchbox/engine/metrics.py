"""One sample of what a sandbox uses, for E2B's metrics routes: its CPU share since the
previous sample, its memory (and the page cache in it) against its memory limit, its
disk against its disk limit.

Sampled when asked, not collected on a timer: a daemon holding a thousand idle
sandboxes reads nothing for them. The CPU share is the CPU time the sandbox used
since its previous sample (or since it started) over the wall time between, as a
percentage of the CPUs the host lets it use (sandboxes are weighted, not capped).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from branchbox.engine.live import Body


@dataclass(frozen=True)
class CpuMark:
    """A body's CPU time at one moment: what the next sample's share is counted from."""

    body_key: str
    at: float  # time.time()
    cpu_seconds: float


@dataclass(frozen=True)
class Sample:
    at: float  # time.time()
    cpu_count: int
    cpu_used_pct: float
    memory_bytes: int
    memory_limit_bytes: int
    memory_cache_bytes: int
    disk_bytes: int | None  # None: the store counts nothing per volume
    disk_limit_bytes: int | None  # None: unbounded


def read(body: Body, used: Callable[[Path], int | None]) -> tuple[float, int, int, int | None]:
    """(CPU seconds, memory bytes, page cache bytes, disk bytes) of ``body`` now: files
    read only, safe off the event loop. Raises FileNotFoundError once its cgroup is gone;
    the disk is None where its volume's quota group cannot be read."""
    cgroup = body.cgroup
    counted = cgroup.cpu_seconds(), cgroup.memory_bytes(), cgroup.memory_cache_bytes()
    try:
        disk = used(body.layers.volume)
    except OSError:
        disk = None
    return (*counted, disk)


def sample(body: Body, reading: tuple[float, int, int, int | None], since: CpuMark | None,
           started: float, memory_limit: int) -> Sample:
    """A sample from ``reading`` (:func:`read`), the CPU share counted from ``since`` if
    it is this body's, else from ``started`` (the sandbox's start, wall clock)."""
    cpu_seconds, memory, cache, disk = reading
    now = time.time()
    cpus = len(os.sched_getaffinity(0))
    if since is not None and since.body_key == body.key and since.cpu_seconds <= cpu_seconds:
        used, elapsed = cpu_seconds - since.cpu_seconds, now - since.at
    else:  # first sample, a merge's new body, or v1's count after processes ended
        used, elapsed = cpu_seconds, now - started
    share = 100 * used / (elapsed * cpus) if elapsed > 0 else 0.0
    return Sample(now, cpus, round(min(max(share, 0.0), 100.0), 2), memory, memory_limit,
                  cache, disk, body.layers.disk_bytes)
