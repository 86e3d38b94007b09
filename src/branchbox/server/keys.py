"""The API key check every listener of ours applies: the daemon's REST API and the MCP
server over HTTP accept the same ``Authorization: Bearer <key>``.

Standard library only, so a listener that is not the daemon need not import FastAPI.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable


def key_accepted(keys: Iterable[str], authorization: str) -> bool:
    """Whether the ``Authorization`` header carries one of ``keys`` as a bearer token."""
    scheme, _, token = authorization.partition(" ")
    # compare_digest against every key: the time taken says nothing about which was close.
    matches = [hmac.compare_digest(token.encode(), key.encode()) for key in keys]
    return scheme.lower() == "bearer" and any(matches)
