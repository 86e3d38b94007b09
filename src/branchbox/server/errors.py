"""Every failure as JSON ``{"error": message, "type": kind}`` with the right HTTP status.

The engine's errors carry their own status and kind; this module only adds the
failures that arise at the HTTP edge (bad input, unknown route, bad API key)
and turns anything unexpected into a 500 that names its cause, so a client
never has to parse an HTML error page or guess from a bare status.
"""

from __future__ import annotations

import errno
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from branchbox.engine import errors
from branchbox.server.sandbox_json import SandboxJSON

log = logging.getLogger("branchbox.server")

# Kinds for failures of the HTTP layer itself (the SDK maps them like engine kinds).
_HTTP_KINDS = {404: "EndpointNotFound", 405: "MethodNotAllowed", 413: "PayloadTooLarge"}


class AuthError(errors.EngineError):
    status = 401
    kind = "AuthError"

    def __init__(self) -> None:
        super().__init__("invalid api key")


def describe(exc: BaseException) -> tuple[int, str, str]:
    """(status, message, kind) of any exception, as the client will see it."""
    if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
        exc = errors.PathTooLong()  # the daemon walked a sandbox's deep tree
    if isinstance(exc, errors.EngineError):
        return exc.status, exc.message, exc.kind
    return 500, f"internal error: {type(exc).__name__}: {exc}", "SandboxError"


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    return SandboxJSON({"error": message, "type": kind}, status_code=status)


class InternalErrors:
    """The JSON answer of an exception no handler took (a 500, logged here; an OSError
    ENAMETOOLONG from walking a sandbox's deep tree is a 422). Starlette's outermost handler
    answers it too but re-raises it for the log, and uvicorn then closes the connection:
    the client's next call on that kept-alive connection failed as well (ReadError)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:  # half an answer out: only closing the connection ends it
                raise
            status, message, kind = describe(exc)
            if status == 500:  # a 4xx (a path too long to name) is the sandbox's doing
                log.exception("%s %s failed", scope["method"], scope["path"])
            await error_response(status, message, kind)(scope, receive, send)


def validation_message(exc: RequestValidationError) -> str:
    """One line naming each bad field, e.g. ``n: Input should be a valid integer (got True)``."""
    parts: list[str] = []
    for err in exc.errors():
        # loc starts with where the value came from (body, query, path, header).
        where = ".".join(str(p) for p in err["loc"][1:])
        if err["type"] == "json_invalid":
            msg = f"invalid JSON: {err.get('ctx', {}).get('error', err['msg'])}"
        elif err["loc"] == ("body",):
            msg = "the request body must be a JSON object"
            if err["type"] != "missing":
                msg += f" (got {_short(err.get('input'))})"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] not in ("missing", "value_error"):
                msg += f" (got {_short(err.get('input'))})"
            if not msg.startswith(f"{where} "):
                msg = f"{where}: {msg}"
        if msg not in parts:
            parts.append(msg)
    return "; ".join(parts) or "invalid request"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def install_error_handlers(app: FastAPI) -> None:
    async def engine_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(*describe(exc))

    async def bad_request(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(400, validation_message(exc), "InvalidRequest")

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        kind = _HTTP_KINDS.get(exc.status_code, "InvalidRequest")
        message = str(exc.detail)
        if exc.status_code in (404, 405):
            message = (f"no endpoint {request.method} {request.url.path} "
                       "(is the server older than the client?)")
            # E2B's SDKs call routes this server does not serve (templates, volumes...)
            # and read their error's ``code`` and ``message``: without them they fail
            # on a KeyError instead of saying which endpoint is missing.
            return SandboxJSON({"error": message, "type": kind, "code": exc.status_code,
                                "message": message}, status_code=exc.status_code)
        return error_response(exc.status_code, message, kind)

    app.add_exception_handler(errors.EngineError, engine_error)
    app.add_middleware(InternalErrors)  # outermost when installed last
    app.add_exception_handler(RequestValidationError, bad_request)
    app.add_exception_handler(HTTPException, http_error)
    # Exception handlers for Exception itself run in Starlette's outermost middleware: the
    # client gets this JSON 500, and the error is still re-raised for the server's log.
    app.add_exception_handler(Exception, engine_error)
