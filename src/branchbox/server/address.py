"""Where a daemon listens: shared by the server (to bind) and the SDK (to connect).

Kept free of heavy imports: the SDK reads it without loading the server.
"""

from __future__ import annotations

import socket
from pathlib import Path

SOCKET_NAME = "branchbox.sock"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8787


def socket_path(data_dir: Path) -> Path:
    """The unix socket of the daemon that serves ``data_dir``."""
    return data_dir / SOCKET_NAME


def tcp_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket for uvicorn (``sockets=[...]``), made with its protocol named.

    asyncio turns Nagle's algorithm off only on connections whose socket says
    ``IPPROTO_TCP``, and an accepted socket inherits the listener's; a listener made by
    ``socket.create_server`` says 0, so every answer on a kept-alive connection waited
    for the client's delayed ACK: 44 ms per call instead of ~2.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # as create_server: IPv6 only, never both stacks
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock
