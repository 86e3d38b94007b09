"""engine.run_guard's waits: a call's next event is given up on when its client hangs up
or its time is up, without a task per event, and without eating the task's own cancels."""

from __future__ import annotations

import asyncio
import functools

import pytest

from branchbox.engine import errors
from branchbox.engine.run_guard import CALLER_GONE, CallerGone, Hangup, acquire, until_gone


def scenario(test):
    """Run the async test on a loop of its own."""
    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())
    return run


class Source:
    """An event source as the agent channel is one: items, then a wait for the next that
    records how it ended (cancelled = the request abandoned in the sandbox)."""

    def __init__(self, items: int, swallow: bool = False,
                 instead: BaseException | None = None) -> None:
        self.items = items
        self.swallow = swallow  # answer a cancel with one more item (a misbehaving layer)
        self.instead = instead  # or with this error
        self.cancelled = 0
        self.closed = False
        self.waiting = asyncio.Event()

    async def events(self):
        try:
            for n in range(self.items):
                yield n
            while True:
                self.waiting.set()
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    self.cancelled += 1
                    if self.instead is not None:
                        raise self.instead from None
                    if not self.swallow:
                        raise
                    yield "late"
        finally:
            self.closed = True


async def _collect(events, into: list) -> None:
    async for item in events:
        into.append(item)


def _in_call(gone: Hangup | None, coro):
    """``coro`` as a task whose context has ``gone`` as its caller's hang-up."""
    async def run():
        CALLER_GONE.set(gone)
        return await coro
    return asyncio.get_running_loop().create_task(run())


@scenario
async def test_hanging_up_ends_the_wait_with_caller_gone() -> None:
    source, gone, got = Source(2), Hangup(), []
    task = _in_call(gone, _collect(until_gone(source.events()), got))
    await source.waiting.wait()
    gone.set()
    with pytest.raises(CallerGone):
        await task
    assert got == [0, 1]
    assert source.cancelled == 1 and source.closed
    assert task.cancelling() == 0


@scenario
async def test_a_hang_up_between_events_is_seen_at_the_next_wait() -> None:
    gone, got = Hangup(), []

    async def consume() -> None:
        async for item in until_gone(Source(3).events()):
            got.append(item)
            if item == 0:
                gone.set()  # while the consumer holds the first event

    with pytest.raises(CallerGone):
        await _in_call(gone, consume())
    assert got == [0]


@scenario
async def test_the_tasks_own_cancel_stays_a_cancel() -> None:
    source, gone = Source(0), Hangup()
    task = _in_call(gone, _collect(until_gone(source.events()), []))
    await source.waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.closed


@scenario
async def test_a_cancel_and_a_hang_up_at_once_stay_a_cancel() -> None:
    source, gone = Source(0), Hangup()
    task = _in_call(gone, _collect(until_gone(source.events()), []))
    await source.waiting.wait()
    gone.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@scenario
async def test_the_limit_ends_the_wait_with_a_timeout() -> None:
    source = Source(1)
    task = _in_call(None, _collect(until_gone(source.events(), limit=0.05), []))
    with pytest.raises(errors.SandboxTimeout, match="did not answer within 0.05 s"):
        await task
    assert source.cancelled == 1 and source.closed


@scenario
async def test_a_swallowed_cancel_is_taken_back() -> None:
    """A layer under the wait that answers the cancel with an item: the call still ends
    as cut, and the task is left with no cancel pending (later awaits are not hit)."""
    await _cut_leaves_no_cancel(Source(0, swallow=True))


@scenario
async def test_a_cancel_answered_with_another_error_is_taken_back() -> None:
    """A layer under the wait that turns the cancel into another error: the call still
    ends as cut (CallerGone), and no cancel is left pending on the task."""
    await _cut_leaves_no_cancel(Source(0, instead=RuntimeError("a layer's own error")))


async def _cut_leaves_no_cancel(source: Source) -> None:
    gone = Hangup()

    async def consume() -> str:
        with pytest.raises(CallerGone):
            await _collect(until_gone(source.events()), [])
        await asyncio.sleep(0.01)  # would raise CancelledError if a cancel were left over
        return "done"

    task = _in_call(gone, consume())
    await source.waiting.wait()
    gone.set()
    assert await task == "done"
    assert task.cancelling() == 0


@scenario
async def test_no_hang_up_and_no_limit_pass_events_through() -> None:
    got: list = []
    await _collect(until_gone(_finite(3)), got)
    assert got == [0, 1, 2]


async def _finite(n: int):
    for i in range(n):
        yield i


@scenario
async def test_hangup_callbacks() -> None:
    gone, seen = Hangup(), []
    undo = gone.on_set(lambda: seen.append("a"))
    gone.on_set(lambda: seen.append("b"))
    undo()
    gone.set()
    gone.set()  # once only
    gone.on_set(lambda: seen.append("c"))  # already set: at once
    assert seen == ["b", "c"]
    assert gone.is_set()
    # A callback that undoes another (a cut closed while the hang-up is being told): the
    # other still runs once, and undoing after the fact is harmless.
    other, seen = Hangup(), []
    undo_second: list = []
    other.on_set(lambda: (seen.append("first"), undo_second[0]()))
    undo_second.append(other.on_set(lambda: seen.append("second")))
    other.set()
    undo_second[0]()
    assert seen == ["first", "second"]


@scenario
async def test_acquire_takes_a_free_lock_and_queues_behind_waiters() -> None:
    lock = asyncio.Lock()
    await _in_call(Hangup(), acquire(lock, 1.0))
    assert lock.locked()
    # Held: a second caller waits its bound and is told so.
    with pytest.raises(TimeoutError):
        await _in_call(Hangup(), acquire(lock, 0.05))
    # One in line, then a release: the one in line gets it, not a newcomer.
    first = _in_call(Hangup(), acquire(lock, 5.0))
    await asyncio.sleep(0.01)
    lock.release()
    newcomer = _in_call(Hangup(), acquire(lock, 0.05))
    await first
    with pytest.raises(TimeoutError):
        await newcomer
    lock.release()


@scenario
async def test_acquire_refuses_a_caller_already_gone() -> None:
    lock, gone = asyncio.Lock(), Hangup()
    gone.set()
    with pytest.raises(CallerGone):
        await _in_call(gone, acquire(lock, 1.0))
    assert not lock.locked()
