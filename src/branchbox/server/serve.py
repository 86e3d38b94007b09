"""Running the daemon: the app under uvicorn, on a private unix socket or on TCP.

The default listener is ``<data_dir>/branchbox.sock`` with mode 0600: only
root can reach it, which is the same trust the daemon itself needs. The
socket is bound here (not by uvicorn, which would chmod it 0666). SIGINT and
SIGTERM shut down gracefully: the app's lifespan stops the engine, which
closes every sandbox.

A TCP listener always wants an API key: the configured ones, else one made on
first start and kept (0600) in the data directory, whose path is printed.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType

import uvicorn

from branchbox.engine.config import DEFAULT_DATA_DIR, EngineConfig
from branchbox.engine.sandboxes import Engine
from branchbox.server.address import DEFAULT_HOST, DEFAULT_PORT, socket_path, tcp_listener
from branchbox.server.app import DEFAULT_MAX_UPLOAD, create_app
from branchbox.server.stop_signal import sigterm_exits_cleanly

API_KEY_FILE = "api-key"


class ServeError(RuntimeError):
    """The daemon cannot start listening; the message says why and what to do."""


def announce(url: str) -> None:
    print(f"branchbox listening on {url}", flush=True)


def serve(data_dir: Path | str = DEFAULT_DATA_DIR, host: str | None = None,
          port: int | None = None, storage: str | None = None, *,
          api_keys: Iterable[str] = (), max_upload: int = DEFAULT_MAX_UPLOAD,
          on_listening: Callable[[str], None] = announce) -> None:
    """Serve until SIGINT or SIGTERM; TCP if ``host`` or ``port`` is given, else the socket.

    ``storage`` None means the engine's default (``$BRANCHBOX_STORAGE``, else "auto").
    """
    data_dir = Path(data_dir).absolute()
    # Not 0700: a sandbox's mapped root must traverse it to attach its root filesystem.
    # The socket inside is what guards the API, and it is 0600.
    data_dir.mkdir(parents=True, exist_ok=True)
    config = EngineConfig(data_dir=data_dir)
    if storage is not None:
        config.storage = storage
    api_keys = frozenset(api_keys)
    tcp = host is not None or port is not None
    if tcp and not api_keys:  # a TCP port is open to whoever reaches it: never without a key
        key_file = data_dir / API_KEY_FILE
        api_keys = frozenset([generated_api_key(key_file)])
        print(f"branchbox: no API key configured for TCP; clients must send the one in "
              f"{key_file} (root only): `sudo cat {key_file}`, then set BRANCHBOX_API_KEY "
              "(or PODFLARE_API_KEY) to it", flush=True)
    app = create_app(Engine(config), api_keys=api_keys, max_upload=max_upload)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not tcp:
        path = socket_path(data_dir)
        sock, url = _bind_unix(path), f"unix://{path}"
    else:
        sock = _bind_tcp(host or DEFAULT_HOST, DEFAULT_PORT if port is None else port)
        bound_host, bound_port = sock.getsockname()[:2]
        url = f"http://[{bound_host}]:{bound_port}" if ":" in bound_host else \
            f"http://{bound_host}:{bound_port}"
    # No access log: a line per request costs a small call a good part of its latency
    # (and floods the log); failures are still logged.
    server = _Server(uvicorn.Config(app, timeout_graceful_shutdown=10, access_log=False))
    app.state.server = server  # streams that never end (GET /v1/events) end when it stops
    try:
        with sigterm_exits_cleanly():  # so the `finally` below still removes the socket file
            on_listening(url)
            server.run(sockets=[sock])
    finally:
        sock.close()
        if sock.family == socket.AF_UNIX:
            Path(url.removeprefix("unix://")).unlink(missing_ok=True)


class _Server(uvicorn.Server):
    """uvicorn's server, which tells the app the moment a stop begins (server.stopping)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.config.app.state.stop_signal.begin()
        super().handle_exit(sig, frame)


def generated_api_key(path: Path) -> str:
    """The key in ``path``, made (random, mode 0600) the first time a TCP server needs one."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_text().strip()
        if key:
            return key
        raise ServeError(f"{path} is empty; delete it to have a new API key made") from None
    key = "bb_" + secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    return key


def _bind_unix(path: Path) -> socket.socket:
    if path.exists() or path.is_symlink():
        if _answers(path):
            raise ServeError(f"a branchbox daemon already listens on {path}; stop it first "
                             "or use another --data-dir")
        path.unlink()  # left by a daemon that died: nobody listens on it
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # never world-connectable, not even for an instant
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {path}: {exc}") from exc
    finally:
        os.umask(old_umask)
    return sock


def _bind_tcp(host: str, port: int) -> socket.socket:
    try:
        return tcp_listener(host, port)
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc}") from exc


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True
