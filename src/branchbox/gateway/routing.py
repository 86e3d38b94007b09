"""Which node a request is for, from the request alone.

A sandbox's requests name it in their path (``/v1/sandboxes/{id}/...``, E2B's
``/sandboxes/{id}/...``), in E2B's sandbox-plane headers (``E2b-Sandbox-Id``) or Host
(``<port>-<id>.<domain>``), or, on the calls WebSocket, in each message; the id's tag
names the node (``engine.node``). A request whose path and headers name two different
sandboxes, or whose path has ``.`` or ``..`` segments (which the node would resolve
to another path than the one routed), is refused. A create names no sandbox: it goes
to the least-loaded node. A listing is every node's, merged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from branchbox.server.e2b_access import addressed, is_sandbox_id
from branchbox.server.e2b_control import DEFAULT_TEMPLATES, untagged

_IN_PATH = re.compile(r"(?:^|/)(sbx_[0-9a-f]{32})(?:/|$)")

CREATES = {("POST", "/v1/sandboxes"), ("POST", "/sandboxes"), ("POST", "/v2/sandboxes")}
"""Routes that make a sandbox: the native API's and E2B's control plane's."""
LISTINGS = {"/v1/sandboxes", "/sandboxes", "/v2/sandboxes", "/v1/images", "/v1/snapshots",
            "/snapshots"}
"""GET routes whose answer is every node's, merged."""
REMOVALS = ("/v1/images/", "/v1/snapshots/", "/v1/spaces/", "/templates/")
"""DELETE routes of a name only one node may have (an image, a snapshot, E2B's template
for either): asked of every node."""


class Misaddressed(ValueError):
    """A request that names its sandbox ambiguously."""


def sandbox_named(path: str, headers: Mapping[str, str]) -> str | None:
    """The sandbox id a request is for (E2B's addressing, or the first id in the path);
    None when it names none."""
    if any(part in (".", "..") for part in path.split("/")):
        raise Misaddressed("a path with '.' or '..' segments is not routed")
    target = addressed(headers)
    by_header = target[0] if target is not None and is_sandbox_id(target[0]) else None
    match = _IN_PATH.search(path)
    in_path = match.group(1) if match else None
    if by_header and in_path and by_header != in_path:
        raise Misaddressed(f"the request names sandbox {by_header} in its headers and "
                           f"{in_path} in its path")
    return by_header or in_path


_RESUME = re.compile(r"/v1/spaces/([^/]+)/resume")


def space_resumed(method: str, path: str) -> str | None:
    """The space a Podflare resume names (a snapshot: it is on one node), or None."""
    match = _RESUME.fullmatch(path) if method == "POST" else None
    return match.group(1) if match else None


def image_of_create(path: str, body: object) -> str | None:
    """The image (or snapshot) a create's JSON body asks for (Podflare calls it a
    template, E2B a templateID); None for the default (every node has it)."""
    if not isinstance(body, dict):
        return None
    if path == "/v1/sandboxes":  # a snapshot is on one node, as a saved image is
        image = body.get("snapshot") or body.get("image", body.get("template"))
    else:
        image = body.get("templateID")
        image = untagged(image) if isinstance(image, str) else None
        image = None if image in DEFAULT_TEMPLATES else image
    return image if isinstance(image, str) and image else None
