"""Running the gateway: its app under uvicorn on a TCP port, until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable, Iterable

import uvicorn

from branchbox.gateway.app import create_gateway
from branchbox.gateway.calls import MAX_MESSAGE, QUEUE
from branchbox.server.address import tcp_listener
from branchbox.server.stop_signal import sigterm_exits_cleanly


def serve_gateway(source: Callable[[], Awaitable[list[str]]], host: str, port: int, *,
                  api_keys: Iterable[str], node_key: str,
                  on_listening: Callable[[str], None],
                  on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve until SIGINT or SIGTERM (a clean exit: status 0)."""
    app = create_gateway(source, api_keys=api_keys, node_key=node_key, on_stop=on_stop)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request it passes on
    sock = tcp_listener(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if sock.family == socket.AF_INET6 else bound_host
    # A client's WebSocket buffers at most ws_max_queue messages of ws_max_size bytes.
    server = uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=10, access_log=False,
                                           log_level="warning", ws_max_size=MAX_MESSAGE,
                                           ws_max_queue=QUEUE))
    try:
        with sigterm_exits_cleanly():
            on_listening(f"http://{shown}:{bound_port}")
            server.run(sockets=[sock])
    finally:
        sock.close()
