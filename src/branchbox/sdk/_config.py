"""Where the SDK connects, resolved in one place: argument, then environment, then default.

- ``url``: ``http(s)://host:port`` or ``unix:///path/to/socket``; else ``$BRANCHBOX_URL``;
  else the local daemon's socket in ``$BRANCHBOX_DATA_DIR`` (default /var/lib/branchbox),
  which the SDK starts when nothing answers there.
- ``api_key``: else ``$BRANCHBOX_API_KEY``; else none.
"""

from __future__ import annotations

import functools
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import httpx

from branchbox.engine.config import DEFAULT_DATA_DIR
from branchbox.sdk._errors import InvalidRequest
from branchbox.server.address import socket_path

# The host part of request URLs sent over a unix socket (the socket decides where they go).
UNIX_BASE_URL = "http://branchbox"


@functools.cache
def ssl_context(verify: bool) -> ssl.SSLContext:
    """One TLS context of each kind for every client of this process: its HTTP clients
    and its call channels' WebSockets, which so trust the same CAs. httpx makes a new
    context per client unless given one, and every ``Sandbox()`` makes a client: loading
    the CA bundle cost each ~23 ms of CPU (an https URL), and even the unused context of
    a unix socket ~0.1-0.8 ms. A context is safe to share between connections; it is made
    as httpx makes it (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` read once, at the first)."""
    return httpx.create_ssl_context(verify=verify)


@dataclass(frozen=True)
class ClientConfig:
    url: str
    api_key: str | None = None
    # The data directory of the default local daemon, which the SDK may start; None when
    # the caller named a server (then starting one is not ours to do).
    local_data_dir: Path | None = None

    @property
    def socket(self) -> str | None:
        """The unix socket path for ``unix://`` URLs."""
        return self.url.removeprefix("unix://") if self.url.startswith("unix://") else None

    @property
    def base_url(self) -> str:
        return UNIX_BASE_URL if self.socket else self.url


def resolve(url: str | None = None, api_key: str | None = None) -> ClientConfig:
    api_key = api_key or os.environ.get("BRANCHBOX_API_KEY") or None
    url = url or os.environ.get("BRANCHBOX_URL") or None
    if url is None:
        data_dir = Path(os.environ.get("BRANCHBOX_DATA_DIR") or DEFAULT_DATA_DIR)
        return ClientConfig(f"unix://{socket_path(data_dir)}", api_key, data_dir)
    if not url.startswith(("http://", "https://", "unix:///")):
        raise InvalidRequest(f"cannot use the server URL {url!r}",
                             hint="use http://host:port or unix:///path/to/branchbox.sock")
    return ClientConfig(url.rstrip("/"), api_key)
