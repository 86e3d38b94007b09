"""``GET /v1/node``: what a gateway needs to know of this daemon to route to it.

A gateway (``branchbox gateway``) keeps no state of its own: it learns each node's tag
(the part of a sandbox id that names the node, ``engine.node``) and its load from here,
every few seconds, and sends a create to the least-loaded node that has the image.
"""

from __future__ import annotations

import os
import secrets

from fastapi import APIRouter

from branchbox.server.deps import EngineDep

router = APIRouter(prefix="/v1", tags=["server"])
INSTANCE = secrets.token_hex(8)
"""This daemon process: a gateway that reaches one node at two addresses (a dual-stack
Service) sees one instance, and two daemons with one tag (copies of one data directory)
two."""


def _meminfo() -> dict[str, int]:
    """MemTotal and MemAvailable of the host, in bytes."""
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                fields[name] = int(value.split()[0]) * 1024
    return fields


@router.get("/node")
async def node(engine: EngineDep) -> dict:
    """This node's tag and name, its live sandboxes, memory and CPU load, and the images
    only it has (saved or built here; the built-in ones every node makes on demand) and
    its snapshots (a create names either the same way)."""
    memory = _meminfo()
    return {
        "tag": engine.node,
        "instance": INSTANCE,
        "name": engine.config.node_name,
        "sandboxes": len(engine.list()),
        "memory_total": memory.get("MemTotal", 0),
        "memory_available": memory.get("MemAvailable", 0),
        "cpus": os.cpu_count() or 1,
        "load": os.getloadavg()[0],
        "images": sorted([*(i["name"] for i in engine.list_images()
                            if i["kind"] not in ("built-in", "host")),
                          *(cp.snapshot for cp in engine.snapshots())]),
    }
