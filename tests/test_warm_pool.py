"""The warm pool follows bursts of creates: after a burst, as many sandboxes are kept
ready for a while (so the next burst is all hand-outs), then it shrinks back."""

from __future__ import annotations

import ast
from concurrent.futures import ThreadPoolExecutor

from waiting import eventually

from branchbox.engine import warm
from branchbox.sdk._portal import portal

BURST = 6


def test_a_burst_is_kept_ready_then_the_pool_shrinks_back(harness, monkeypatch) -> None:
    engine = harness.engine
    monkeypatch.setattr(warm, "BURST_MEMORY", 6.0)
    portal.run(engine._drop_warm())  # from the configured size: nothing ready
    engine._demand.clear()
    made = []
    try:
        with ThreadPoolExecutor(BURST) as pool:
            made += pool.map(lambda _: harness.sandbox(), range(BURST))
        portal.run(engine.settle())
        ready = {sb.id for sb in engine._warm["default"]}
        assert len(ready) == BURST  # the burst's size, kept ready
        with ThreadPoolExecutor(BURST) as pool:
            second = list(pool.map(lambda _: harness.sandbox(), range(BURST)))
        made += second
        assert {sb.id for sb in second} == ready  # every create of it was a hand-out
    finally:
        for sb in made:
            sb.close()
    portal.run(engine.settle())
    assert eventually(lambda: len(engine._warm["default"]) == engine.config.warm_pool,
                      within=60)  # the burst forgotten: back to the configured size
    monkeypatch.setattr(engine.config, "warm_max", 3)
    engine._demand.clear()
    with ThreadPoolExecutor(BURST) as pool:
        capped = list(pool.map(lambda _: harness.sandbox(), range(BURST)))
    for sb in capped:
        sb.close()
    portal.run(engine.settle())
    assert len(engine._warm["default"]) == 3  # never more than warm_max
    portal.run(engine._drop_warm())  # the next tests start from the configured pool
    engine._demand.clear()


def test_a_hand_out_is_what_its_create_asked_for(harness) -> None:
    """A create that asks for nothing takes a warm sandbox as it started (its REPL in
    warm.WARM_CWD with the default environment, no call made to it); one that asks for
    an environment or another directory gets them, from the pool as well."""
    engine = harness.engine
    probe = "import os; (os.getcwd(), sorted(os.environ))"
    for asked in ({}, {"env": {"BB_ASKED": "1"}}, {"cwd": "/tmp/asked"}):
        portal.run(_refilled(engine))
        ready = {sb.id for sb in engine._warm["default"]}
        with harness.sandbox(**asked) as sb:
            assert sb.id in ready  # a hand-out
            cwd, names = ast.literal_eval(sb.run_code(probe).text)
            assert cwd == asked.get("cwd", warm.WARM_CWD)
            assert ("BB_ASKED" in names) == ("env" in asked)
            with harness.sandbox(image="default", env={"BB_COLD": "x"}, cwd="/tmp") as other:
                base = set(ast.literal_eval(other.run_code(probe).text)[1]) - {"BB_COLD"}
            assert set(names) - {"BB_ASKED"} == base  # the environment a create starts with


async def _refilled(engine) -> None:
    """The default image's pool refilled (an earlier test may have emptied it)."""
    engine._refill("default")
    await engine.settle()
