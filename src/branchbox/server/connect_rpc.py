"""The Connect protocol's JSON flavour, server side: what E2B's in-sandbox daemon speaks.

A unary call is a plain POST of a JSON message answered with a JSON message;
a failure is an HTTP status with ``{"code": "<connect code>", "message"}``.
A server-streaming call sends and answers *envelopes* (``application/connect+json``):
one flag byte, a 4-byte big-endian length, then the JSON message; the stream
ends with an envelope flagged ``END_STREAM`` that carries ``{}`` or
``{"error": {"code", "message"}}`` (the HTTP status is already 200 by then).
Client streaming is not served (E2B's SDK only uses it for an optional input path).

The handlers behind these routes are translations onto the engine; this module
only frames and unframes, maps engine errors to Connect codes, and enforces the
``Connect-Timeout-Ms`` a client sends with a stream.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from branchbox.engine import errors
from branchbox.server.e2b_access import NOT_RUNNING
from branchbox.server.errors import describe
from branchbox.server.sandbox_json import SandboxJSON

STREAM_TYPE = "application/connect+json"
END_STREAM = 0x02
# A request message is small (a path, a command line, some input): larger is refused.
MAX_MESSAGE = 16 << 20

# Connect codes and the HTTP statuses a unary error travels with (Connect's own table).
_STATUS_OF_CODE = {
    "invalid_argument": 400, "unauthenticated": 401, "permission_denied": 403,
    "not_found": 404, "already_exists": 409, "resource_exhausted": 429,
    "failed_precondition": 412, "unimplemented": 501, "internal": 500,
    "unavailable": 503, "deadline_exceeded": 504, "canceled": 499,
}
_CODE_OF_STATUS = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied",
                   404: "not_found", 409: "already_exists", 413: "resource_exhausted",
                   429: "resource_exhausted", 501: "unimplemented", 502: "unavailable",
                   503: "unavailable", 504: "deadline_exceeded"}


class RpcError(errors.EngineError):
    """A failure with its Connect code named directly (not derived from an HTTP status)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.status = _STATUS_OF_CODE[code]


def code_of(exc: BaseException) -> tuple[str, str]:
    """(Connect code, message) of any exception, as a client will see it."""
    if isinstance(exc, RpcError):
        return exc.code, exc.message
    if isinstance(exc, errors.SandboxTimeout):
        return "deadline_exceeded", exc.message
    if isinstance(exc, errors.SandboxNotFound):  # what E2B's proxy's 502 is to a Connect client
        return "unavailable", NOT_RUNNING
    status, message, _ = describe(exc)
    return _CODE_OF_STATUS.get(status, "internal" if status >= 500 else "unknown"), message


def error_response(exc: BaseException) -> JSONResponse:
    code, message = code_of(exc)
    return SandboxJSON({"code": code, "message": message},
                        status_code=_STATUS_OF_CODE.get(code, 500))


async def read_unary(request: Request) -> dict:
    """The JSON message of a unary call (an empty body is the empty message)."""
    return _message(await _body(request))


async def read_stream_request(request: Request) -> dict:
    """The one request message of a server-streaming call, unwrapped from its envelope."""
    body = await _body(request)
    if len(body) < 5:
        raise RpcError("invalid_argument", "a streaming request must be one enveloped message")
    flags, size = struct.unpack(">BI", body[:5])
    if flags & 0x01:
        raise RpcError("invalid_argument", "compressed messages are not supported")
    if size != len(body) - 5:
        raise RpcError("invalid_argument", "the envelope's length does not match its body")
    return _message(body[5:])


async def _body(request: Request) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_MESSAGE:
            raise RpcError("resource_exhausted", f"message larger than {MAX_MESSAGE} bytes")
    return bytes(body)


def _message(data: bytes) -> dict:
    if not data.strip():
        return {}
    try:
        message = json.loads(data)
    except ValueError as exc:
        raise RpcError("invalid_argument", f"invalid JSON: {exc}") from None
    except RecursionError:  # "[[[[..." past the parser's depth: a 400, not our 500
        raise RpcError("invalid_argument", "invalid JSON: nested too deeply") from None
    if not isinstance(message, dict):
        raise RpcError("invalid_argument", "a message must be a JSON object")
    return message


def envelope(message: dict, flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def timeout_of(request: Request) -> float | None:
    """The client's deadline for the call in seconds (``Connect-Timeout-Ms``), if any."""
    raw = request.headers.get("connect-timeout-ms", "")
    return int(raw) / 1000 if raw.isdigit() and int(raw) > 0 else None


async def unary(request: Request,
                handler: Callable[[dict], Awaitable[dict | bytes]]) -> Response:
    """Answer a unary call with ``handler(message)`` (a message, or one already encoded
    as JSON in pieces: a long one), or its failure as a Connect error."""
    try:
        reply = await handler(await read_unary(request))
        if isinstance(reply, bytes):
            return Response(reply, media_type="application/json")
        return SandboxJSON(reply)
    except Exception as exc:  # every failure reaches the client as a Connect error
        return _reported(exc)


async def server_stream(request: Request,
                        handler: Callable[[dict], AsyncIterator[dict]]) -> StreamingResponse:
    """Answer a server-streaming call with the messages of ``handler(request message)``.

    The request is read here, before the response exists: once a streaming response
    runs, Starlette's disconnect watch consumes what the client sends."""
    try:
        messages = handler(await read_stream_request(request))
    except Exception as exc:
        messages = _failing(exc)
    return _stream(messages, timeout_of(request))


async def _failing(exc: Exception) -> AsyncIterator[dict]:
    raise exc
    yield {}  # a generator: the error ends the stream in its last envelope


def _stream(messages: AsyncIterator[dict], timeout: float | None) -> StreamingResponse:
    """``messages`` as enveloped JSON, ended by the end-of-stream envelope (with the error
    that stopped the stream, if one did; ``deadline_exceeded`` once ``timeout`` passes)."""

    async def body() -> AsyncIterator[bytes]:
        end: dict = {}
        try:
            async with asyncio.timeout(timeout):
                async for message in messages:
                    yield envelope(message)
        except TimeoutError:
            end = {"error": {"code": "deadline_exceeded",
                             "message": f"the call's deadline of {timeout:g} s passed"}}
        except Exception as exc:  # the status line is gone: report in the last envelope
            code, message = code_of(exc)
            end = {"error": {"code": code, "message": message}}
        finally:
            await messages.aclose()  # type: ignore[attr-defined]
        yield envelope(end, END_STREAM)

    return StreamingResponse(body(), media_type=STREAM_TYPE)


def _reported(exc: Exception) -> JSONResponse:
    if describe(exc)[0] == 500 and not isinstance(exc, errors.EngineError):
        raise exc  # a bug of ours: the app's handler logs it and answers 500
    return error_response(exc)
