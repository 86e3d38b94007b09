"""Threads for work that costs as much as a sandbox holds, shared fairly between families.

Squashing a fork chain, capturing a sandbox as an image, committing a workspace and
every snapshot of the copy backend take as long as the files they go through: seconds
for a few hundred thousand. They ran on asyncio's default pool (six threads on two
CPUs) beside the short blocking steps of every create, fork and close (a cgroup made
or removed, the fd keeper asked): one family running six of them at once had every
other family's forks and closes wait for a free thread. Here they have threads of
their own, and no family holds more than ``per_family`` of them: a family's work past
that waits for its own, and a free thread goes to the waiting family served least
recently (one that was not busy comes first), so one family's backlog never stands in
front of another's job.

Semantics are those of ``asyncio.to_thread``: the caller's context is carried over,
and a caller that goes away while its job runs stops waiting but the job runs to its
end (a thread cannot be interrupted). A job that has not started when its caller goes
away never starts.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
from collections import Counter, deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
_Job = tuple[asyncio.Future, Callable[[], Any]]


class FairPool:
    """``threads`` threads; at most ``per_family`` of them run one family's jobs."""

    def __init__(self, threads: int, per_family: int, name: str = "bb-content") -> None:
        self.threads = threads
        self.per_family = per_family
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._waiting: dict[Hashable, deque[_Job]] = {}  # in order of arrival
        self._running: Counter[Hashable] = Counter()
        self._served: dict[Hashable, int] = {}  # a busy family's latest start, by number
        self._starts = itertools.count()
        self._closed = False

    async def run(self, family: Hashable, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` on one of the pool's threads, in ``family``'s turn."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        done = asyncio.get_running_loop().create_future()
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        self._waiting.setdefault(family, deque()).append((done, call))
        self._start_next()
        return await done

    def busy(self) -> dict[Hashable, int]:
        """Jobs running now, per family."""
        return {family: n for family, n in self._running.items() if n}

    def _start_next(self) -> None:
        """Start waiting jobs while threads are free: the family served least recently
        first, skipping families at their share and jobs whose caller went away."""
        while sum(self._running.values()) < self.threads:
            ready = [f for f in self._waiting if self._running[f] < self.per_family]
            if not ready:
                return
            family = min(ready, key=lambda f: self._served.get(f, -1))
            jobs = self._waiting[family]
            done, call = jobs.popleft()
            if not jobs:
                del self._waiting[family]
            if done.cancelled():
                self._forget(family)
                continue
            self._running[family] += 1
            self._served[family] = next(self._starts)
            running = asyncio.get_running_loop().run_in_executor(self._executor, call)
            running.add_done_callback(functools.partial(self._finished, family, done))

    def _finished(self, family: Hashable, done: asyncio.Future,
                  running: asyncio.Future) -> None:
        self._running[family] -= 1
        if not self._running[family]:
            del self._running[family]
            self._forget(family)
        if done.cancelled():  # its caller went away: the outcome is nobody's
            if not running.cancelled():
                running.exception()  # read, so asyncio does not report it as lost
        elif running.cancelled():
            done.cancel()
        elif running.exception() is not None:
            done.set_exception(running.exception())
        else:
            done.set_result(running.result())
        self._start_next()

    def _forget(self, family: Hashable) -> None:
        """Drop the turn of a family with nothing running or waiting (families come and
        go: the map stays as small as the pool's work)."""
        if family not in self._running and family not in self._waiting:
            self._served.pop(family, None)

    async def close(self) -> None:
        """The daemon stops: jobs not started never start (their callers are cancelled),
        later ones are refused, and this waits for those running."""
        self._closed = True
        for jobs in self._waiting.values():
            for done, _ in jobs:
                done.cancel()
        self._waiting.clear()
        await asyncio.to_thread(self._executor.shutdown, wait=True)
