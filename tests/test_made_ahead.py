"""The pool of things made ahead for forks (engine.made_ahead), on its own: real threads
and a real event loop, with made things that record what happened to them."""

from __future__ import annotations

import asyncio
import itertools

from branchbox.engine.made_ahead import MadeAhead


def _pool(most: int = 32, fail_after: int | None = None):
    counter = itertools.count()
    removed: list[str] = []

    def make(key: str) -> str:
        n = next(counter)
        if fail_after is not None and n >= fail_after:
            raise OSError(28, "No space left on device")
        return f"{key}{n}"

    return MadeAhead("things", make, removed.append, most=most), removed


async def _settled(pool: MadeAhead) -> None:
    while pool._making is not None:
        await asyncio.sleep(0.001)


def test_take_prefers_ready_and_makes_on_the_path_otherwise() -> None:
    async def scenario() -> None:
        pool, removed = _pool()
        assert pool.take("a") == "a0"  # none ready: made now
        pool.want("a", 2)
        await _settled(pool)
        assert sorted(pool.ready["a"]) == ["a1", "a2"]
        assert {pool.take("a"), pool.take("a")} == {"a1", "a2"}
        assert pool.take("b") == "b3"
        assert removed == []

    asyncio.run(scenario())


def test_the_keys_least_recently_wanted_lose_theirs_past_the_bound() -> None:
    """Clients varying their limits cannot pile up made things: past ``most`` over all
    keys, the key wanted longest ago loses its own first, and those are removed."""
    async def scenario() -> None:
        pool, removed = _pool(most=4)
        for key in ("a", "b", "c"):
            pool.want(key, 2)
            await _settled(pool)
        assert {k: len(v) for k, v in pool.ready.items()} == {"b": 2, "c": 2}
        assert sorted(removed) == ["a0", "a1"]
        pool.want("b", 3)  # b wanted again: now c is the oldest
        await _settled(pool)
        assert {k: len(v) for k, v in pool.ready.items()} == {"c": 1, "b": 3}
        pool.want("c", 1)  # wanted, and has enough: still the most recent now
        pool.want("d", 1)
        await _settled(pool)
        assert {k: len(v) for k, v in pool.ready.items()} == {"b": 2, "c": 1, "d": 1}

    asyncio.run(scenario())


def test_a_failing_make_keeps_those_made_and_close_removes_all() -> None:
    async def scenario() -> None:
        pool, removed = _pool(fail_after=2)
        pool.want("a", 5)
        await _settled(pool)
        assert pool.ready["a"] == ["a0", "a1"]
        pool.want("b", 1)  # fails at once: nothing ready for b, nothing raised
        await _settled(pool)
        assert "b" not in pool.ready
        await pool.close()
        assert sorted(removed) == ["a0", "a1"] and not pool.ready
        pool.want("a", 1)  # closed: makes nothing more
        assert pool._making is None

    asyncio.run(scenario())
