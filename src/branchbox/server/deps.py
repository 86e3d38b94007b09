"""What handlers share: the engine, the replay log, the API key check, the 204 route options."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Response, WebSocket

from branchbox.engine.sandboxes import Engine
from branchbox.server.errors import AuthError
from branchbox.server.keys import key_accepted
from branchbox.server.replay import EventLog
from branchbox.server.ui.session import authorization


async def _engine(request: Request) -> Engine:
    return request.app.state.engine


EngineDep = Annotated[Engine, Depends(_engine)]


async def _events(request: Request) -> EventLog:
    return request.app.state.events


EventsDep = Annotated[EventLog, Depends(_events)]
# Route options of endpoints that answer 204 with an empty body.
NO_CONTENT: dict = {"status_code": 204, "response_class": Response}


async def require_api_key(request: Request) -> None:
    """``Authorization: Bearer <key>`` (Podflare's scheme), when the server has keys at all."""
    keys: frozenset[str] = request.app.state.api_keys
    if not keys:
        return
    if not key_accepted(keys, authorization(request)):
        raise AuthError()


def ws_key_ok(ws: WebSocket) -> bool:
    """:func:`require_api_key` for a WebSocket (whose dependencies cannot take a Request)."""
    keys: frozenset[str] = ws.app.state.api_keys
    return not keys or key_accepted(keys, ws.headers.get("authorization", ""))
