"""Files inside a sandbox: download and upload as streams, list, stat, exists, remove.

Bodies flow through in chunks both ways, so a multi-gigabyte file costs the
daemon a megabyte or so of memory, never its whole size.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse

from branchbox.engine import errors
from branchbox.server.deps import NO_CONTENT, EngineDep
from branchbox.server.models import SandboxPath, check_sandbox_path
from branchbox.server.streams import bytes_response, list_response, opened

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/files", tags=["files"])
PathQuery = Annotated[SandboxPath, Query(description=(
    "absolute path inside the sandbox; a name that is not UTF-8 as its bytes, "
    "percent-encoded"))]


def _sandbox_path(request: Request, path: PathQuery) -> str:
    """``path`` as the bytes the client sent. A name that is not UTF-8 (any bytes but NUL
    and '/' are a name) comes percent-encoded, as the SDK sends the names a listing
    gives, and is read as ``os.fsdecode`` would: the query parser put U+FFFD for its
    bytes, which names another file."""
    query = request.scope["query_string"].decode("utf-8", "surrogateescape")
    sent = parse_qs(query, keep_blank_values=True, errors="surrogateescape").get("path")
    if not sent or sent[-1] == path:
        return path
    try:
        return check_sandbox_path(sent[-1])
    except ValueError as exc:
        raise errors.InvalidRequest(f"path: {exc}") from None


RawPath = Annotated[str, Depends(_sandbox_path)]
ModeQuery = Annotated[str | None, Query(pattern="^[0-7]{3,4}$",
                                        description="permission bits in octal, e.g. 755")]


@router.get("")
async def read_file(sandbox_id: str, path: RawPath, engine: EngineDep) -> Response:
    """The file's bytes, streamed (404 ``FileNotFound`` if it does not exist)."""
    return bytes_response(await opened(engine.stream(sandbox_id, "read", {"path": path})))


@router.put("")
async def write_file(sandbox_id: str, path: RawPath, request: Request, engine: EngineDep,
                     mode: ModeQuery = None) -> dict:
    """Store the request body at ``path`` (parent directories are created): ``{"size"}``."""
    limit: int = request.app.state.max_upload
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    return await engine.write_file(sandbox_id, path, _limited(request.stream(), limit),
                                   int(mode, 8) if mode else None)


async def _limited(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """Enforce the limit on bodies without a Content-Length (chunked uploads) too."""
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise _too_large(limit)
        yield chunk


def _too_large(limit: int) -> errors.PayloadTooLarge:
    return errors.PayloadTooLarge(f"upload larger than the server's limit of {limit} bytes; "
                                  "split the file or raise the server's --max-upload-mb")


@router.delete("", **NO_CONTENT)
async def remove_file(sandbox_id: str, path: RawPath, engine: EngineDep,
                      recursive: bool = False) -> None:
    await engine.call(sandbox_id, "remove", {"path": path, "recursive": recursive})


@router.get("/list", response_class=StreamingResponse,
            responses={200: {"content": {"application/json": {}}}})
async def list_directory(sandbox_id: str, path: RawPath, engine: EngineDep) -> Response:
    """``{"entries": [...]}`` of a directory, sorted by name; streamed, so a directory
    of any size is answered in pieces (an error before the first is a status)."""
    return list_response("entries", await opened(engine.list_dir(sandbox_id, path)))


@router.get("/stat")
async def stat_file(sandbox_id: str, path: RawPath, engine: EngineDep) -> dict:
    """Type, size, mode and times of ``path`` (404 ``FileNotFound`` if it does not exist)."""
    return await engine.call(sandbox_id, "stat", {"path": path})


@router.get("/exists")
async def file_exists(sandbox_id: str, path: RawPath, engine: EngineDep) -> dict:
    """``{"exists": bool}``."""
    return await engine.call(sandbox_id, "exists", {"path": path})
