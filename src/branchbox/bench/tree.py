"""A source-like directory tree, made on the host and placed in a sandbox unchanged.

The diff and workspace suites need the same many-small-files tree on both
sides of a comparison; it is built once on the host and shipped as a tar
archive, so "the same tree" is literally the same bytes.
"""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

from branchbox.sdk import CommandResult, Sandbox

SANDBOX_PARENT = "/root"


def make_tree(root: Path, dirs: int, files: int) -> Path:
    """``dirs`` × ``files`` text files of 1–4 KiB under ``root/tree``; returns that path."""
    rng = random.Random(0)
    tree = root / "tree"
    for d in range(dirs):
        (tree / f"pkg{d}").mkdir(parents=True)
        for f in range(files):
            lines = rng.randint(16, 64)
            (tree / f"pkg{d}" / f"mod{f}.py").write_text(
                "".join(f"value_{i} = {rng.random()!r}  # line {i}\n" for i in range(lines))
            )
    return tree


def upload_tree(sandbox: Sandbox, tree: Path) -> str:
    """Put ``tree`` under /root in the sandbox; returns its path there."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(tree, arcname=tree.name)
    sandbox.files.write("/tmp/tree.tar", buf.getvalue())
    result = sandbox.exec(
        f"tar -xf /tmp/tree.tar -C {SANDBOX_PARENT} && rm /tmp/tree.tar", timeout=600
    )
    assert isinstance(result, CommandResult)  # not background=True
    if result.exit_code != 0:
        raise RuntimeError(f"unpacking the tree failed: {result.stderr}")
    return f"{SANDBOX_PARENT}/{tree.name}"


def edit_command(path: str, count: int, text: str) -> str:
    """A shell command appending ``text`` to the first ``count`` modules of pkg0."""
    return f"for f in $(seq 0 {count - 1}); do echo '# {text}' >> {path}/pkg0/mod$f.py; done"
