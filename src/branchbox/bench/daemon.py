"""A private daemon for one benchmark run, in a fresh data directory.

Not the default daemon: numbers must not be disturbed by anyone else's
sandboxes, and a benchmark must not leave 1,000 children in someone's store.
It is a separate process, as in production, so the SDK's cost (HTTP over the
unix socket) is part of every number.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from branchbox.server.address import socket_path

START_TIMEOUT = 120.0  # the first start may build the default image


class DaemonError(RuntimeError):
    """The benchmark daemon did not start; the message names its log."""


class Daemon:
    """``branchbox serve`` on a temporary data directory, stopped (and the directory
    removed) on exit."""

    def __init__(self, api_key: str | None = None, node: str | None = None) -> None:
        """With ``api_key``, on a free loopback TCP port with that key (for clients that
        speak only TCP, such as E2B's SDKs); else on the data directory's unix socket.
        ``node``: its name as a node of a cluster (a gateway's tests)."""
        self.data_dir = Path(tempfile.mkdtemp(prefix="branchbox-bench-"))
        self.log_path = self.data_dir / "daemon.log"
        self.api_key = api_key
        self.port: int | None = None
        self.url = f"unix://{socket_path(self.data_dir)}"
        if api_key is not None:
            self.port = _free_port()
            self.url = f"http://127.0.0.1:{self.port}"
        self.node = node
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Daemon:
        self.start()
        return self

    def start(self) -> None:
        """Start the daemon on the data directory (again, after :meth:`kill`) and wait
        until it serves."""
        command = [sys.executable, "-m", "branchbox", "serve", "--data-dir", str(self.data_dir)]
        env = dict(os.environ)
        if self.port is not None:
            command += ["--host", "127.0.0.1", "--port", str(self.port)]
            env["BRANCHBOX_API_KEY"] = str(self.api_key)
        if self.node is not None:
            command += ["--node", self.node]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._stop()
                raise DaemonError(f"the benchmark daemon did not start; see {self.log_path}")
            time.sleep(0.01)

    def kill(self) -> None:
        """kill -9, as a crash would: its sandboxes run on (engine.reattach)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def _healthy(self) -> bool:
        """The socket file exists before the engine has started; only healthz tells."""
        return _healthz_ok(("127.0.0.1", self.port) if self.port is not None
                           else str(socket_path(self.data_dir)))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop()
        if exc_type is None:  # on failure, keep the log for whoever looks into it
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM closes every sandbox and unmounts the store
            self.proc.wait(120)


class Gateway:
    """``branchbox gateway`` in front of ``nodes`` (their URLs) on a free loopback port,
    taking ``api_key`` from clients and showing the nodes ``node_key``; stopped on exit."""

    def __init__(self, nodes: list[str], api_key: str, node_key: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="branchbox-gateway-", suffix=".log")[1])
        env = {**os.environ, "BRANCHBOX_API_KEY": api_key, "BRANCHBOX_NODE_KEY": node_key}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "branchbox", "gateway", "--nodes", ",".join(nodes),
                 "--port", str(self.port)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not _healthz_ok(("127.0.0.1", self.port)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise DaemonError(f"the gateway did not start:\n{self.log_path.read_text()}")
            time.sleep(0.02)

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM, which it answers with a clean exit (status 0, checked)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            if self.proc.wait(30) != 0:
                raise DaemonError(f"the gateway's stop failed:\n{self.log_path.read_text()}")
        self.log_path.unlink(missing_ok=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _healthz_ok(address: tuple[str, int] | str) -> bool:
    """Whether ``GET /v1/healthz`` answers 200 at a TCP or unix socket address. A plain
    socket: httpx leaks one when a unix socket refuses the connection."""
    try:
        with socket.socket(socket.AF_UNIX if isinstance(address, str) else socket.AF_INET) \
                as sock:
            sock.settimeout(5)
            sock.connect(address)
            sock.sendall(b"GET /v1/healthz HTTP/1.0\r\nHost: branchbox\r\n\r\n")
            return sock.recv(64).split(b" ")[1:2] == [b"200"]
    except OSError:
        return False
