"""What every suite shares: the result row, timing, percentiles, PSS, and the run context.

A suite is a module with ``TITLE`` and ``run(ctx) -> list[Row]``. Rows carry
their raw samples so the report can compute percentiles and ratios in one
place, and so the JSON keeps everything a later comparison might want.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from rich.progress import Progress, TaskID

from branchbox.runtime import procfs, smaps
from branchbox.sdk import Sandbox

T = TypeVar("T")


@dataclass(frozen=True)
class Ratio:
    """``faster=False``: this row's p50 over ``ref``'s (how far above the floor we are);
    ``faster=True``: ``ref``'s p50 over this row's (how much the alternative costs more)."""

    ref: str
    faster: bool = False


@dataclass
class Row:
    """One measured quantity: ``samples`` in ``unit``; no samples means "not available"."""

    name: str
    samples: list[float]
    unit: str = "ms"
    table: str = ""  # the table it is shown in; the suite's title when empty
    params: dict[str, Any] = field(default_factory=dict)  # for the plot and for JSON readers
    ratios: list[Ratio] = field(default_factory=list)
    note: str = ""

    def summary(self) -> dict[str, float] | None:
        """p50 / p90 (nearest rank) / max, or None when nothing was measured."""
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        return {
            "n": len(ordered),
            "p50": statistics.median(ordered),
            "p90": ordered[round(0.9 * (len(ordered) - 1))],
            "max": ordered[-1],
        }

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "summary": self.summary()}


def timed(
    fn: Callable[[], T],
    reps: int,
    after: Callable[[T], object] | None = None,
) -> list[float]:
    """Milliseconds per call of ``fn`` over ``reps`` calls; ``after`` (clean-up, say)
    runs outside the timed span."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        samples.append(1000 * (time.perf_counter() - t0))
        if after is not None:
            after(out)
    return samples


def rollup_mib(pids: Iterable[int], fields: tuple[str, ...]) -> float:
    """The sum of ``fields`` of /proc/PID/smaps_rollup over these host processes, in MiB."""
    return smaps.rollup_kib(pids, fields) / 1024


def page_tables_mib(pids: Iterable[int]) -> float:
    """The page tables of these host processes (``VmPTE`` of /proc/PID/status), in MiB:
    kernel memory that PSS leaves out; a process that exited since it was listed counts
    0."""
    kib = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, KeyError):
            kib += int(procfs.status(int(pid))["VmPTE"].split()[0])
    return kib / 1024


def sandbox_pss_mib(sandbox: Sandbox) -> float:
    """Proportional set size: each shared copy-on-write page is split among its sharers,
    so the sandboxes of a family add up to what they really use together."""
    return rollup_mib(sandbox.info()["resources"]["host_pids"], ("Pss",))


def sandbox_private_mib(sandbox: Sandbox) -> float:
    """Pages only this sandbox maps: what closing it would give back."""
    return rollup_mib(sandbox.info()["resources"]["host_pids"], ("Private_Clean", "Private_Dirty"))


def close_all(sandboxes: Iterable[Sandbox]) -> None:
    for sandbox in sandboxes:
        sandbox.close()


@dataclass
class Context:
    """What a suite gets: the daemon to talk to, how thorough to be, and the progress bar."""

    url: str
    quick: bool
    progress: Progress
    task: TaskID

    def sandbox(self, **kwargs: Any) -> Sandbox:
        return Sandbox(url=self.url, **kwargs)

    def pick(self, quick: T, full: T) -> T:
        return quick if self.quick else full

    def step(self, what: str) -> None:
        """Say what is being measured now (a full run takes many minutes)."""
        self.progress.update(self.task, description=what)
