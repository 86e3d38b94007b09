"""Images: list them, build one from a spec, save a live sandbox's filesystem as one,
remove one."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from branchbox.engine.image_build import build_from_upload
from branchbox.server.deps import NO_CONTENT, EngineDep
from branchbox.server.files import _limited, _too_large
from branchbox.server.models import _Body
from branchbox.server.streams import event_line, ndjson_response

router = APIRouter(prefix="/v1", tags=["images"])


class SaveImage(_Body):
    name: str


@router.get("/images")
async def list_images(engine: EngineDep) -> dict:
    """Built-in images (built or not yet) and saved ones, each with the sandboxes using it."""
    return {"images": engine.list_images()}


@router.post("/images", response_model=None)
async def build_image(
    request: Request, engine: EngineDep,
    name: Annotated[str, Query(max_length=64, description="The new image's name.")],
    spec: Annotated[str, Query(max_length=4096, description="Path of the spec in the "
                               "context tar (left out of what COPY sees).")] = "Dockerfile",
    internet: Annotated[bool | None, Query(description="Egress for RUN steps (default: "
                                           "the server's, as for sandboxes).")] = None,
) -> Response:
    """Build image ``name`` from a spec (a Dockerfile subset: FROM, RUN, ENV, WORKDIR, COPY).
    The body is a tar of the build context holding the spec (at most the server's upload
    limit). NDJSON: ``step`` and ``output`` lines, then ``image`` (the image's info). 400 for
    a bad spec, context or name, 409 if the name is taken, 413 for a context too large; a
    failing step ends the stream with an ``error`` line of type ImageBuildFailed, and no
    image is made."""
    engine.check_image_name(name)  # before reading what may be a large body
    upload = await _receive(request, engine.config.data_dir / "run")
    return await ndjson_response(build_from_upload(engine, name, upload, spec, internet),
                                 lambda header: [event_line(header, "image")])


async def _receive(request: Request, directory: Path) -> Path:
    """The request body in a new private file of ``directory``, within the upload limit."""
    limit: int = request.app.state.max_upload
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    path = directory / f"context-{secrets.token_hex(8)}.tar"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            async for chunk in _limited(request.stream(), limit):
                out.write(chunk)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


@router.post("/sandboxes/{sandbox_id}/save_image", status_code=201)
async def save_image(sandbox_id: str, body: SaveImage, engine: EngineDep) -> dict:
    """The sandbox's filesystem as it is now (not its memory) as image ``name``:
    ``Sandbox(image=name)`` starts from it. 409 if the name is taken."""
    return await engine.save_image(sandbox_id, body.name)


@router.delete("/images/{name}", **NO_CONTENT)
async def remove_image(name: str, engine: EngineDep) -> None:
    """Delete a saved or built image; 409 while a sandbox or another image uses it."""
    await engine.remove_image(name)
