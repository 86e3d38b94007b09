"""Workspaces: a host directory, copy-on-write inside sandboxes, committed back first-wins."""

from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path

import pytest

from branchbox import Conflict, InvalidRequest, StaleBranchError


@pytest.fixture
def repo() -> Path:
    root = Path(tempfile.mkdtemp(prefix="bbws-"))
    root.chmod(0o755)
    (root / "src").mkdir()
    (root / "src" / "app.py").write_text("print('v1')\n")
    (root / "README").write_text("readme\n")
    (root / "old").mkdir()
    (root / "old" / "gone.txt").write_text("bye\n")
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    yield root
    # the test's own files; nothing of branchbox's lives here
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()
    root.rmdir()


def snapshot(root: Path) -> dict[str, tuple]:
    found = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        kind = "l" if path.is_symlink() else "d" if path.is_dir() else "f"
        body = os.readlink(path) if kind == "l" else path.read_bytes() if kind == "f" else b""
        found[str(path.relative_to(root))] = (kind, stat.S_IMODE(st.st_mode), body)
    return found


def test_changes_stay_inside_until_commit(harness, repo) -> None:
    before = snapshot(repo)
    with harness.sandbox(workspace=str(repo), cwd=str(repo)) as sb:
        assert sb.exec("pwd").stdout.strip() == str(repo)
        assert sb.exec("cat src/app.py").stdout == "print('v1')\n"
        assert sb.exec("stat -c %u src/app.py").stdout.strip() == "0"  # host root = root
        sb.exec("echo \"print('v2')\" > src/app.py && rm -r old && chmod +x run.sh && "
                "mkdir -p new/empty && ln -s ../README new/link && echo x > new/file")
        assert snapshot(repo) == before  # nothing reached the host yet
        result = sb.commit()
        assert result["changed"]
    after = snapshot(repo)
    assert after["src/app.py"][2] == b"print('v2')\n"
    assert "old" not in after and "old/gone.txt" not in after
    assert after["run.sh"][1] & 0o111
    assert after["new/empty"][0] == "d" and after["new/link"] == ("l", 0o777, "../README")
    assert (repo / "new" / "file").stat().st_uid == 0  # shifted back to the host's root


def test_forks_inherit_the_workspace_and_first_commit_wins(harness, repo) -> None:
    with harness.sandbox(workspace=str(repo)) as parent:
        parent.exec(f"echo parent > {repo}/shared.txt")
        a, b = parent.fork(2)
        assert a.exec(f"cat {repo}/shared.txt").stdout == "parent\n"
        a.exec(f"echo a > {repo}/winner.txt")
        b.exec(f"echo b > {repo}/winner.txt")
        (grandchild,) = a.fork(1)
        assert grandchild.exec(f"cat {repo}/winner.txt").stdout == "a\n"
        a.commit()
        assert (repo / "winner.txt").read_text() == "a\n"
        with pytest.raises(StaleBranchError):
            b.commit()
        assert (repo / "winner.txt").read_text() == "a\n"
        for sb in (a, b, grandchild):
            sb.close()


def test_outside_change_is_a_conflict(harness, repo) -> None:
    with harness.sandbox(workspace=str(repo)) as sb:
        sb.exec(f"echo mine > {repo}/README")
        time.sleep(0.05)
        (repo / "README").write_text("theirs\n")
        with pytest.raises(Conflict, match="README"):
            sb.commit()
        assert (repo / "README").read_text() == "theirs\n"


def test_abort_is_free_and_bad_workspaces_are_refused(harness, repo) -> None:
    before = snapshot(repo)
    with harness.sandbox(workspace=str(repo)) as sb:
        sb.exec(f"rm -rf {repo}/src && echo junk > {repo}/junk")
    assert snapshot(repo) == before
    for bad in ("/", "relative/dir", str(repo / "README"), "/proc"):
        with pytest.raises(InvalidRequest):
            harness.sandbox(workspace=bad)
    with harness.sandbox() as plain, pytest.raises(InvalidRequest, match="no workspace"):
        plain.commit()


def test_diff_shows_what_each_branch_changed_in_the_workspace(harness, workspace: Path) -> None:
    """Two branches of one workspace differ in its files: the workspace is a mount of its
    own, so a diff of the root's layers saw nothing there (every answer was empty)."""
    (workspace / "kept.txt").write_text("kept\n")
    (workspace / "gone.txt").write_text("gone\n")
    (workspace / "sub").mkdir()
    (workspace / "sub" / "edited.txt").write_text("before\n")
    ws = str(workspace)
    with harness.sandbox(workspace=ws) as sb:
        (kid,) = sb.fork(1)
        kid.run_code(f"import os\nos.remove({ws + '/gone.txt'!r})\n"
                     f"open({ws + '/sub/edited.txt'!r}, 'w').write('after\\n')\n"
                     f"open({ws + '/new.txt'!r}, 'w').write('new\\n')\n"
                     "open('/root/elsewhere.txt', 'w').close()")
        assert sb.diff(kid) == {"added": ["/root/elsewhere.txt", f"{ws}/new.txt"],
                                "removed": [f"{ws}/gone.txt"],
                                "modified": [f"{ws}/sub/edited.txt"]}
        assert sb.diff(kid, paths=[f"{ws}/sub"]) == {
            "added": [], "removed": [], "modified": [f"{ws}/sub/edited.txt"]}
        assert kid.diff(sb, paths=["/"])["added"] == [f"{ws}/gone.txt"]
