"""Branching a source tree: ``cp -r`` and ``git worktree add`` against fork(1) of a
sandbox whose /root holds the same tree, and against a workspace branch
(``Sandbox(workspace=DIR)``, a host directory mounted copy-on-write) and its
``commit()`` when the server supports workspaces.
"""

from __future__ import annotations

import itertools
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from branchbox.bench.measure import Context, Ratio, Row, close_all, timed
from branchbox.bench.tree import edit_command, make_tree, upload_tree
from branchbox.sdk import Sandbox, SandboxError

TITLE = "branching a workspace (a source tree)"
EDITED = 10
# No automatic gc: it packs loose objects in the background, under a running cp -r.
GIT = ("git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "-c", "gc.auto=0")


def sh(*argv: str | Path, cwd: Path | None = None) -> None:
    """Run a host command; a failure says what the command said."""
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed: {done.stderr.strip()}")


def run(ctx: Context) -> list[Row]:
    dirs, reps = ctx.pick(20, 100), ctx.pick(3, 10)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ctx.step(f"building a {dirs * 100}-file tree and its git repository")
        tree = make_tree(tmp, dirs, 100)
        sh(*GIT, "init", "-q", cwd=tree)
        sh(*GIT, "add", "-A", cwd=tree)
        sh(*GIT, "commit", "-qm", "tree", cwd=tree)
        sh(*GIT, "gc", "-q", cwd=tree)  # a real repository is packed
        size = f"{dirs * 100}-file tree"
        ctx.step("cp -r / git worktree add")
        copies = _numbered(tmp / "copy")
        worktrees = _numbered(tmp / "worktree")
        cp = Row(f"cp -r of the {size}", timed(lambda: sh("cp", "-r", tree, copies()), reps))
        wt = Row(
            f"git worktree add of the {size}",
            timed(
                lambda: sh(*GIT, "worktree", "add", "-q", "--detach", worktrees(), cwd=tree), reps
            ),
        )
        git_commit = Row(
            f"git commit of {EDITED} edited files in a worktree",
            _git_commits(tree, tmp / "worktree-0", reps),
        )
        ctx.step("fork(1) of a sandbox holding the tree")
        with ctx.sandbox() as holder:
            upload_tree(holder, tree)
            fork = Row(
                f"fork(1) of a sandbox holding the {size} in /root",
                timed(lambda: holder.fork(1), reps, close_all),
                ratios=[Ratio(cp.name, faster=True), Ratio(wt.name, faster=True)],
            )
        ctx.step("workspace branch")
        branch, commit = _workspace(ctx, tree, reps, size, cp, wt, git_commit)
    return [cp, wt, fork, branch, git_commit, commit]


def _numbered(stem: Path) -> Callable[[], Path]:
    """A fresh destination per repetition: cp and git refuse to overwrite."""
    count = itertools.count()
    return lambda: stem.with_name(f"{stem.name}-{next(count)}")


def _git_commits(tree: Path, worktree: Path, reps: int) -> list[float]:
    """Commit EDITED edited files in an existing worktree, ``reps`` times."""
    samples = []
    for rep in range(reps):
        sh("sh", "-c", edit_command(".", EDITED, f"edit {rep}"), cwd=worktree)
        samples += timed(lambda: sh(*GIT, "commit", "-qam", "edit", cwd=worktree), 1)
    return samples


def _workspace(
    ctx: Context, tree: Path, reps: int, size: str, cp: Row, wt: Row, git_commit: Row
) -> tuple[Row, Row]:
    """Workspace branch creation and commit, or two "not yet available" rows."""
    branch_name = f"workspace branch: Sandbox(workspace=) of the {size}"
    commit_name = f"workspace commit() of {EDITED} edited files"
    try:
        ctx.sandbox(workspace=tree).close()
    except (SandboxError, TypeError, NotImplementedError) as exc:
        why = f"not yet available: {type(exc).__name__}: {exc}"
        return Row(branch_name, [], note=why), Row(commit_name, [], note=why)
    branch = Row(
        branch_name,
        timed(lambda: ctx.sandbox(workspace=tree), reps, Sandbox.close),
        ratios=[Ratio(cp.name, faster=True), Ratio(wt.name, faster=True)],
    )
    commits = []
    for rep in range(reps):
        with ctx.sandbox(workspace=tree) as sandbox:
            sandbox.exec(edit_command(str(tree), EDITED, f"commit {rep}"))
            commits += timed(sandbox.commit, 1)
    return branch, Row(commit_name, commits, ratios=[Ratio(git_commit.name, faster=True)])
