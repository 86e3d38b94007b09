"""``branchbox speculate``, ``best-of-n`` and ``reflexion`` end to end: the real CLI against a
real daemon, on a small git repository whose pytest suite decides which fix is right.

The repository carries nothing but its code and tests. The branches run on image "host" (the
default of these commands): pytest and the package the tests import (httpx) come from this host's
own Debian python (``make test`` installs python3-pytest and python3-httpx), installed in no image
and vendored nowhere. Not the project's virtualenv: a clean clone may live under /tmp, which a
host sandbox gets its own of.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_sdk_sandbox import connected, make_data_dir, serve_daemon  # noqa: F401 - fixture

# The CLI finds the daemon through $BRANCHBOX_URL and $BRANCHBOX_API_KEY, as a user's would.
pytestmark = pytest.mark.usefixtures("connected")

BUGGY = "def add(a, b):\n    return a - b\n"
# httpx: in this host's Debian python (the Makefile's test packages), in no image.
TESTS = ("import httpx\nfrom calc import add\n\n\ndef test_add():\n"
         "    assert httpx.URL('http://x/').host == 'x'\n    assert add(2, 3) == 5\n")
PYTEST = "PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 -m pytest -q -p no:cacheprovider"


@pytest.fixture(scope="module")
def daemon() -> Iterator[str]:
    """A daemon on the btrfs store: image "host" needs a store off the host's root."""
    yield from serve_daemon("btrfs")


def fix(body: str) -> str:
    """A shell line that rewrites calc.py's body."""
    return f"printf 'def add(a, b):\\n    return {body}\\n' > calc.py"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture
def repo() -> Iterator[Path]:
    """A git repository with one failing test."""
    base = make_data_dir("cli-repo")
    path = base / "myrepo"
    path.mkdir()
    (path / "calc.py").write_text(BUGGY)
    (path / "test_calc.py").write_text(TESTS)
    git(path, "init", "-q")
    git(path, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "buggy")
    yield path
    shutil.rmtree(base)


def branchbox(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "branchbox", *args], cwd=cwd,
                          capture_output=True, text=True, env=os.environ.copy(), timeout=240)


def test_speculate_commits_the_first_passing_fix(repo) -> None:
    done = branchbox("speculate", "-c", f"{fix('a * b')} && {PYTEST}",
                     "-c", f"sleep 4; {fix('a + b')} && touch fixed-b && {PYTEST}",
                     "-c", f"{fix('b + a')} && sleep 60 && {PYTEST}", cwd=repo)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"fix-b: success, committed into {repo} (2 files changed)",
        "fix-a: failed (exit 1)",
        "fix-c: aborted",
    ]
    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    assert git(repo, "status", "--porcelain").split() == ["M", "calc.py", "??", "fixed-b"]


def test_the_fix_passes_only_with_the_hosts_toolchain(repo) -> None:
    # The same passing fix on the default image: its Debian python has no pytest.
    done = branchbox("speculate", "-C", str(repo), "--image", "default", "--json",
                     "-c", f"{fix('a + b')} && {PYTEST}")
    assert done.returncode == 1, done.stdout
    candidate = json.loads(done.stdout)["candidates"][0]
    assert candidate["exit_code"] == 1
    assert "No module named pytest" in candidate["stdout"] + candidate["stderr"]


def test_speculate_without_a_passing_fix_leaves_the_repository(repo) -> None:
    done = branchbox("speculate", "-C", str(repo), "-c", f"{fix('a * b')} && {PYTEST}",
                     "-c", "exit 2", "--json")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["winner"] is None and report["committed"] is None
    assert [(c["name"], c["exit_code"]) for c in report["candidates"]] == [("fix-a", 1),
                                                                           ("fix-b", 2)]
    assert "1 failed" in report["candidates"][0]["stdout"]
    assert (repo / "calc.py").read_text() == BUGGY and git(repo, "status", "--porcelain") == ""


def test_speculate_timeout(repo) -> None:
    done = branchbox("speculate", "-C", str(repo), "-c", f"{fix('a + b')}; sleep 60",
                     "--timeout", "2")
    assert done.returncode == 1
    assert "fix-a: timed out" in done.stdout and "timed out" in done.stderr
    assert (repo / "calc.py").read_text() == BUGGY


def test_best_of_n_commits_the_best_score(repo) -> None:
    # attempt 1 and 2 both pass with the top score 2; ties go to the lowest attempt
    script = ('case $BRANCHBOX_ATTEMPT in 0) ' + fix("a * b") + '; echo 1 >&3;; '
              '1) ' + fix("a + b") + '; echo 2 >&3;; *) ' + fix("b + a") + '; echo 2 >&3;; esac'
              f' && {PYTEST}')
    done = branchbox("best-of-n", "-n", "3", "-C", str(repo), "--json", "--", script)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["winner"] == "attempt-1"
    assert report["committed"]["changed"] == ["calc.py"]
    assert [c["score"] for c in report["candidates"]] == [None, 2.0, 2.0]  # 0 failed its tests
    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"


def test_reflexion_feeds_the_failure_forward(repo) -> None:
    # Each attempt appends what it was told; the third one fixes the code.
    script = ('echo "$BRANCHBOX_ATTEMPT:${BRANCHBOX_FEEDBACK:-none}" >> log; '
              'if [ "$BRANCHBOX_ATTEMPT" = 2 ]; then ' + fix("a + b") + '; fi; ' + PYTEST)
    done = branchbox("reflexion", "--retries", "3", "--critique", "echo tried $(wc -l < log)",
                     "-C", str(repo), "--", script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == (
        f"attempt-2: success, committed into {repo} (2 files changed)")
    assert "attempt-0, attempt-1: failed (exit 1)" in done.stdout
    # every attempt starts from the repository as it was, so the log has one line
    assert (repo / "log").read_text() == "2:tried 1\n"
