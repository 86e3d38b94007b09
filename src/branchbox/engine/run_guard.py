"""Every call ends: the daemon's own deadlines behind a sandbox's REPL.

The agent enforces a ``run_code`` timeout itself (SIGALRM raises KeyboardInterrupt
in user code), but user code can outlast that: C code does not look at signals
until it returns (``sum(range(10**11))``), and code may catch KeyboardInterrupt.
So the daemon keeps a deadline of its own for every run with a timeout:

1. at ``timeout + INTERRUPT_AFTER`` it sends SIGINT itself;
2. at ``timeout + KILL_AFTER`` it stops the sandbox hard: everything in its cgroup
   (the REPL, whatever the REPL started, a fork bomb's children) is SIGKILLed. The
   call ends with ``SandboxTimeout`` saying so, and the sandbox is reported dead
   (``ReplGone`` from then on): its files are kept until close, its memory state is
   lost. A fresh REPL on the same files was the alternative; a dead sandbox says
   plainly that the interpreter state the caller relied on is gone.

A call whose client went away is *abandoned* (``runtime.channel``): a run is
interrupted at once, and again every ``REINTERRUPT_EVERY`` while it goes on. Until
the agent has finished an abandoned call the sandbox's lock stays held, so later
calls get a clear ``409 busy`` after the engine's bounded wait instead of queueing
behind a REPL that does not read (and a fork does not freeze a sandbox whose REPL
cannot answer). An abandoned call that has not ended ``ORPHAN_GRACE`` seconds after
it was given up is stopped hard like a run past its deadline.

The server tells the engine when a client hangs up (``CALLER_GONE``, set per request
by ``server.disconnect``): a call still waiting for its sandbox then never runs, and
a call under way is abandoned even while the sandbox sends nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import TypeVar

from branchbox.engine import errors
from branchbox.engine.live import Body
from branchbox.runtime.channel import interrupt_repl

log = logging.getLogger("branchbox.engine")

INTERRUPT_AFTER = 1.0
"""Seconds past a run's timeout before the daemon interrupts the REPL itself."""
KILL_AFTER = 3.0
"""Seconds past a run's timeout before the daemon kills the sandbox's processes."""
ORPHAN_GRACE = 5.0
"""Seconds an abandoned call has to end (after its interrupt) before the same hard stop."""
REINTERRUPT_EVERY = 0.5
"""Seconds between interrupts of an abandoned run that goes on: the first can land before
its cell began (the REPL ignores SIGINT between calls), or its code caught it."""


T = TypeVar("T")

class Hangup(asyncio.Event):
    """Set when a call's client hangs up; it also runs callbacks then, so the engine can
    watch for it without a task of its own per call (:func:`until_gone`)."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []

    def set(self) -> None:
        if not self.is_set():
            super().set()
            callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:  # (one may undo another's meanwhile: a copy)
                callback()

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run ``callback`` when this is set (at once if it is); returns what undoes it
        (a no-op once it ran)."""
        if self.is_set():
            callback()
            return lambda: None
        self._callbacks.append(callback)

        def undo() -> None:
            with contextlib.suppress(ValueError):  # ran already
                self._callbacks.remove(callback)
        return undo


CALLER_GONE: ContextVar[Hangup | None] = ContextVar("branchbox_caller_gone", default=None)
"""Set (by the server, per request) to a :class:`Hangup` set when the caller hangs up."""


class CallerGone(errors.EngineError):
    """The caller hung up: nobody reads the answer (499, as proxies log it)."""

    status = 499
    kind = "CallerGone"


def _gone() -> CallerGone:
    return CallerGone("the client went away before the call ran; it was not run")


