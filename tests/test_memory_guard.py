"""The memory every sandbox shares (engine.memory_guard): near the bound, the family
holding the most gives way, not the sandbox with the largest process anywhere."""

from __future__ import annotations

import contextlib
import time

import pytest
from served import served_with_key

from branchbox import ReplGone, Sandbox
from branchbox.engine.config import EngineConfig
from branchbox.runtime.cgroups import GroupMemory

KEY = "memory-guard-test-key"
GROW = """
import time
held = []
for _ in range({steps}):
    held.append(b"\\x02" * (16 << 20))  # written: resident, not just reserved
    time.sleep(0.02)
len(held)
"""


def test_the_family_holding_the_most_gives_way() -> None:
    """A bound of 1 GiB on this daemon's sandboxes: one sandbox holds 350 MiB; another
    family's three fork children take 256 MiB each. The kernel's killer would take the
    largest process (the 350 MiB REPL, in the family holding less); the guard stops a
    child of the family holding the most, says so, and the other family goes on."""
    with served_with_key("guard", KEY, BRANCHBOX_SANDBOXES_MEMORY_MB="1024") as daemon:
        group = GroupMemory(EngineConfig(data_dir=daemon.data_dir).cgroup_group)
        assert (group.path / "memory.limit_in_bytes").read_text() == f"{1 << 30}\n"
        assert "gives way from 960 MiB" in daemon.log.read_text()
        other = Sandbox(url=daemon.url, api_key=KEY)
        parent = Sandbox(url=daemon.url, api_key=KEY)
        children: list[Sandbox] = []
        try:
            other.run_code("big = b'\\x01' * (350 << 20)")
            children = parent.fork(3)
            for child in children:  # the one stopped may be one that finished before
                with contextlib.suppress(ReplGone):
                    child.run_code(GROW.format(steps=16), timeout=60)
            stopped = []
            for child in children:
                try:
                    child.run_code("len(held)")
                except ReplGone as exc:
                    stopped.append(str(exc))
            assert stopped, "no sandbox of the family holding the most was stopped"
            assert all("memory they share" in why and "family holding the most" in why
                       for why in stopped), stopped
            assert other.run_code("len(big) >> 20").text == "350"
            assert other.info()["state"] == "ready"
        finally:
            for sb in (*children, parent, other):
                sb.close()
        assert "memory guard stopped" not in daemon.log.read_text()


def test_a_repl_killed_at_the_shared_bound_is_not_told_its_own_limit() -> None:
    """One allocation past the bound of every sandbox (512 MiB here), far below the
    sandbox's own limit: the guard or, faster than it, the kernel stops the REPL, and
    either way the error names the memory sandboxes share, not ``memory_mb``."""
    with served_with_key("guard-bound", KEY, BRANCHBOX_SANDBOXES_MEMORY_MB="512") as daemon, \
            Sandbox(url=daemon.url, api_key=KEY, memory_mb=4096) as sb:
        with pytest.raises(ReplGone) as caught:
            sb.run_code("big = b'\\x03' * (700 << 20)")
        assert "memory they share" in str(caught.value)
        assert "memory_mb" not in str(caught.value)


PAGE_TABLES = r"""
import mmap, os, time
for _ in range(4):
    if os.fork() == 0:  # each 200 MiB of page tables over the zero page, next to no memory
        m = mmap.mmap(-1, 256 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000)
        for i, off in enumerate(range(0, 100 << 30, 2 << 20)):
            m[off]
            if i % 2048 == 2047:
                time.sleep(0.02)
        time.sleep(600)
time.sleep(600)
"""


def test_kernel_memory_counts() -> None:
    """Page tables are memory the sandboxes hold too: four processes of one family with
    200 MiB of page tables each (and no memory of their own to speak of) are that
    family's, stopped by the guard; the kernel would have killed the other family's
    300 MiB REPL, the largest single process."""
    with served_with_key("guard-kmem", KEY, BRANCHBOX_SANDBOXES_MEMORY_MB="1024") as daemon:
        other = Sandbox(url=daemon.url, api_key=KEY)
        attacker = Sandbox(url=daemon.url, api_key=KEY)
        try:
            other.run_code("big = b'\\x01' * (300 << 20)")
            attacker.files.write("/root/pt.py", PAGE_TABLES.encode())
            attacker.exec("python3 /root/pt.py", background=True)
            time.sleep(3)  # the page tables are made within about a second
            try:
                left = attacker.exec("pgrep -c -f 'python3 /root/p[t].py'").stdout.strip()
            except ReplGone as exc:  # the guard stopped the sandbox
                assert "memory they share" in str(exc), exc
            else:  # the kernel, faster than the guard, took the processes it was told to
                assert int(left) < 5, "nothing of the family with the page tables was stopped"
            assert other.run_code("len(big) >> 20").text == "300"
        finally:
            attacker.close()
            other.close()


def test_a_family_that_runs_nothing_gives_up_its_snapshot() -> None:
    """A snapshot holds what its closed sandbox held; when its family holds the most and
    runs nothing, the snapshot is dropped (its process is what the kernel would kill),
    not a sandbox of a family holding less."""
    with served_with_key("guard-snap", KEY, BRANCHBOX_SANDBOXES_MEMORY_MB="1024") as daemon:
        with Sandbox(url=daemon.url, api_key=KEY) as source:
            source.run_code("big = b'\\x01' * (600 << 20)")
            source.snapshot("guard-held")
        other = Sandbox(url=daemon.url, api_key=KEY)
        try:
            other.run_code(GROW.format(steps=26))  # 416 MiB, in steps
            assert other.run_code("len(held)").text == "26"
            assert Sandbox.list_snapshots(url=daemon.url, api_key=KEY) == []
            assert "dropping" in daemon.log.read_text()
        finally:
            other.close()
