"""A real ``branchbox serve`` process for tests that need one (a socket, a client that
really disconnects, a daemon's own memory), with its own data directory."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest


def wait_started(proc: subprocess.Popen, ready: Callable[[], bool], stop: Callable[[], None],
                 what: str, log: Path, within: float = 120) -> None:
    """Return once ``ready()``; fail with ``log`` if ``proc`` exits or ``within`` s pass."""
    deadline = time.monotonic() + within
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            output = log.read_text(errors="replace")  # before stop(), which may remove it
            stop()
            pytest.fail(f"{what} did not start:\n{output}")
        time.sleep(0.1)


class ServedDaemon:
    """``branchbox serve`` on a free loopback port (copy storage), started and healthy."""

    def __init__(self, prefix: str, env: dict[str, str], *extra: str,
                 data_dir: Path | None = None, port: int | None = None) -> None:
        """``data_dir`` and ``port``: an earlier daemon's, to start again on (default: a
        new one, a free port)."""
        if os.geteuid() != 0:
            pytest.fail("these tests need root: the daemon makes namespaces, cgroups and mounts")
        # Not pytest's tmp_path: its parents are 0700, and a sandbox's mapped root must be
        # able to traverse the data directory to attach its root filesystem.
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix=f"branchbox-test-{prefix}-"))
        self.data_dir.chmod(0o755)
        if port is None:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = self.data_dir / "test-daemon.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "branchbox", "serve", "--host", "127.0.0.1", "--port",
                 str(port), "--data-dir", str(self.data_dir), "--storage", "copy", *extra],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_started(self.proc, self._healthy, self.stop, "the daemon", self.log)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/v1/healthz", timeout=2).text == "ok"
        except httpx.TransportError:
            return False

    def client(self, key: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def stop(self) -> None:
        """SIGTERM (which closes every sandbox), then remove the data directory."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    code = self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    pytest.fail("the daemon ignored SIGTERM for 60 s")
                assert code == 0, self.log.read_text()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.data_dir, ignore_errors=True)


def env_with_key(key: str) -> dict[str, str]:
    """The tests' environment with ``key`` as the daemon's one API key (whatever
    ``BRANCHBOX_API_KEY`` the tests were started with)."""
    return {**{k: v for k, v in os.environ.items() if k != "BRANCHBOX_API_KEY"},
            "BRANCHBOX_API_KEY": key}


@contextmanager
def served_with_key(prefix: str, key: str, **env: str) -> Iterator[ServedDaemon]:
    """A daemon whose one API key is ``key`` and with ``env`` in its environment, stopped
    at the end."""
    served = ServedDaemon(prefix, {**env_with_key(key), **env})
    try:
        yield served
    finally:
        served.stop()
