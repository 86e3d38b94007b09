"""The page's HTML, rendered on the server from the engine's live sandboxes.

The first paint is the whole tree as it is now (no script needed to see it);
``ui.js`` then adopts those nodes and applies ``/v1/events`` to them from the id
the page was rendered at. Every text that can come from a sandbox or a client is
escaped here, and the embedded JSON cannot close its ``<script>`` element.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from dataclasses import dataclass
from html import escape

from branchbox.engine.live import Live

RUNS_KEPT = 5  # runs per node the page shows (the script keeps as many)
RETIRED = ("closed", "merged")  # states of nodes shown greyed: no longer sandboxes


@dataclass
class Node:
    """One sandbox as the page shows it."""

    id: str
    parent: str | None
    family: str
    state: str
    created: float
    cpu_seconds: float | None
    memory_bytes: int | None


def read_nodes(lives: list[Live], usage: bool = True) -> list[Node]:
    """Nodes of ``lives``; with ``usage``, their CPU and memory too, which reads cgroup
    files, so callers run it off the event loop (a sandbox closed meanwhile shows no use
    instead of failing)."""
    nodes = []
    for sb in lives:
        cpu = memory = None
        if usage:
            with contextlib.suppress(OSError, ValueError):
                cpu = sb.body.cgroup.cpu_seconds()
                memory = sb.body.cgroup.memory_bytes()
        rec = sb.record
        nodes.append(Node(rec.id, rec.parent_id, rec.family, rec.state, rec.created,
                          cpu, memory))
    return nodes


def retired_nodes(events: list[dict], live: list[Node]) -> list[Node]:
    """Sandboxes of the ``live`` nodes' families that were closed or won a merge within
    ``events`` (what the daemon still holds), so a page opened later shows them greyed,
    as a page that watched them go did. A winner's children hang under the sandbox it
    merged into."""
    seen: dict[str, Node] = {}
    moved: dict[str, str] = {}  # merged winner -> the sandbox that took its place
    for ev in events:
        kind, sid = ev["type"], ev["sandbox"]
        if kind == "create":
            seen[sid] = Node(sid, None, ev["family"], "ready", ev["ts"], None, None)
        elif kind == "fork":
            for child in ev["children"]:
                seen[child] = Node(child, sid, ev["family"], "ready", ev["ts"], None, None)
        elif kind == "close" and sid in seen:
            seen[sid].state = "closed"
        elif kind == "merge" and ev["winner"] in seen:
            seen[ev["winner"]].state = "merged"
            moved[ev["winner"]] = sid
    families = {n.family for n in live}
    ids = {n.id for n in live}
    gone = [n for n in seen.values()
            if n.id not in ids and n.state != "ready" and n.family in families]
    for node in gone:
        while node.parent in moved:
            node.parent = moved[node.parent]
    return gone


def render(nodes: list[Node], runs: list[dict], last_event: int) -> str:
    """The page: ``nodes`` as one tree per family, and the recent ``runs`` (exec events)."""
    by_parent: dict[str | None, list[Node]] = defaultdict(list)
    known = {n.id for n in nodes}
    for node in sorted(nodes, key=lambda n: n.created):
        by_parent[node.parent if node.parent in known else None].append(node)
    families = "".join(
        f'<section class="family" data-family="{escape(root.family)}">'
        f'<h2>family <code>{escape(root.family)}</code></h2>'
        f'<ul class="tree">{_subtree(root, by_parent)}</ul></section>'
        for root in by_parent[None])
    kept: dict[str, list[dict]] = defaultdict(list)
    for run in runs:
        if run["sandbox"] in known:
            kept[run["sandbox"]] = [*kept[run["sandbox"]], run][-RUNS_KEPT:]
    data = json.dumps(kept).replace("<", "\\u003c")  # no "</script>" inside
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>branchbox · fork tree</title>
<link rel="icon" href="data:,"><link rel="stylesheet" href="/ui/static/ui.css"></head>
<body data-last-event="{last_event}">
<header><h1>branchbox</h1><span id="counts">{len(nodes)} nodes</span>
<span id="status" class="status">connecting…</span></header>
<p id="banner" hidden></p>
<div id="layout">
<main id="families">{families}</main>
<aside id="panel">
<section id="details"><h2>Sandbox</h2><p class="hint">Click a node to see it here;
click a second one to diff the two.</p></section>
<section id="diff"><h2>Diff</h2><p class="hint">Select two nodes.</p></section>
</aside></div>
<script type="application/json" id="bb-runs">{data}</script>
<script src="/ui/static/ui.js" defer></script>
</body></html>
"""


def _subtree(root: Node, by_parent: dict[str | None, list[Node]]) -> str:
    """``root`` and its descendants as nested ``<li>``; iterative, since a line of forks
    of forks may be a thousand deep."""
    out: list[str] = []
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            out.append("</ul></li>")
            continue
        state = escape(node.state)
        retired = " retired" if node.state in RETIRED else ""
        out.append(
            f'<li class="node state-{state}{retired}" data-id="{escape(node.id)}" '
            f'data-parent="{escape(node.parent or "")}" data-created="{node.created}">'
            f'<div class="card" tabindex="0"><span class="sid">{escape(node.id)}</span>'
            f'<span class="state">{state}</span><span class="age"></span>'
            f'<span class="cpu">{_cpu(node.cpu_seconds)}</span>'
            f'<span class="mem">{_memory(node.memory_bytes)}</span>'
            f'<span class="badges"></span></div><ul class="kids">')
        stack.append((node, True))
        stack.extend((kid, False) for kid in reversed(by_parent.get(node.id, ())))
    return "".join(out)


def _cpu(seconds: float | None) -> str:
    return "" if seconds is None else f"cpu {seconds:.2f} s"


def _memory(size: int | None) -> str:
    return "" if size is None else f"mem {size / (1 << 20):.1f} MiB"


REFUSAL = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>branchbox · key needed</title>
<link rel="stylesheet" href="/ui/static/ui.css"></head>
<body class="refusal"><h1>branchbox</h1><p>{message}</p>
<form method="get" action="/ui"><label>API key
<input type="password" name="key" autocomplete="current-password" required></label>
<button type="submit">Open</button></form>
<p class="hint">The key is kept in an HttpOnly cookie for this site, not in the page.</p>
</body></html>
"""


def refusal(message: str) -> str:
    return REFUSAL.format(message=escape(message))
