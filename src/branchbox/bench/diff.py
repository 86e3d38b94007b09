"""diff between two siblings that each changed a few files of a large tree, and
between one of them and the parent (which keeps writing to the volume its children
stand on a snapshot of): the cost must follow the changes, not the tree."""

from __future__ import annotations

import tempfile
from pathlib import Path

from branchbox.bench.measure import Context, Row, close_all, timed
from branchbox.bench.tree import edit_command, make_tree, upload_tree

TITLE = "diff"


def run(ctx: Context) -> list[Row]:
    dirs = ctx.pick(20, 100)
    ctx.step(f"building a {dirs * 100}-file tree")
    with tempfile.TemporaryDirectory() as tmp, ctx.sandbox() as parent:
        path = upload_tree(parent, make_tree(Path(tmp), dirs, 100))
        a, b = parent.fork(2)
        a.exec(edit_command(path, 10, "a"))
        b.exec(edit_command(path, 10, "b"))
        parent.exec(edit_command(path, 10, "p"))
        ctx.step("diff")
        siblings = timed(lambda: a.diff(b, paths=["/root"]), ctx.pick(3, 20))
        with_parent = timed(lambda: a.diff(parent, paths=["/root"]), ctx.pick(3, 20))
        close_all((a, b))
    tree = f"a {dirs * 100}-file tree"
    return [Row(f"diff, 10 files changed on each side of {tree}", siblings),
            Row(f"diff of a child and its parent, 10 changed on each side of {tree}",
                with_parent)]
