"""Round trips to a live sandbox: REPL, shell command, files. Every fork child pays
these too, so they bound how fast an agent can use many children."""

from __future__ import annotations

import os

from branchbox.bench.measure import Context, Row, timed

TITLE = "round trips"


def run(ctx: Context) -> list[Row]:
    reps = ctx.pick(10, 100)
    with ctx.sandbox() as sb:
        sb.run_code("1+1")
        ctx.step("run_code / exec / files")
        blob = os.urandom(1 << 20)
        return [
            Row("run_code 1+1", timed(lambda: sb.run_code("1+1"), reps)),
            Row("exec true", timed(lambda: sb.exec("true"), reps),
                note="a bash builtin: bash starts to run it"),
            Row("exec /bin/true", timed(lambda: sb.exec("/bin/true"), reps),
                note="one plain command: exec'd without bash"),
            Row("write 1 MiB file", timed(lambda: sb.files.write("/tmp/blob", blob), reps // 2)),
            Row("read 1 MiB file", timed(lambda: sb.files.read("/tmp/blob"), reps // 2)),
        ]
