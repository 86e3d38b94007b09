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
by a ``<port>-<sandbox id>.<domain>`` Host (E2B's own addressing). A sandbox that is
not there (killed, past its timeout) is a 502 saying it "was not found" on this plane,
as E2B's proxy answers: its SDKs read that as "not running" (``is_running()`` is
False, calls raise ``SandboxNotRunningException``), where a 404 would read as a
missing file or process.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from typing import Annotated

from fastapi import Depends, Request

from branchbox.engine import errors
from branchbox.server.errors import AuthError

_HOST = re.compile(r"^(\d{1,5})-(sbx_[0-9a-f]{32})\.")
_ID = re.compile(r"^sbx_[0-9a-f]{32}$")


NOT_RUNNING = "the sandbox was not found"
NOT_RUNNING_STATUS = 502


def _secret(keys: frozenset[str]) -> bytes:
    return hashlib.sha256(b"branchbox e2b access\0" + b"\0".join(
        sorted(k.encode() for k in keys))).digest()


def _token(keys: frozenset[str], sandbox_id: str) -> str:
    return hmac.new(_secret(keys), sandbox_id.encode(), hashlib.sha256).hexdigest()


def access_token(request: Request, sandbox_id: str) -> str | None:
    """The sandbox's access token, or None when the daemon has no keys (nothing to check)."""
    keys: frozenset[str] = request.app.state.api_keys
    return _token(keys, sandbox_id) if keys else None


def api_key_ok(keys: frozenset[str], headers: Mapping[str, str]) -> bool:
    given = headers.get("x-api-key", "").encode()
    # compare_digest against every key: the time taken says nothing about which was close.
    return any([hmac.compare_digest(given, key.encode()) for key in keys])


def access_granted(keys: frozenset[str], headers: Mapping[str, str], sandbox_id: str) -> bool:
    """Whether a sandbox-plane request may reach ``sandbox_id``: it shows the sandbox's
    token or one of the daemon's keys (always, on a daemon without keys)."""
    if not keys or api_key_ok(keys, headers):
        return True
    expected = _token(keys, sandbox_id).encode()
    given = [headers.get(h, "") for h in ("x-access-token", "e2b-traffic-access-token")]
    return any([hmac.compare_digest(g.encode(), expected) for g in given])


def addressed(headers: Mapping[str, str]) -> tuple[str, int | None] | None:
    """(sandbox id, port or None) a request names by E2B's headers or Host; None if it
    names none. The id is not checked here (``is_sandbox_id``)."""
    sandbox_id = headers.get("e2b-sandbox-id")
    port = headers.get("e2b-sandbox-port", "")
    if sandbox_id is None and (match := _HOST.match(headers.get("host", ""))):
        sandbox_id, port = match.group(2), match.group(1)
    if sandbox_id is None:
        return None
    return sandbox_id, int(port) if port.isascii() and port.isdigit() and len(port) <= 5 \
        else None


def is_sandbox_id(text: str) -> bool:
    return _ID.match(text) is not None


async def require_e2b_key(request: Request) -> None:
    """The control plane's check: ``X-API-Key`` is one of the daemon's keys."""
    keys: frozenset[str] = request.app.state.api_keys
    if keys and not api_key_ok(keys, request.headers):
        raise AuthError()


def sandbox_of(request: Request) -> str:
    """The id of the sandbox a sandbox-plane request is for (400 without one), once the
    request has shown its token (401)."""
    target = addressed(request.headers)
    if target is None or not is_sandbox_id(target[0]):
        raise errors.InvalidRequest("no sandbox named: send E2b-Sandbox-Id (sbx_ and 32 hex "
                                    "digits) or use a <port>-<sandbox id>.<domain> host")
    if not access_granted(request.app.state.api_keys, request.headers, target[0]):
        raise AuthError()
    return target[0]


SandboxId = Annotated[str, Depends(sandbox_of)]
