"""The nodes as this gateway sees them: their tags, their load, whether they answer.

Every few seconds the gateway asks each node its ``GET /v1/node``: the tag its sandbox
ids carry, its live sandboxes, its memory, the images only it has. A node that does not
answer is down: requests for its sandboxes get 503 ``NodeUnavailable`` while the other
nodes serve on, and creates go elsewhere. Nothing here outlives the process: a new
replica learns the same table within one round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from branchbox.storage.images import KNOWN_IMAGES

log = logging.getLogger("branchbox.gateway")

REFRESH_SECONDS = 2.0
"""How often every node's report is asked for (and how stale a load figure gets)."""
REPORT_TIMEOUT = 2.0


@dataclass(eq=False)
class Node:
    url: str
    tag: str = ""
    name: str = ""
    report: dict = field(default_factory=dict)
    up: bool = False
    error: str = "not asked yet"
    sent: int = 0  # creates sent to it since its last report (a burst must spread)

    def score(self) -> float:
        """Lower is less loaded: sandboxes (reported, plus creates sent since) per GiB of
        available memory."""
        sandboxes = self.report.get("sandboxes", 0) + self.sent
        free_gib = self.report.get("memory_available", 0) / 2**30
        return (1 + sandboxes) / max(free_gib, 0.25)

    def has_image(self, image: str) -> bool:
        return image in KNOWN_IMAGES or image == "host" or image in self.report.get("images", ())

    def describe(self) -> dict:
        return {"url": self.url, "tag": self.tag or None, "name": self.name or None,
                "up": self.up, "error": None if self.up else self.error,
                **{k: self.report.get(k) for k in ("sandboxes", "memory_total",
                                                  "memory_available", "cpus", "load")}}


class NoNode(Exception):
    """No node can take the request: none is up (or none has the image)."""


class Nodes:
    """The node table, refreshed by :meth:`run` from ``source`` (the nodes' URLs)."""

    def __init__(self, source: Callable[[], Awaitable[list[str]]], client: httpx.AsyncClient,
                 node_key: str | None, *, refresh: float = REFRESH_SECONDS) -> None:
        self._source = source
        self._client = client
        self._auth = {"authorization": f"Bearer {node_key}"} if node_key else {}
        self._refresh = refresh
        self._nodes: dict[str, Node] = {}  # by URL
        self._seen: dict[str, str] = {}  # tag -> name of every node met (for "unavailable")
        self.ready = asyncio.Event()  # set after the first round

    async def run(self) -> None:
        """Refresh for ever (the app's lifespan cancels it)."""
        while True:
            await self.refresh()
            await asyncio.sleep(self._refresh)

    async def refresh(self) -> None:
        try:
            urls = sorted(set(await self._source()))
        except Exception as exc:  # noqa: BLE001 - discovery failed: keep the last table
            log.warning("could not list the nodes: %s", exc)
            for node in self._nodes.values():
                node.error = f"node discovery failed: {exc}"
            self.ready.set()
            return
        self._nodes = {url: self._nodes.get(url) or Node(url) for url in urls}
        await asyncio.gather(*(self._ask(node) for node in self._nodes.values()))
        owners: dict[str, Node] = {}
        for url, node in list(self._nodes.items()):  # one tag, one node
            if not node.up or (first := owners.setdefault(node.tag, node)) is node:
                continue
            if node.name == first.name:  # one daemon at two addresses (a dual-stack Service)
                del self._nodes[url]
                continue
            node.up = False  # two daemons started from copies of one data directory
            node.error = (f"its node tag {node.tag} is also {first.url}'s ({first.name}): "
                          "remove the node-tag file of one of their data directories")
        self.ready.set()

    async def _ask(self, node: Node) -> None:
        try:
            reply = await self._client.get(f"{node.url}/v1/node", headers=self._auth,
                                           timeout=REPORT_TIMEOUT)
            if reply.status_code != 200:
                raise ValueError(f"GET /v1/node answered {reply.status_code}: "
                                 f"{reply.text[:200]}")
            report = reply.json()
            tag = report["tag"]
            if not (isinstance(tag, str) and len(tag) == 8):
                raise ValueError(f"GET /v1/node gave no node tag: {str(report)[:200]}")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            if node.up:
                log.warning("node %s is down: %s", node.url, exc)
            node.up, node.error = False, f"{type(exc).__name__}: {exc}"
            return
        node.tag, node.name, node.report, node.sent = tag, str(report.get("name", "")), report, 0
        node.up, node.error = True, ""
        self._seen[tag] = node.name or node.url

    def down(self, node: Node, why: str) -> None:
        """A request found ``node`` not answering: no more are sent to it until it answers
        a report again."""
        node.up, node.error = False, why

    def holder(self, tag: str) -> Node | None:
        """The node whose sandbox ids carry ``tag`` (up or not); None if no node has it."""
        return next((node for node in self._nodes.values() if node.tag == tag), None)

    def known(self, tag: str) -> str | None:
        """The name of a node that had ``tag``, even one that is gone from the list."""
        return self._seen.get(tag)

    def up(self) -> list[Node]:
        return [node for node in self._nodes.values() if node.up]

    def pick(self, image: str | None = None) -> Node:
        """The least-loaded node that is up and has ``image`` (any node makes a built-in
        image on demand; a saved or built one exists only where it was made)."""
        candidates = [n for n in self.up() if image is None or n.has_image(image)]
        if not candidates:
            if image is not None and self.up():
                raise NoNode(f"no node has image {image!r}")
            raise NoNode("no node is up: " + ("; ".join(
                f"{n.url}: {n.error}" for n in self._nodes.values()) or "none is known"))
        best = min(candidates, key=lambda n: (n.score(), n.url))
        best.sent += 1
        return best

    def describe(self) -> list[dict]:
        return [node.describe() for node in self._nodes.values()]


def static_source(urls: list[str]) -> Callable[[], Awaitable[list[str]]]:
    async def listed() -> list[str]:
        return list(urls)
    return listed


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
