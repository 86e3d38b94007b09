"""Shared fixtures: a real engine per storage backend, driven through the public SDK.

The engine runs on the SDK's portal loop and the SDK talks to the FastAPI app
in-process (httpx.ASGITransport): real namespaces, cgroups, mounts and
processes, without a socket in between. Tests that need a daemon process
start one themselves (test_sdk_sandbox.py).

At the end of the session a check fails the run if anything a test created
is still around: mounts, cgroups, loop devices, sandbox processes, network links,
namespaces and nftables tables.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from waiting import eventually

from branchbox import Sandbox
from branchbox.engine.config import EngineConfig
from branchbox.engine.sandboxes import Engine
from branchbox.runtime.cgroups import CGROUP_ROOT
from branchbox.sdk._portal import portal
from branchbox.server.app import create_app

BACKENDS = ("btrfs", "copy")


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("these tests need root: sandboxes are namespaces, cgroups and mounts")


class Harness:
    """One started engine and a factory of SDK sandboxes bound to it."""

    def __init__(self, backend: str, data_dir: Path | None = None) -> None:
        """A new data directory, or ``data_dir`` (a restart on an earlier one's)."""
        require_root()
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix=f"branchbox-test-{backend}-"))
        self.engine = Engine(EngineConfig(data_dir=self.data_dir, storage=backend))
        try:
            portal.run(self.engine.start())
            if self.engine.store.backend.name != backend:
                pytest.fail(f"asked for the {backend} backend, got "
                            f"{self.engine.store.backend.name}")
        except BaseException:  # what the start made goes (its fd keeper, helpers, files)
            with contextlib.suppress(Exception):
                self.stop(keep_data=data_dir is not None)
            raise
        self.app = create_app(self.engine)
        self.backend = backend

    def transport(self) -> httpx.ASGITransport:
        return httpx.ASGITransport(app=self.app)

    def sandbox(self, **kwargs) -> Sandbox:
        return Sandbox(transport=self.transport(), **kwargs)

    def host_path(self, sb: Sandbox, path: str) -> Path:
        """Where a file the sandbox wrote lands on the host: its writable layer."""
        return self.engine.get(sb.id).body.layers.volume / "upper" / path.lstrip("/")

    def start_run(self, sb: Sandbox, code: str, **kwargs) -> threading.Thread:
        """``sb.run_code(code)`` on a thread, returned once the REPL is running it (it
        touches a file first, seen from the host): a call made after this one queues
        behind it, however slow the machine."""
        marker = f"/tmp/run-started-{uuid.uuid4().hex}"
        runner = threading.Thread(target=sb.run_code, args=(
            f"open({marker!r}, 'w').close()\n{code}",), kwargs=kwargs)
        runner.start()
        if not eventually(self.host_path(sb, marker).exists, within=30):
            pytest.fail("the run never started in the sandbox")
        return runner

    def stop(self, keep_data: bool = False) -> None:
        """Stop the engine and remove its data directory (a test run used to leave ~40 MB
        per harness in /tmp), unless ``keep_data``: a restart on it follows."""
        portal.run(self.engine.stop())
        if not keep_data:  # not after a failed stop: rmtree would go into its mounts
            shutil.rmtree(self.data_dir, ignore_errors=True)


@pytest.fixture(scope="session", params=BACKENDS)
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    h = Harness(request.param)
    yield h
    h.stop()


@pytest.fixture
def sandbox(harness: Harness) -> Iterator[Sandbox]:
    with harness.sandbox() as sb:
        yield sb


@pytest.fixture
def workspace() -> Iterator[Path]:
    """A host directory to use as a sandbox's workspace (removed afterwards)."""
    ws = Path(tempfile.mkdtemp(prefix="branchbox-test-ws-"))
    ws.chmod(0o755)
    yield ws
    shutil.rmtree(ws, ignore_errors=True)


@pytest.fixture
def make(harness: Harness) -> Iterator[Callable[..., Sandbox]]:
    """Create sandboxes that are closed at the end of the test, whatever happens."""
    made: list[Sandbox] = []

    def factory(**kwargs) -> Sandbox:
        sb = harness.sandbox(**kwargs)
        made.append(sb)
        return sb

    yield factory
    for sb in made:
        sb.close()


def _leftovers() -> list[str]:
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if "branchbox-test-" in line:
            found.append("mount: " + line)
    for controller in ("memory", "pids", "cpu", "freezer", ""):
        base = CGROUP_ROOT / controller / "branchbox"
        if base.is_dir():
            found += [f"cgroup: {p}" for p in base.glob("*/*") if p.is_dir()]
    for dev in Path("/sys/block").glob("loop*"):
        backing = dev / "loop" / "backing_file"
        if backing.exists() and "branchbox-test-" in backing.read_text():
            found.append(f"loop device: {dev.name} -> {backing.read_text().strip()}")
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            name = comm.read_text().strip()
            stat = (comm.parent / "stat").read_text()
        except OSError:
            continue
        # A zombie holds nothing but its pid; reaping an orphan (the launcher of a family an
        # earlier daemon started) is the host's init's job, which may take a while here.
        if stat[stat.rindex(")") + 2] == "Z":
            continue
        if name in ("bb-zygote", "bb-launcher", "bb-family", "bb-init"):
            found.append(f"process: {comm.parent.name} {name}")
    return found + _network_leftovers()


def _network_leftovers() -> list[str]:
    """A daemon's bridges (``bbr<tag>...``), trunks (``bt<tag>...``) and sandbox ports
    (``bv<tag>...``), its nftables tables (``bb-<tag>``) and the test's "outside"
    namespaces and veths."""
    found = [f"link: {path.name}" for path in Path("/sys/class/net").iterdir()
             if path.name.startswith(("bbr", "bt", "bv", "bbto"))]
    found += [f"netns: {path.name}" for path in Path("/run/netns").glob("bbtest-*")]
    try:
        from branchbox.runtime.nft import Nft, NftError
    except ImportError:
        return found
    try:
        nft = Nft()
    except NftError:
        return found
    try:
        found += [f"nft table: {family} {name}" for family, name in nft.tables()
                  if name.startswith("bb-")]
    finally:
        nft.close()
    return found


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """After the whole suite: no mount, cgroup, loop device, sandbox process, network link,
    namespace or nftables table is left.

    Only what the suite itself left counts: anything that was there before it started
    (another daemon on the machine, say) is not its leak.
    """
    before = set(_leftovers())
    yield
    # Session fixtures (the engines) are finalized before this one, which was set up first.
    # A family's init dies just after its launcher, asynchronously: allow it a moment.
    deadline = time.monotonic() + 3
    while (leaks := sorted(set(_leftovers()) - before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if leaks:
        pytest.fail("the test suite left these behind:\n" + "\n".join(leaks), pytrace=False)
