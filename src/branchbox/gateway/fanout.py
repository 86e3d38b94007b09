"""Listings through the gateway: every node's answer, merged into one.

Nodes that are down are left out and named in ``X-Branchbox-Unavailable`` (their
sandboxes cannot be listed, but the others can). E2B's paged list is paged by the
gateway itself over the merged rows, oldest first, as one daemon pages it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from branchbox.gateway.forward import UNREACHABLE, Credentials, error
from branchbox.gateway.nodes import Node, Nodes

MAX_PAGE = 1000  # a daemon's largest page of E2B's list: what the gateway asks each for
KEEPALIVE_SECONDS = 15.0


async def _ask_all(request: Request, nodes: Nodes, client: httpx.AsyncClient,
                   credentials: Credentials, params: dict[str, str]
                   ) -> tuple[list[tuple[Node, object]], list[Node], Response | None]:
    """(node, JSON answer) of every node that is up, the nodes that failed, and the first
    error answer a node gave (a bad query is every node's 400)."""
    headers = credentials.upstream(request.headers.items())

    async def one(node: Node) -> tuple[Node, httpx.Response | None]:
        try:
            return node, await client.get(node.url + request.url.path, params=params,
                                          headers=headers, timeout=30.0)
        except UNREACHABLE as exc:
            nodes.down(node, f"{type(exc).__name__}: {exc}")
            return node, None

    answers, failed = [], []
    for node, reply in await asyncio.gather(*(one(n) for n in nodes.up())):
        if reply is None:
            failed.append(node)
        elif reply.status_code != 200:
            return [], [], Response(reply.content, status_code=reply.status_code,
                                    media_type=reply.headers.get("content-type"))
        else:
            answers.append((node, reply.json()))
    return answers, failed, None


def _unavailable(nodes: Nodes, failed: list[Node]) -> dict[str, str]:
    down = {n.name or n.url for n in failed} | {
        d["name"] or d["url"] for d in nodes.describe() if not d["up"]}
    return {"X-Branchbox-Unavailable": ",".join(sorted(down))} if down else {}


async def listing(request: Request, nodes: Nodes, client: httpx.AsyncClient,
                  credentials: Credentials) -> Response:
    """The merged answer of a GET in ``routing.LISTINGS``."""
    path = request.url.path
    params = dict(request.query_params)
    paged = path == "/v2/sandboxes"
    if paged:
        try:
            offset = _offset(params.pop("nextToken", None))
            limit = int(params.pop("limit", "100"))
        except ValueError:
            return error(400, "nextToken is not a token this gateway gave, or limit is not "
                              "a number", "InvalidRequest")
        if not 1 <= limit <= MAX_PAGE:
            return error(400, f"limit must be between 1 and {MAX_PAGE}", "InvalidRequest")
        params["limit"] = str(MAX_PAGE)
    answers, failed, refused = await _ask_all(request, nodes, client, credentials, params)
    if refused is not None:
        return refused
    headers = _unavailable(nodes, failed)
    merge: Callable[[list[tuple[Node, object]]], object] = {
        "/v1/sandboxes": lambda a: {"sandboxes": [s for _, r in a for s in r["sandboxes"]]},
        "/v1/images": _images,
    }.get(path, lambda a: sorted((s for _, r in a for s in r),
                                 key=lambda s: (s.get("startedAt") or "", s.get("sandboxID"))))
    merged = merge(answers)
    if paged:
        assert isinstance(merged, list)
        if len(merged) > offset + limit:
            headers["X-Next-Token"] = base64.urlsafe_b64encode(
                json.dumps({"gateway_offset": offset + limit}).encode()).decode()
        merged = merged[offset:offset + limit]
    return JSONResponse(merged, headers=headers)


def _offset(token: str | None) -> int:
    if token is None:
        return 0
    offset = json.loads(base64.urlsafe_b64decode(token.encode()))["gateway_offset"]
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(token)
    return offset


def _images(answers: list[tuple[Node, object]]) -> dict:
    """Each image once, with the nodes that have it (built-in ones are every node's)."""
    by_name: dict[str, dict] = {}
    for node, reply in answers:
        for image in reply["images"]:
            seen = by_name.setdefault(image["name"], {**image, "users": [], "nodes": []})
            seen["users"] += image.get("users") or []
            seen["nodes"].append(node.name or node.url)
            seen["built"] = seen["built"] or image.get("built")
    return {"images": list(by_name.values())}


async def events(request: Request, nodes: Nodes, client: httpx.AsyncClient,
                 credentials: Credentials) -> Response:
    """Every node's lifecycle events, live, as one stream. Each event says its ``node``;
    event ids are each node's own, so they are left out, and resuming (``since``,
    ``Last-Event-ID``) is a node's to offer, not the gateway's."""
    if "since" in request.query_params or "last-event-id" in request.headers:
        return error(400, "resuming events is per node: the gateway streams them live only",
                     "InvalidRequest")
    headers = credentials.upstream(request.headers.items())
    queue: asyncio.Queue[str] = asyncio.Queue(maxsize=4096)

    async def pump(node: Node) -> None:
        with contextlib.suppress(*UNREACHABLE, httpx.HTTPError):
            async with client.stream("GET", f"{node.url}/v1/events", headers=headers) as reply:
                async for line in reply.aiter_lines():
                    if not line.startswith("data: "):
                        continue  # ids, retry hints, keep-alives: the gateway sends its own
                    with contextlib.suppress(ValueError, TypeError):
                        event = json.loads(line[6:])
                        event.pop("id", None)
                        event["node"] = node.name or node.url
                        if not queue.full():  # a client that does not read loses events
                            queue.put_nowait(f"data: {json.dumps(event)}\n\n")
        gone = {"type": "node_unavailable", "node": node.name or node.url}
        with contextlib.suppress(asyncio.QueueFull):
            queue.put_nowait(f"data: {json.dumps(gone)}\n\n")

    async def merged() -> AsyncIterator[str]:
        pumps = [asyncio.create_task(pump(node)) for node in nodes.up()]
        try:
            yield "retry: 1000\n\n"
            while True:
                try:
                    yield await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
                except TimeoutError:
                    yield ": keep-alive\n\n"
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    return StreamingResponse(merged(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
