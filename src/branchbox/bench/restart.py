"""A daemon killed with -9 and started again on its data directory: how long until it
serves again, with and without live sandboxes to re-attach to (issue 13 part 1), and
the first call on a re-attached sandbox.

Its own daemon (the suite kills it). The time is from the kill to the first 200 of
``/v1/healthz`` (the engine has re-attached to every sandbox by then): interpreter
start-up, imports and the network's set-up are in both rows; the difference over the
sandboxes is the cost of re-attaching to one (take its socket back from the keeper,
ping its REPL, rebuild its layers, lineage, timers, firewall entries).
"""

from __future__ import annotations

import time

from branchbox.bench.daemon import Daemon
from branchbox.bench.measure import Context, Row
from branchbox.sdk import Sandbox

TITLE = "restart"


def _restarts(daemon: Daemon, rounds: int, probe: str | None) -> tuple[list[float], list[float]]:
    """(ms from kill to serving, ms of the first run_code on ``probe``) per round."""
    ready, first = [], []
    for _ in range(rounds):
        daemon.kill()
        t0 = time.perf_counter()
        daemon.start()
        ready.append(1000 * (time.perf_counter() - t0))
        if probe is not None:
            t0 = time.perf_counter()
            sb = Sandbox.connect(probe, url=daemon.url)
            if sb.run_code("x").text != "41":
                raise RuntimeError("a re-attached sandbox lost its REPL state")
            first.append(1000 * (time.perf_counter() - t0))
            sb.detach()
    return ready, first


def run(ctx: Context) -> list[Row]:
    n = ctx.pick(10, 100)
    rounds = ctx.pick(2, 5)
    with Daemon() as daemon:
        ctx.step("restarts without sandboxes")
        empty, _ = _restarts(daemon, rounds, None)
        ctx.step(f"{n} live sandboxes (a parent and its fork children)")
        parent = Sandbox(url=daemon.url)
        parent.run_code("x = 41")
        kids = []
        while len(kids) < n - 1:
            kids += parent.fork(min(32, n - 1 - len(kids)))
        probe = kids[-1].id
        for sb in (parent, *kids):
            sb.detach()
        ctx.step(f"restarts with {n} sandboxes to re-attach to")
        full, first = _restarts(daemon, rounds, probe)
    per = [(f - e) / n for f, e in zip(sorted(full), sorted(empty), strict=True)]
    return [
        Row("kill -9 → serving again, no sandboxes", empty),
        Row(f"kill -9 → serving again, {n} live sandboxes re-attached", full),
        Row("re-attach, per sandbox", per, note="(with − without) / sandboxes"),
        Row("first run_code on a re-attached sandbox (connect + call)", first),
    ]
