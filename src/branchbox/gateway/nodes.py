"""The nodes as this gateway sees them: their tags, their load, whether they answer.

Every few seconds the gateway asks each node its ``GET /v1/node``: the tag its sandbox
ids carry, its live sandboxes, its memory, the images only it has. A node that does not
answer is down: requests for its sandboxes get 503 ``NodeUnavailable`` while the other
nodes serve on, and creates go elsewhere. Nothing here outlives the process: a new
replica learns the same table within one round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from branchbox.engine.node import tag_of
from branchbox.server.e2b_access import is_sandbox_id
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


class Unroutable(Exception):
    """No node that is up holds the sandbox a request names."""

    def __init__(self, message: str, kind: str, status: int) -> None:
        super().__init__(message)
        self.message, self.kind, self.status = message, kind, status


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
        self._seen: dict[str, str] = {}  # tag -> the name of the node that holds it
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
        self._one_node_per_tag()
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

    def _one_node_per_tag(self) -> None:
        """A tag names one node. One daemon listed at two addresses (a dual-stack Service)
        is kept once. Two daemons with one tag were started on copies of one data
        directory: the one that held the tag before keeps it, the other is refused (both
        are, when none held it before: which one owns its sandboxes cannot be told)."""
        groups: dict[str, dict[str, list[Node]]] = {}
        for node in self.up():
            groups.setdefault(node.tag, {}).setdefault(node.name, []).append(node)
        for tag, by_name in groups.items():
            for same in by_name.values():
                for extra in same[1:]:
                    del self._nodes[extra.url]
            owner = self._seen.get(tag)
            for name, (node, *_) in by_name.items():
                if len(by_name) == 1 or name == owner:
                    self._seen[tag] = name
                    continue
                node.up = False
                node.error = (f"its node tag {tag} is also that of " + ", ".join(
                    sorted(n for n in by_name if n != name)) + " (a copy of one data "
                    "directory?): remove the node-tag file of the copy's data directory")

    def down(self, node: Node, why: str) -> None:
        """A request found ``node`` not answering: no more are sent to it until it answers
        a report again."""
        node.up, node.error = False, why

    def holder(self, sandbox_id: str) -> Node:
        """The node that is up and holds ``sandbox_id`` (its id's tag); Unroutable says
        why there is none: 404 if no node ever had the tag, 503 if its node is down or
        gone from the list."""
        tag = tag_of(sandbox_id) if is_sandbox_id(sandbox_id) else ""
        nodes = [node for node in self._nodes.values() if node.tag == tag]
        if up := [node for node in nodes if node.up]:
            return up[0]
        if nodes or tag in self._seen:
            name = nodes[0].name if nodes else self._seen[tag]
            why = nodes[0].error if nodes else "it is no longer among the nodes"
            raise Unroutable(f"sandbox {sandbox_id} is on node {name}, which is "
                             f"unavailable: {why}", "NodeUnavailable", 503)
        raise Unroutable("sandbox not found", "SandboxNotFound", 404)

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
