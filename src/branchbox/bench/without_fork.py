"""What users do without fork: N fresh sandboxes, each re-running the parent's setup
(here: building a large pandas DataFrame, a few seconds), against fork(N) after
one setup. The fresh sandboxes are started concurrently, as an impatient user
would, so the comparison is not inflated by running them one after another.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from branchbox.bench.measure import Context, Ratio, Row, close_all, timed
from branchbox.sdk import Sandbox

TITLE = "without fork: N fresh sandboxes re-running the setup"
SETUP = """
import numpy as np, pandas as pd
rng = np.random.default_rng(0)
df = pd.DataFrame({{"key": rng.integers(0, 10_000, {rows}), "x": rng.random({rows})}})
df["label"] = df["key"].astype(str)
summary = df.groupby("label")["x"].agg(["mean", "std", "count"])
"""


def run(ctx: Context) -> list[Row]:
    n, reps = ctx.pick(2, 5), ctx.pick(1, 3)
    setup = SETUP.format(rows=ctx.pick(300_000, 3_000_000))

    def fresh() -> Sandbox:
        sandbox = ctx.sandbox()
        sandbox.run_code(setup, timeout=600)
        return sandbox

    def fresh_n() -> list[Sandbox]:
        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(lambda _: fresh(), range(n)))

    ctx.step(f"{n} fresh sandboxes, each running the setup")
    without = Row(
        f"{n} fresh sandboxes, setup in each", timed(fresh_n, reps, close_all), params={"n": n}
    )
    ctx.step(f"one setup, then fork({n})")
    with ctx.sandbox() as parent:
        setups, forks = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            parent.run_code(setup, timeout=600)
            setups.append(1000 * (time.perf_counter() - t0))
            forks += timed(lambda: parent.fork(n), 1, close_all)
    faster = [Ratio(without.name, faster=True)]
    return [
        Row("the setup, once (build a DataFrame)", setups),
        without,
        Row(f"fork({n}) after the setup", forks, params={"n": n}, ratios=faster),
        Row(
            f"the setup once + fork({n})",
            [s + f for s, f in zip(setups, forks, strict=True)],
            params={"n": n},
            ratios=faster,
        ),
    ]
