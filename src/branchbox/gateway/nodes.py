"""The nodes as this gateway sees them: their tags, their load, whether they answer.

Every few seconds the gateway asks each node its ``GET /v1/node``: the tag its sandbox
ids carry, its live sandboxes, its memory, the images only it has. A node that does not
answer is down: requests for its sandboxes get 503 ``NodeUnavailable`` while the other
nodes serve on, and creates go elsewhere. A node that leaves the list (a pod being
replaced) stays known as down for :data:`FORGET_AFTER`, so its sandboxes are
"unavailable", not "not found", while it comes back. Nothing here outlives the
process: a new replica learns the same table within one round.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from branchbox.engine.node import tag_of
from branchbox.server.e2b_access import is_sandbox_id
from branchbox.storage.images import KNOWN_IMAGES

log = logging.getLogger("branchbox.gateway")

REFRESH_SECONDS = 2.0
"""How often every node's report is asked for (and how stale a load figure gets)."""
REPORT_TIMEOUT = 5.0  # a busy node is slow, not down
FORGET_AFTER = 600.0
"""Seconds a node that left the list is still known (as down)."""
_TAG = re.compile(r"[0-9a-f]{8}")


@dataclass(eq=False)
class Node:
    url: str
    tag: str = ""
    name: str = ""
    instance: str = ""  # the daemon process (server.node.INSTANCE)
    report: dict = field(default_factory=dict)
    up: bool = False
    error: str = "not asked yet"
    sent: int = 0  # creates sent to it since its last report (a burst must spread)
    unlisted: float | None = None  # when it left the list

    @property
    def label(self) -> str:
        return self.name or self.url

    @property
    def ws_url(self) -> str:
        return "ws" + self.url.removeprefix("http")

    def score(self) -> float:
        """Lower is less loaded: sandboxes (reported, plus creates sent since) per GiB of
        available memory."""
        sandboxes = self.report.get("sandboxes", 0) + self.sent
        free_gib = self.report.get("memory_available", 0) / 2**30
        return (1 + sandboxes) / max(free_gib, 0.25)

    def has_image(self, image: str) -> bool:
        """Built-in images are made on demand anywhere; saved and built ones exist only
        where they were made."""
        return image in KNOWN_IMAGES or image == "host" or image in self.report.get("images", ())

    def describe(self) -> dict:
        """The node as ``GET /v1/nodes`` shows it."""
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
    """No node can take a create: none is up."""


@dataclass
class _Report:
    """One node's answer to ``GET /v1/node`` (``report`` None: its failure, ``error``)."""

    node: Node
    report: dict | None
    error: str = ""


