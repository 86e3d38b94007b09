"""Listings through the gateway: every node's answer, merged into one.

Nodes that are down are left out and named in ``X-Branchbox-Unavailable`` (their
sandboxes cannot be listed, but the others can). A node's refusal of the query (4xx)
is the answer, as every node would give it. E2B's paged list is paged by the gateway
itself over the merged rows, oldest first.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from branchbox.gateway.forward import Credentials, error
from branchbox.gateway.nodes import REFRESH_SECONDS, Node, Nodes
from branchbox.server.sandbox_json import SandboxJSON

MAX_PAGE = 1000  # a daemon's largest page of E2B's list: what the gateway asks each for
KEEPALIVE_SECONDS = 15.0
LISTING_TIMEOUT = 30.0
EVENTS_KEPT = 4096  # per subscriber: a client that reads slower loses events (and is told)
# A node sends a keep-alive every 15 s: a stream silent for longer is a node gone.
EVENTS_TIMEOUT = httpx.Timeout(connect=5.0, read=45.0, write=10.0, pool=10.0)
SUBSCRIBE_WITHIN = 5.0  # a node slower to answer is streamed from when it does
STARTS_WITHIN = 30.0  # a response not started by then lost its client: the pumps end


async def _ask_all(request: Request, nodes: Nodes, client: httpx.AsyncClient,
                   credentials: Credentials, params: dict[str, str]
                   ) -> tuple[list[tuple[Node, object]], list[Node], Response | None]:
    """(node, JSON answer) of every node that is up and answered, the nodes that did not,
    and the first refusal (4xx) a node gave."""
    headers = credentials.upstream(request.headers.raw, keyed=True)

    async def one(node: Node) -> tuple[Node, httpx.Response | None]:
        try:
            return node, await client.get(node.url + request.url.path, params=params,
                                          headers=headers, timeout=LISTING_TIMEOUT)
        except httpx.HTTPError:
            return node, None

    answers, failed = [], []
    for node, reply in await asyncio.gather(*(one(n) for n in nodes.up())):
        if reply is not None and 400 <= reply.status_code < 500:
            return [], [], Response(reply.content, status_code=reply.status_code,
                                    media_type=reply.headers.get("content-type"))
        try:
            if reply is None or reply.status_code != 200:
                raise ValueError(reply)
            answers.append((node, reply.json()))
        except ValueError:
            failed.append(node)
    return answers, failed, None


def _unavailable(nodes: Nodes, failed: list[Node]) -> dict[str, str]:
    down = {n.label for n in failed} | {
        d["name"] or d["url"] for d in nodes.describe() if not d["up"]}
    return {"X-Branchbox-Unavailable": ",".join(sorted(down))} if down else {}


async def listing(request: Request, nodes: Nodes, client: httpx.AsyncClient,
                  credentials: Credentials) -> Response:
    """The merged answer of a GET in ``routing.LISTINGS``."""
    path = request.url.path
    params = dict(request.query_params)
    paged = path in ("/v2/sandboxes", "/snapshots")  # E2B's paged lists
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
    if not answers:
        return error(503, "no node answered: " + (", ".join(
            n["name"] or n["url"] for n in nodes.describe()) or "none is known"),
            "NodeUnavailable")
    headers = _unavailable(nodes, failed)
    merge: Callable[[list[tuple[Node, object]]], object] = {
        "/v1/sandboxes": lambda a: {"sandboxes": [s for _, r in a for s in r["sandboxes"]]},
        "/v1/images": _images,
        "/v1/snapshots": lambda a: {"snapshots": sorted(
            (s for _, r in a for s in r["snapshots"]), key=lambda s: s["created"])},
    }.get(path, _rows)
    try:
        merged = merge(answers)
    except (LookupError, TypeError):
        return error(502, "a node answered the listing with something else", "NodeUnavailable")
    if paged and isinstance(merged, list):
        if len(merged) > offset + limit:
            headers["X-Next-Token"] = base64.urlsafe_b64encode(
                json.dumps({"gateway_offset": offset + limit}).encode()).decode()
        merged = merged[offset:offset + limit]
    return SandboxJSON(merged, headers=headers)


def _rows(answers: list[tuple[Node, object]]) -> list:
    """E2B's lists, oldest first over every node."""
    return sorted((s for _, r in answers for s in r),  # type: ignore[attr-defined]
                  key=lambda s: (s.get("startedAt") or "", s.get("sandboxID") or ""))