async def acquire(lock: asyncio.Lock, wait: float | None) -> None:
    """Take ``lock`` within ``wait`` seconds (TimeoutError otherwise), unless the caller
    hangs up first (CallerGone): a call abandoned while queued never runs."""
    gone = CALLER_GONE.get()
    if gone is not None and gone.is_set():
        raise _gone()
    # Free, and nobody in line (asyncio.Lock would queue us behind its waiters): taken
    # without waiting, so without the tasks below (the common case, kept cheap).
    if not lock.locked() and not getattr(lock, "_waiters", None):
        await lock.acquire()
        return
    acquiring = asyncio.ensure_future(lock.acquire())
    waiter = asyncio.ensure_future(gone.wait()) if gone is not None else None
    try:
        await asyncio.wait([t for t in (acquiring, waiter) if t is not None], timeout=wait,
                           return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        if acquiring.done() and not acquiring.cancelled():
            lock.release()
        raise
    finally:
        if waiter is not None:
            waiter.cancel()
        if not acquiring.done():
            acquiring.cancel()  # asyncio.Lock hands a cancelled waiter's turn on
            with contextlib.suppress(asyncio.CancelledError):
                await acquiring
    held = acquiring.done() and not acquiring.cancelled()
    if gone is not None and gone.is_set():
        if held:
            lock.release()
        raise _gone()
    if not held:
        raise TimeoutError


PROMPT_OPS = frozenset({"ping", "kill", "ps", "input", "close_stdin", "resize", "unwatch"})
"""Requests the agent answers at once (they take no lock): bounded by the engine's wait."""

# The most the engine waits for an answer to a request of its own that runs no user code
# (a merge's new hostname, a cancel, a workspace's attach) while it holds a sandbox's
# lock or a stop waits for it: a hostile agent that never answers held them for ever.
OWN_REQUEST_WAIT = 10.0


async def until_gone(events: AsyncIterator[T], limit: float | None = None) -> AsyncIterator[T]:
    """``events`` until the caller hangs up, or for at most ``limit`` seconds: then the wait
    for the next one is cancelled (which abandons the request in the sandbox, see
    runtime.channel) and CallerGone, or SandboxTimeout, is raised."""
    gone = CALLER_GONE.get()
    if gone is None and limit is None:
        async for item in events:
            yield item
        return
    cut = _Cut(gone, limit)
    try:
        while True:
            try:
                item = await cut.next(events)
            except StopAsyncIteration:
                return
            yield item
    finally:
        cut.close()
        await events.aclose()  # type: ignore[attr-defined]


class CutWait:
    """Cancels the task waiting in :meth:`wait` the moment :meth:`cut` is called (from a
    callback or a timer: no task and no ``asyncio.wait`` per wait, which cost a run ~0.1 ms
    of the daemon's loop an event); from then on every wait raises the cut's error."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self._waiting: asyncio.Task | None = None
        self._cancelled = False

    def cut(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            if self._waiting is not None:
                self._cancelled = True
                self._waiting.cancel()

    async def wait(self, work: Awaitable[T]) -> T:
        """``work``'s result, or the cut's error once cut (before or while waiting)."""
        if self.error is not None:
            if inspect.iscoroutine(work):
                work.close()  # never awaited: said, not warned about
            raise self.error
        task = asyncio.current_task()
        assert task is not None
        self._waiting = task
        try:
            result = await work
        except asyncio.CancelledError:
            if not self._cancelled or task.uncancel() > 0:
                raise  # the task itself was cancelled (too)
            self._cancelled = False
            raise self.error from None
        except BaseException:
            if not self._cancelled:
                raise
            self._cancelled = False  # swallowed below, which then failed otherwise
            task.uncancel()
            raise self.error from None
        finally:
            self._waiting = None
        if self._cancelled:  # something under the wait swallowed our cancel: take it back
            self._cancelled = False
            task.uncancel()
        if self.error is not None:
            raise self.error
        return result


class _Cut(CutWait):
    """Ends the wait for a call's next event when its caller hangs up or its time is up."""

    def __init__(self, gone: Hangup | None, limit: float | None) -> None:
        super().__init__()
        self._undo = gone.on_set(lambda: self.cut(CallerGone(
            "the client went away during the call; it was interrupted"))) \
            if gone is not None else None
        self._timer = None if limit is None else asyncio.get_running_loop().call_later(
            limit, lambda: self.cut(errors.SandboxTimeout(
                f"the sandbox's REPL did not answer within {limit:g} s (code it runs holds "
                "it); retry later, or close the sandbox")))

    async def next(self, events: AsyncIterator[T]) -> T:
        """The next of ``events``; CallerGone or SandboxTimeout once cut."""
        return await self.wait(anext(events))

    def close(self) -> None:
        if self._undo is not None:
            self._undo()
        if self._timer is not None:
            self._timer.cancel()


def stop_message(reason: str) -> str:
    return (f"{reason}; its REPL and every process it started were killed (its memory "
            "state is lost, its files are kept): close the sandbox")


class RunDeadline:
    """The daemon's deadline for one ``run_code`` with a timeout (nothing without one)."""

    def __init__(self, body: Body, timeout: object,
                 background: Callable[[asyncio.Task], None]) -> None:
        self._handles: list[asyncio.TimerHandle] = []
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            return  # no timeout (or one the agent refuses): nothing to enforce
        loop = asyncio.get_running_loop()
        self._handles = [
            loop.call_later(timeout + INTERRUPT_AFTER, interrupt_repl, body.cgroup, "run_code"),
            loop.call_later(timeout + KILL_AFTER, lambda: background(loop.create_task(
                hard_stop(body, f"run_code went past its timeout of {timeout:g} s and did "
                                "not stop when interrupted")))),
        ]

    def cancel(self) -> None:
        for handle in self._handles:
            handle.cancel()


async def hard_stop(body: Body, reason: str,
                    error: type[errors.EngineError] = errors.SandboxTimeout) -> None:
    """SIGKILL everything in ``body``'s cgroup; its channel then closes and the calls on
    it end with ``error`` (``body.stopped`` says why)."""
    if body.channel is None or body.channel.closed.is_set():
        return
    body.stopped, body.stopped_as = stop_message(reason), error
    log.warning("stopping sandbox body %s: %s", body.key, reason)
    body.killing = asyncio.ensure_future(asyncio.to_thread(body.cgroup.kill))
    await body.killing


async def killed(body: Body) -> None:
    """Once the hard stop of ``body`` has every process gone. Its REPL dies first, so a
    call learns of the stop while the rest may still be dying: it answers after this,
    and a caller looking right after sees nothing running."""
    if body.killing is not None:
        with contextlib.suppress(OSError):
            await asyncio.shield(body.killing)


async def release_when_quiet(lock: asyncio.Lock, body: Body) -> None:
    """Release ``lock`` once ``body``'s agent has finished every call abandoned on it
    (stopping it hard if they take more than ORPHAN_GRACE)."""
    try:
        channel = body.channel
        orphans = [] if channel is None else channel.orphans()
        if orphans:
            waiting = asyncio.gather(*(ended.wait() for ended in orphans))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + ORPHAN_GRACE
            while not waiting.done() and loop.time() < deadline:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(waiting),
                                           min(REINTERRUPT_EVERY, deadline - loop.time()))
                if not waiting.done() and channel.orphaned_code():  # the lock is still held
                    interrupt_repl(body.cgroup, "run_code")
            if not waiting.done():
                await hard_stop(body, "a call given up on (its client went away or its "
                                      "deadline passed) did not end within "
                                      f"{ORPHAN_GRACE:g} s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiting, ORPHAN_GRACE)
    finally:
        lock.release()
