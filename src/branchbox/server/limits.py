"""A size limit for request bodies that are parsed whole in memory (JSON).

File uploads stream to the sandbox and keep their own, larger limit (see
``files``); every other body is read whole before it is parsed, so a client
could otherwise make the daemon hold hundreds of megabytes per request. A
body declared too large is refused before any of it is read; one without a
declared length (chunked) is cut off as soon as it passes the limit.

Starlette's own body limit would do the counting, but it replaces any
response to an over-long declared body with a plain-text one, and errors here
are always JSON.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from branchbox.server.errors import error_response


class BodyLimit:
    """ASGI middleware: 413 ``PayloadTooLarge`` for bodies over ``limit`` bytes, except
    file uploads (``PUT .../files``, E2B's ``POST /files``) and build contexts (``POST
    /v1/images``), which their handlers bound by the upload limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (
                (scope["method"] == "PUT" and scope["path"].endswith("/files"))
                or (scope["method"] == "POST" and scope["path"] in ("/v1/images", "/files"))):
            await self.app(scope, receive, send)
            return
        message = (f"request body larger than {self.limit} bytes; send big files with "
                   "PUT /v1/sandboxes/{id}/files, which streams")
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await error_response(413, message, "PayloadTooLarge")(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            event = await receive()
            received += len(event.get("body", b""))
            if received > self.limit:
                # FastAPI lets an HTTPException from reading the body through to the
                # handlers (which answer in JSON); other errors would become a 400.
                raise HTTPException(413, message)
            return event

        await self.app(scope, counted, send)
