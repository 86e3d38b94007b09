"""E2B's addressing of a sandbox's other ports, onto our port proxy.

E2B reaches a server in a sandbox at ``<port>-<sandbox id>.<domain>`` (what
``sandbox.get_host(port)`` gives), or, in ``E2B_SANDBOX_URL`` mode, with the
``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` headers. Ports 49983 (envd) and 49999
(the code interpreter) are ours to serve (``e2b_envd``, ``e2b_interpreter``); any
other port is the sandbox's own, so such a request is handed, path and query
unchanged, to the port proxy (``/v1/sandboxes/{id}/ports/{port}/...``), HTTP and
WebSocket alike. It must show the sandbox's access token (``E2B-Traffic-Access-Token``
or ``X-Access-Token``) or one of the daemon's keys, as the sandbox plane does; the
proxy's own key check is then satisfied for it.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from branchbox.server.e2b_access import access_granted, addressed, is_sandbox_id
from branchbox.server.errors import error_response

ENVD_PORT, INTERPRETER_PORT = 49983, 49999
E2B_ADDRESSED = "branchbox.e2b_addressed"
"""Set in the scope of a request handed on here: its client sees the port's ``/`` as the
root, not the proxy's path (the proxy keeps a ``Location`` the sandbox sends under it)."""


class SandboxPorts:
    """ASGI middleware: E2B-addressed requests for a sandbox's own ports go to the proxy."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        target = addressed(headers)
        if (target is None or not is_sandbox_id(target[0])
                or target[1] in (None, ENVD_PORT, INTERPRETER_PORT)):
            await self.app(scope, receive, send)
            return
        sandbox_id, port = target
        keys: frozenset[str] = scope["app"].state.api_keys
        if not access_granted(keys, headers, sandbox_id):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await error_response(401, "invalid api key", "AuthError")(scope, receive, send)
            return
        path = f"/v1/sandboxes/{sandbox_id}/ports/{port}{scope['path']}"
        raw = [(k, v) for k, v in scope["headers"] if k != b"authorization"]
        if keys:  # the proxy checks the daemon's key; the token stood in for it here
            raw.append((b"authorization", f"Bearer {next(iter(keys))}".encode()))
        await self.app({**scope, "path": path, "raw_path": path.encode(), "headers": raw,
                        E2B_ADDRESSED: True}, receive, send)
