"""The REPL's heap on 2 MiB pages (agent/huge_heap.py): mimalloc preloaded into the REPL
only, never into what it starts; images without mimalloc keep pymalloc."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Harness

from branchbox import Sandbox

HEAP_VARS = ("LD_PRELOAD", "PYTHONMALLOC", "MIMALLOC_LARGE_OS_PAGES", "BRANCHBOX_HUGE_HEAP")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# 200 MB of ~1 KiB str objects, the REPL's ordinary small-object heap.
ALLOCATE = "heap = [str(i).ljust(1000, 'x') for i in range(200_000)]; len(heap)"


def require_thp() -> None:
    """Huge pages need the kernel's THP in madvise or always mode."""
    mode = THP.read_text() if THP.exists() else "missing"
    if "[never]" in mode or mode == "missing":
        pytest.fail(f"transparent huge pages are off on this host ({THP}: {mode.strip()}); "
                    "enable them: echo madvise > " + str(THP))


def repl_maps_mimalloc(sb: Sandbox) -> bool:
    """Whether a process of the sandbox (the REPL: commands never get it) maps
    libmimalloc, seen from the host (the sandbox's own /proc shows only its commands)."""
    pids = sb.info()["resources"]["host_pids"]
    return any("libmimalloc" in _maps(pid) for pid in pids)


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


def leaked(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.split("=")[0] in HEAP_VARS]


def test_the_repl_heap_is_huge_page_backed_and_nothing_it_starts_inherits_the_preload(
        sandbox) -> None:
    require_thp()
    assert sandbox.run_code(ALLOCATE).text == "200000"
    huge = sandbox.info()["resources"]["repl_anon_huge_bytes"]
    assert huge >= 100 << 20, f"REPL AnonHugePages {huge >> 20} MiB after allocating 200 MB"
    assert repl_maps_mimalloc(sandbox)
    env = sandbox.exec("env")
    assert env.exit_code == 0 and leaked(env.stdout) == []
    child = sandbox.run_code(
        "import os, subprocess\n"
        "subprocess.run(['env'], capture_output=True, text=True).stdout")
    assert child.text and "PATH=" in child.text and leaked(eval(child.text)) == []
    assert sandbox.run_code(f"[n for n in {HEAP_VARS!r} if n in os.environ]").text == "[]"
    background = sandbox.exec("env > /tmp/env.txt", background=True)
    background.wait()
    assert leaked(sandbox.files.read("/tmp/env.txt").decode()) == []


def test_a_fork_child_keeps_the_huge_page_heap(sandbox) -> None:
    require_thp()
    sandbox.run_code(ALLOCATE)
    (child,) = sandbox.fork(1)
    try:
        assert child.run_code("heap[-1][:6], len(heap)").text == "('199999', 200000)"
        child.run_code("more = [str(i).ljust(1000, 'y') for i in range(100_000)]")
        assert child.info()["resources"]["repl_anon_huge_bytes"] >= 50 << 20
        assert leaked(child.exec("env").stdout) == []
    finally:
        child.close()


def test_the_users_own_allocator_variables_are_kept(make) -> None:
    """Only what the launcher added is dropped: a sandbox's env naming the same
    variables reaches user code and its commands."""
    sb = make(env={"PYTHONMALLOC": "pymalloc", "LD_PRELOAD": ""})
    assert sb.run_code("import os; os.environ['PYTHONMALLOC']").text == "'pymalloc'"
    assert sorted(leaked(sb.exec("env").stdout)) == ["LD_PRELOAD=", "PYTHONMALLOC=pymalloc"]


def test_an_image_without_mimalloc_keeps_pymalloc(harness, make) -> None:
    Sandbox.build_image("no-mimalloc", "FROM bookworm\n", transport=harness.transport())
    try:
        sb = make(image="no-mimalloc")
        assert sb.run_code("sum(range(10))").text == "45"
        assert not repl_maps_mimalloc(sb)
        assert sb.info()["resources"]["repl_anon_huge_bytes"] == 0
        assert leaked(sb.exec("env").stdout) == []
        sb.close()
    finally:
        Sandbox.remove_image("no-mimalloc", transport=harness.transport())


def test_a_daemon_started_with_the_switch_off_keeps_pymalloc(monkeypatch) -> None:
    monkeypatch.setenv("BRANCHBOX_HUGE_HEAP", "off")  # the daemon's (this process's) env
    harness = Harness("copy")
    try:
        with harness.sandbox() as sb:
            sb.run_code(ALLOCATE)
            assert not repl_maps_mimalloc(sb)
            assert sb.info()["resources"]["repl_anon_huge_bytes"] == 0
            assert leaked(sb.exec("env").stdout) == []
    finally:
        harness.stop()
