"""Who may call the E2B routes, and which sandbox a sandbox-plane request is for.

E2B's control plane authenticates with ``X-API-Key``: here, one of the daemon's
own keys. Its sandbox plane does not send that key: it sends the per-sandbox
access token the control plane handed out at create/connect (``X-Access-Token``,
or ``E2B-Traffic-Access-Token`` from the code interpreter). Our token is an HMAC
of the sandbox id under a secret derived from the daemon's keys, so it needs no
storage, survives a daemon restart with the same keys, and a fork child's token
comes with its own create response. A daemon without keys checks nothing, as
for every other route.

The sandbox is named by the ``E2b-Sandbox-Id`` header (``E2B_SANDBOX_URL`` mode), or
by a ``<port>-<sandbox id>.<domain>`` Host (E2B's own addressing).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Annotated

from fastapi import Depends, Request

from branchbox.engine import errors
from branchbox.server.errors import AuthError

_HOST = re.compile(r"^(\d{1,5})-(sbx_[0-9a-f]{32})\.")
_ID = re.compile(r"^sbx_[0-9a-f]{32}$")


def _secret(keys: frozenset[str]) -> bytes:
    return hashlib.sha256(b"branchbox e2b access\0" + b"\0".join(
        sorted(k.encode() for k in keys))).digest()


def access_token(request: Request, sandbox_id: str) -> str | None:
    """The sandbox's access token, or None when the daemon has no keys (nothing to check)."""
    keys: frozenset[str] = request.app.state.api_keys
    if not keys:
        return None
    return hmac.new(_secret(keys), sandbox_id.encode(), hashlib.sha256).hexdigest()


def _api_key_ok(request: Request) -> bool:
    keys: frozenset[str] = request.app.state.api_keys
    given = request.headers.get("x-api-key", "").encode()
    # compare_digest against every key: the time taken says nothing about which was close.
    return any([hmac.compare_digest(given, key.encode()) for key in keys])


async def require_e2b_key(request: Request) -> None:
    """The control plane's check: ``X-API-Key`` is one of the daemon's keys."""
    if request.app.state.api_keys and not _api_key_ok(request):
        raise AuthError()


def sandbox_of(request: Request) -> str:
    """The id of the sandbox a sandbox-plane request is for (400 without one), once the
    request has shown its token (401)."""
    sandbox_id = request.headers.get("e2b-sandbox-id")
    if sandbox_id is None and (match := _HOST.match(request.headers.get("host", ""))):
        sandbox_id = match.group(2)
    if sandbox_id is None or not _ID.match(sandbox_id):
        raise errors.InvalidRequest("no sandbox named: send E2b-Sandbox-Id (sbx_ and 32 hex "
                                    "digits) or use a <port>-<sandbox id>.<domain> host")
    expected = access_token(request, sandbox_id)
    if expected is not None and not _api_key_ok(request):
        given = [request.headers.get(h, "") for h in ("x-access-token",
                                                       "e2b-traffic-access-token")]
        if not any([hmac.compare_digest(g.encode(), expected.encode()) for g in given]):
            raise AuthError()
    return sandbox_id


SandboxId = Annotated[str, Depends(sandbox_of)]
