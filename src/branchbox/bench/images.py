"""Images: building one from a spec (cold, then every step cached) and starting sandboxes
on the host's own root.

The spec has one step of each kind on the default image; its first RUN carries a new
nonce each time, so a cold build makes every layer anew (the default image itself is
cached). A rebuild of the same spec and context takes every step from the cache. The
first host sandbox of a daemon also builds the mask layer and the slot's id-mapped view
of the host's root; later ones reuse both.
"""

from __future__ import annotations

import secrets
import tempfile
import time
from pathlib import Path

from branchbox.bench.measure import Context, Row, timed
from branchbox.sdk import Sandbox

TITLE = "images"
SPEC = """FROM default
RUN echo {nonce} > /nonce && head -c 4000000 /dev/urandom > /opt/blob
ENV APP_MODE=bench
WORKDIR /app
COPY . /app/
RUN python3 -c "import json, os; print(len(os.listdir('/app')))"
"""


def run(ctx: Context) -> list[Row]:
    reps = ctx.pick(2, 5)
    with tempfile.TemporaryDirectory() as context:
        for i in range(50):
            (Path(context) / f"module_{i}.py").write_text(f"VALUE = {i}\n" * 20)
        names: list[str] = []

        def build(spec: str) -> float:
            name = f"bench-{secrets.token_hex(4)}"
            names.append(name)
            t0 = time.perf_counter()
            Sandbox.build_image(name, spec, context, url=ctx.url)
            return 1000 * (time.perf_counter() - t0)

        try:
            ctx.step("image build, every step new (5 steps on the default image)")
            specs = [SPEC.format(nonce=secrets.token_hex(8)) for _ in range(reps)]
            cold = [build(spec) for spec in specs]
            ctx.step("image build again, every step cached")
            cached = [build(spec) for spec in specs]
        finally:
            for name in names:
                Sandbox.remove_image(name, url=ctx.url)
    ctx.step("sandbox create on image 'host'")
    first = timed(lambda: ctx.sandbox(image="host"), 1, Sandbox.close)
    later = timed(lambda: ctx.sandbox(image="host"), ctx.pick(5, 20), Sandbox.close)
    return [
        Row("image build, cold", cold, note="5 steps: RUN (4 MB), ENV, WORKDIR, COPY (50 "
                                            "files), RUN"),
        Row("image build, all steps cached", cached),
        Row("create image=host, first of the daemon", first,
            note="builds the mask layer and maps the host's root"),
        Row("create image=host, back to back", later),
    ]
