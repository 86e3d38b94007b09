"""Images: list them, save a live sandbox's filesystem as one, remove one."""

from __future__ import annotations

from fastapi import APIRouter

from branchbox.server.deps import NO_CONTENT, EngineDep
from branchbox.server.models import _Body

router = APIRouter(prefix="/v1", tags=["images"])


class SaveImage(_Body):
    name: str


@router.get("/images")
async def list_images(engine: EngineDep) -> dict:
    """Built-in images (built or not yet) and saved ones, each with the sandboxes using it."""
    return {"images": engine.list_images()}


@router.post("/sandboxes/{sandbox_id}/save_image", status_code=201)
async def save_image(sandbox_id: str, body: SaveImage, engine: EngineDep) -> dict:
    """The sandbox's filesystem as it is now (not its memory) as image ``name``:
    ``Sandbox(image=name)`` starts from it. 409 if the name is taken."""
    return await engine.save_image(sandbox_id, body.name)


@router.delete("/images/{name}", **NO_CONTENT)
async def remove_image(name: str, engine: EngineDep) -> None:
    """Delete a saved image; 409 while a sandbox or another image uses it."""
    await engine.remove_image(name)