def _offset(token: str | None) -> int:
    """Where a page starts: the offset in the gateway's token (ValueError if it is not
    one)."""
    if token is None:
        return 0
    try:
        offset = json.loads(base64.urlsafe_b64decode(token.encode()))["gateway_offset"]
    except (binascii.Error, LookupError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(token) from exc
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(token)
    return offset


def _images(answers: list[tuple[Node, object]]) -> dict:
    """Each image once, with the nodes that have it (built-in ones are every node's)."""
    by_name: dict[str, dict] = {}
    for node, reply in answers:
        for image in reply["images"]:  # type: ignore[index]
            seen = by_name.setdefault(image["name"], {**image, "users": [], "nodes": []})
            seen["users"] += image.get("users") or []
            seen["nodes"].append(node.label)
            seen["built"] = seen["built"] or image.get("built")
    return {"images": list(by_name.values())}


async def events(request: Request, nodes: Nodes, client: httpx.AsyncClient,
                 credentials: Credentials) -> Response:
    """Every node's lifecycle events, live, as one stream. Each event says its ``node``;
    event ids are each node's own, so they are left out, and resuming (``since``,
    ``Last-Event-ID``) is a node's to offer, not the gateway's. A node that comes up (or
    back) later is subscribed to then; one that goes is announced (``node_unavailable``)."""
    if "since" in request.query_params or "last-event-id" in request.headers:
        return error(400, "resuming events is per node: the gateway streams them live only",
                     "InvalidRequest")
    headers = credentials.upstream(request.headers.raw, keyed=True)
    queue: asyncio.Queue[str] = asyncio.Queue(maxsize=EVENTS_KEPT)
    lost = 0

    def put(event: dict) -> None:
        nonlocal lost
        if queue.maxsize - queue.qsize() < (2 if lost else 1):
            lost += 1
            return
        if lost:
            queue.put_nowait(f"data: {json.dumps({'type': 'lost', 'count': lost})}\n\n")
            lost = 0
        queue.put_nowait(f"data: {json.dumps(event)}\n\n")

    async def pump(node: Node, subscribed: asyncio.Event) -> None:
        """One node's events while its stream lasts; its end is announced once.
        ``subscribed`` is set once the node answered (or could not)."""
        streamed = False
        try:
            with contextlib.suppress(httpx.HTTPError):
                async with client.stream("GET", f"{node.url}/v1/events", headers=headers,
                                         timeout=EVENTS_TIMEOUT) as reply:
                    if reply.status_code != 200:
                        return
                    streamed = True
                    subscribed.set()
                    async for line in reply.aiter_lines():
                        if not line.startswith("data: "):
                            continue  # ids, retry hints, keep-alives: the gateway's own
                        with contextlib.suppress(ValueError, TypeError, AttributeError):
                            event = json.loads(line[6:])
                            event.pop("id", None)
                            put({**event, "node": node.label})
        finally:
            subscribed.set()
        if streamed:
            put({"type": "node_unavailable", "node": node.label})

    async def watch(ready: asyncio.Event, started: asyncio.Event) -> None:
        """Keep a pump on every node that is up; ``ready`` once the first round of them
        subscribed. Ends if the response never starts (its client left first): nothing
        else would end the pumps."""
        pumps: dict[Node, asyncio.Task] = {}
        try:
            while True:
                subscribing = []
                for node in nodes.up():
                    if node not in pumps or pumps[node].done():
                        subscribing.append(asyncio.Event())
                        pumps[node] = asyncio.create_task(pump(node, subscribing[-1]))
                if not ready.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.gather(
                            *(event.wait() for event in subscribing)), SUBSCRIBE_WITHIN)
                    ready.set()
                if not started.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(started.wait(), STARTS_WITHIN)
                    if not started.is_set():
                        return
                await asyncio.sleep(REFRESH_SECONDS)
        finally:
            ready.set()  # the handler waits for it, whatever happened here
            for task in pumps.values():
                task.cancel()
            await asyncio.gather(*pumps.values(), return_exceptions=True)

    # Every node that is up has subscribed before the headers go out: a client that got
    # them and then acts sees its doings' events, whichever node they happen on.
    ready, started = asyncio.Event(), asyncio.Event()
    watching = asyncio.create_task(watch(ready, started))
    try:
        await ready.wait()
    except BaseException:
        watching.cancel()
        raise

    async def merged() -> AsyncIterator[str]:
        started.set()
        try:
            yield "retry: 1000\n\n"
            while True:
                try:
                    yield await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
                except TimeoutError:
                    yield ": keep-alive\n\n"
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching

    return StreamingResponse(merged(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
