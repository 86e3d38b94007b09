"""``/ui`` and what only the page uses: its key cookie, its two static files, its stats.

The page takes the same API keys as the REST API. ``/ui?key=K`` checks K once,
keeps it in an HttpOnly cookie and redirects to ``/ui`` (so the key leaves the
address bar and the history); without a valid key or cookie the page is a 401
with a form that does the same. Everything else the page shows comes from the
API itself (``/v1/events``, the diff endpoint), which accepts the cookie.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from branchbox.server.deps import EngineDep, require_api_key
from branchbox.server.keys import key_accepted
from branchbox.server.ui import page
from branchbox.server.ui.session import COOKIE, authorization

router = APIRouter(include_in_schema=False)
_STATIC = {"ui.js": "text/javascript", "ui.css": "text/css"}
# The page's own script and style only; nothing inline, nothing from elsewhere.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")


def _html(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers={
        "Content-Security-Policy": _CSP, "Cache-Control": "no-store",
        "Referrer-Policy": "no-referrer"})


@router.get("/ui")
async def ui_page(request: Request, engine: EngineDep,
                  key: Annotated[str | None, Query(max_length=4096)] = None) -> Response:
    """The live fork tree of every family; 401 (with a key form) without a key."""
    keys: frozenset[str] = request.app.state.api_keys
    if key is not None:
        if keys and not key_accepted(keys, f"Bearer {key}"):
            return _html(page.refusal("That is not one of this server's API keys."), 401)
        response = RedirectResponse("/ui", status_code=303)
        response.set_cookie(COOKIE, key, httponly=True, samesite="strict", path="/",
                            secure=request.url.scheme == "https")
        return response
    if keys and not key_accepted(keys, authorization(request)):
        return _html(page.refusal("This page needs one of the server's API keys."), 401)
    # The tree as of this event id, without resource use (the script asks /ui/stats for
    # it at once): the page is on screen sooner, and a thousand nodes' cgroups are read
    # off the event loop.
    nodes = page.read_nodes(engine.list(), usage=False)
    held = engine.events.recent()
    nodes += page.retired_nodes(held, nodes)
    runs = [e for e in held if e["type"] == "exec"]
    return _html(page.render(nodes, runs, engine.events.last_id))


@router.get("/ui/static/{name}")
async def static(name: str) -> Response:
    """The page's script and stylesheet, shipped as package data (no build step)."""
    if name not in _STATIC:
        raise HTTPException(404)
    text = (resources.files("branchbox.server.ui") / "static" / name).read_text()
    return Response(text, media_type=_STATIC[name], headers={"Cache-Control": "no-cache"})


@router.get("/ui/stats", dependencies=[Depends(require_api_key)])
async def stats(engine: EngineDep) -> dict:
    """Every live sandbox's state, CPU seconds and memory, read off the event loop: one
    request for the whole page, however many nodes it shows."""
    nodes = await asyncio.to_thread(page.read_nodes, engine.list())
    return {"sandboxes": {n.id: [n.state, n.cpu_seconds, n.memory_bytes] for n in nodes}}