class Nodes:
    """The node table, refreshed by :meth:`run` from ``source`` (the nodes' URLs)."""

    def __init__(self, source: Callable[[], Awaitable[list[str]]], client: httpx.AsyncClient,
                 node_key: str, *, refresh: float = REFRESH_SECONDS) -> None:
        self._source = source
        self._client = client  # the gateway's own, apart from the requests it passes on
        self._auth = {"authorization": f"Bearer {node_key}"}
        self._refresh = refresh
        self._nodes: dict[str, Node] = {}  # by URL

    async def run(self) -> None:
        """Refresh for ever (the app's lifespan cancels it); a failed round is logged and
        the next one tried."""
        while True:
            await asyncio.sleep(self._refresh)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the table must keep being refreshed
                log.exception("refreshing the node table failed")

    async def refresh(self) -> None:
        """Ask every node, then change the table in one step (no request sees a node up
        before its tag was checked against the others')."""
        try:
            listed = set(await self._source())
        except Exception as exc:  # noqa: BLE001 - discovery failed: keep asking the last ones
            log.warning("could not list the nodes: %s", exc)
            listed = {url for url, node in self._nodes.items() if node.unlisted is None}
        now = time.monotonic()
        nodes = {url: self._nodes.get(url) or Node(url) for url in sorted(listed)}
        for node in nodes.values():
            node.unlisted = None  # listed (again)
        for url, node in self._nodes.items():  # gone from the list: known for a while
            if url not in listed and now - (node.unlisted or now) < FORGET_AFTER and node.tag:
                node.unlisted = node.unlisted or now
                nodes[url] = node
        asked = [n for n in nodes.values() if n.unlisted is None]
        reports = await asyncio.gather(*(self._ask(node) for node in asked))
        for done in reports:  # no await from here on: one step for the event loop
            node = done.node
            if done.report is None:
                node.up, node.error = False, done.error
                continue
            node.tag, node.instance = done.report["tag"], str(done.report.get("instance", ""))
            node.name = str(done.report.get("name", ""))
            node.report, node.sent, node.up, node.error = done.report, 0, True, ""
        held = {node.tag for node in nodes.values() if node.unlisted is None and node.up}
        for url, node in list(nodes.items()):
            if node.unlisted is None:
                continue
            if node.tag in held:  # its tag is served at a new address (a new pod's IP)
                del nodes[url]
            else:
                node.up, node.error = False, "it is no longer among the listed nodes"
        self._nodes = nodes
        self._one_node_per_tag()

    async def _ask(self, node: Node) -> _Report:
        try:
            reply = await self._client.get(f"{node.url}/v1/node", headers=self._auth,
                                           timeout=REPORT_TIMEOUT)
            if reply.status_code != 200:
                return _Report(node, None, f"GET /v1/node answered {reply.status_code}: "
                                           f"{reply.text[:200]}")
            report = reply.json()
            if not isinstance(report, dict) or not _TAG.fullmatch(str(report.get("tag"))):
                return _Report(node, None, f"GET /v1/node gave no node tag: {reply.text[:200]}")
            return _Report(node, report)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the node is not usable
            return _Report(node, None, f"{type(exc).__name__}: {exc}")

    def _one_node_per_tag(self) -> None:
        """A tag names one node. One daemon process listed at two addresses (a dual-stack
        Service) is kept once. Two daemon processes with one tag were started on copies
        of one data directory: both are refused, since which one holds the tag's
        sandboxes cannot be told (and every replica must decide alike)."""
        groups: dict[str, dict[str, list[Node]]] = {}
        for node in self.up():
            groups.setdefault(node.tag, {}).setdefault(node.instance, []).append(node)
        for tag, by_instance in groups.items():
            for same in by_instance.values():
                for extra in same[1:]:
                    del self._nodes[extra.url]
            if len(by_instance) > 1:
                names = sorted(same[0].label for same in by_instance.values())
                for (node, *_) in by_instance.values():
                    node.up = False
                    node.error = (f"its node tag {tag} is also that of another daemon "
                                  f"({', '.join(names)}: a copy of one data directory?): "
                                  "remove the node-tag file of the copy's data directory")

    def down(self, node: Node, why: str) -> None:
        """A request could not connect to ``node``: no more go to it until it answers a
        report again."""
        if node.up:
            log.warning("node %s is down: %s", node.label, why)
        node.up, node.error = False, why

    def holder(self, sandbox_id: str) -> Node:
        """The node that is up and holds ``sandbox_id`` (its id's tag); Unroutable says
        why there is none: 404 if no node known has the tag, 503 if its node is down."""
        if not is_sandbox_id(sandbox_id):
            raise Unroutable("sandbox not found", "SandboxNotFound", 404)
        nodes = [node for node in self._nodes.values() if node.tag == tag_of(sandbox_id)]
        if up := [node for node in nodes if node.up]:
            return up[0]
        if nodes:
            raise Unroutable(f"sandbox {sandbox_id} is on node {nodes[0].label}, which is "
                             f"unavailable: {nodes[0].error}", "NodeUnavailable", 503)
        raise Unroutable("sandbox not found", "SandboxNotFound", 404)

    def up(self) -> list[Node]:
        return [node for node in self._nodes.values() if node.up]

    def pick(self, image: str | None = None) -> Node:
        """The least-loaded node that is up and has ``image``; any node that is up when
        none has it (that node then says what is wrong with the image)."""
        up = self.up()
        if not up:
            raise NoNode("no node is up: " + ("; ".join(
                f"{n.label}: {n.error}" for n in self._nodes.values()) or "none is known"))
        candidates = [n for n in up if image is None or n.has_image(image)] or up
        best = min(candidates, key=lambda n: (n.score(), n.url))
        best.sent += 1
        return best

    def describe(self) -> list[dict]:
        return [node.describe() for node in self._nodes.values()]


def static_source(urls: list[str]) -> Callable[[], Awaitable[list[str]]]:
    """A node list that never changes (``--nodes``)."""
    async def listed() -> list[str]:
        return list(urls)
    return listed
