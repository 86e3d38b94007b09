"""The blocking face's engine room: one private event loop on a thread, for the process.

``Sandbox`` runs ``AsyncSandbox``'s coroutines here and waits for them, so the
two faces share every line of logic. One loop for all blocking sandboxes
means their HTTP connections live on one loop, and a program that mixes
threads still has exactly one extra thread. After ``os.fork()`` the child
starts a fresh loop (threads do not survive a fork).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Portal:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="branchbox-portal",
                                          daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def run(self, coro: Coroutine[Any, Any, R]) -> R:
        """Run ``coro`` on the portal's loop and wait for its result or exception."""
        loop = self._ensure()
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking Sandbox method was called from a callback that "
                               "runs on the SDK's own loop; use AsyncSandbox there")
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. Ctrl-C: stop the request instead of leaving it running
            raise

    def iterate(self, items: AsyncIterator[T]) -> Iterator[T]:
        """A blocking iterator over an async one (closed with it)."""

        async def step() -> tuple[bool, T | None]:
            try:
                return True, await anext(items)
            except StopAsyncIteration:
                return False, None

        try:
            while True:
                more, item = self.run(step())
                if not more:
                    return
                yield item  # type: ignore[misc]
        finally:
            self.run(items.aclose())  # type: ignore[attr-defined]

    def stop(self) -> None:
        """Cancel what still runs on the loop (a connection's reader, say), as
        ``asyncio.run`` does at its end, then stop it: a task left pending would be
        destroyed with the loop, with a warning and a traceback at the program's exit."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None and thread is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(STOP_WAIT)
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    def _forget(self) -> None:
        """In a forked child: the loop's thread is gone, start over when next needed."""
        self._lock = threading.Lock()
        self._loop = self._thread = None


STOP_WAIT = 5.0  # seconds the loop's tasks have to end once cancelled, at exit


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


portal = Portal()
atexit.register(portal.stop)
os.register_at_fork(after_in_child=portal._forget)


def blocking(method: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]
             ) -> Callable[Concatenate[Any, P], R]:
    """A blocking method of a face whose ``_core`` holds the async object: same name,
    signature and docstring as ``method``, run on the portal."""

    @functools.wraps(method)
    def call(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        return portal.run(method(self._core, *args, **kwargs))

    return call
