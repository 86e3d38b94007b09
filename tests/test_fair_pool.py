"""The content pool: work as long as a family's files runs in that family's turn.

The pool itself with real threads (jobs that wait on events, so nothing depends on
timing), then an engine whose family holds its whole share: another family's save
goes on, its own waits.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest
from waiting import eventually

from branchbox.engine.fair_pool import FairPool
from branchbox.sdk._portal import portal

WITHIN = 30.0
who = contextvars.ContextVar("who", default="nobody")


def test_a_family_past_its_share_waits_and_another_runs_meanwhile() -> None:
    async def scenario() -> None:
        pool = FairPool(threads=3, per_family=2)
        held = threading.Event()
        try:
            a_jobs = [asyncio.ensure_future(pool.run("a", held.wait)) for _ in range(5)]
            await asyncio.sleep(0)
            assert pool.busy() == {"a": 2}  # two of five: the third thread stays free
            assert await asyncio.wait_for(pool.run("b", lambda: "b ran"), WITHIN) == "b ran"
            assert not any(job.done() for job in a_jobs)
            held.set()
            assert await asyncio.wait_for(asyncio.gather(*a_jobs), WITHIN) == [True] * 5
            assert pool.busy() == {}
        finally:
            held.set()
            await pool.close()

    asyncio.run(scenario())


def test_a_free_thread_goes_to_the_family_served_least_recently() -> None:
    """One thread: while family a's first job runs, a queues two more, then b and c one
    each; b and c run before a's second (a had its turn), then a's."""
    async def scenario() -> list[str]:
        pool = FairPool(threads=1, per_family=1)
        order: list[str] = []
        gate = threading.Event()

        def job(name: str, wait: bool = False) -> None:
            if wait:
                gate.wait()
            order.append(name)

        try:
            jobs = [asyncio.ensure_future(pool.run("a", job, "a1", True))]
            await asyncio.sleep(0)
            jobs += [asyncio.ensure_future(pool.run(family, job, name))
                     for family, name in (("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1"))]
            await asyncio.sleep(0)
            gate.set()
            await asyncio.wait_for(asyncio.gather(*jobs), WITHIN)
            return order
        finally:
            gate.set()
            await pool.close()

    assert asyncio.run(scenario()) == ["a1", "b1", "c1", "a2", "a3"]


def test_errors_context_and_a_caller_gone_before_its_turn() -> None:
    """A job's exception reaches its caller; the caller's context variables are the
    job's; a job whose caller was cancelled before its turn never runs."""
    async def scenario() -> None:
        pool = FairPool(threads=1, per_family=1)
        gate = threading.Event()
        ran: list[str] = []
        try:
            first = asyncio.ensure_future(pool.run("a", gate.wait))
            await asyncio.sleep(0)
            gone = asyncio.ensure_future(pool.run("b", ran.append, "never"))
            await asyncio.sleep(0)
            gone.cancel()
            gate.set()
            await asyncio.wait_for(first, WITHIN)
            with pytest.raises(ZeroDivisionError):
                await pool.run("a", lambda: 1 / 0)
            who.set("caller")
            assert await pool.run("a", who.get) == "caller"
            assert ran == [] and gone.cancelled()
        finally:
            gate.set()
            await pool.close()

    asyncio.run(scenario())


def test_a_family_holding_its_share_does_not_hold_another_familys_save(harness, make) -> None:
    """Family a's share of the engine's content pool is taken (two jobs that wait): its
    own save_image waits for it, while family b's save_image (capture, size, manifest)
    goes through, the daemon-wide image lock not held across a capture any more."""
    a, b = make(), make()
    engine = harness.engine
    family_a = engine.get(a.id).body.layers.ids.family
    assert family_a != engine.get(b.id).body.layers.ids.family
    held = threading.Event()
    holders = [threading.Thread(target=portal.run,
                                args=(engine.content.run(family_a, held.wait),))
               for _ in range(engine.content.per_family)]
    saved: dict[str, object] = {}
    waiter = threading.Thread(target=lambda: saved.update(a=a.save_image("fair-a")))
    try:
        for holder in holders:
            holder.start()
        assert eventually(lambda: engine.content.busy().get(family_a) == 2, within=WITHIN)
        waiter.start()
        b.files.write("/root/b.txt", b"b")
        assert b.save_image("fair-b")["name"] == "fair-b"
        assert "a" not in saved and waiter.is_alive()
    finally:
        held.set()
        for thread in [*holders, waiter]:
            if thread.ident is not None:
                thread.join(WITHIN)
    assert saved["a"]["name"] == "fair-a"
    for name in ("fair-a", "fair-b"):
        portal.run(engine.remove_image(name))
