"""Where a daemon listens: shared by the server (to bind) and the SDK (to connect).

Kept free of heavy imports: the SDK reads it without loading the server.
"""

from __future__ import annotations

from pathlib import Path

SOCKET_NAME = "branchbox.sock"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8787


def socket_path(data_dir: Path) -> Path:
    """The unix socket of the daemon that serves ``data_dir``."""
    return data_dir / SOCKET_NAME
