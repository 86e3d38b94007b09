"""Which node of a cluster this daemon is: the tag its sandbox ids carry.

A gateway in front of several daemons routes every request by its sandbox id alone
(DESIGN.md, "Beyond one machine"), so an id names the node that holds it: ``sbx_``, the
node's 8-hex-digit tag, then 24 random hex digits. That is still ``sbx_`` + 32 hex
digits, the format Podflare's and E2B's clients check, and 96 random bits keep ids
unguessable. A single daemon is simply a one-node cluster.

The tag is drawn once per data directory and kept in it: a daemon restarted on the same
store (``--keep``, an upgrade, a crash) is the same node, so its sandboxes keep their
routes. Two nodes started from copies of one store would share a tag; the gateway
refuses the second (``gateway.nodes``).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

TAG_FILE = "node-tag"
_TAG = re.compile(r"[0-9a-f]{8}")


def node_tag(data_dir: Path) -> str:
    """This data directory's node tag, drawn and saved on its first use."""
    path = data_dir / TAG_FILE
    with contextlib.suppress(FileNotFoundError):
        tag = path.read_text().strip()
        if _TAG.fullmatch(tag):
            return tag
        raise ValueError(f"{path} holds {tag[:40]!r}, not a node tag (8 hex digits): "
                         "remove it to draw a new one (this node's sandbox ids then change)")
    tag = secrets.token_hex(4)
    draft = path.with_name(f".{TAG_FILE}.{os.getpid()}")
    draft.write_text(tag + "\n")
    try:
        os.link(draft, path)  # only the first of two daemons racing on one store wins
    except FileExistsError:
        return node_tag(data_dir)
    finally:
        draft.unlink()
    return tag


def new_id(tag: str) -> str:
    """A new sandbox id of the node tagged ``tag``."""
    return f"sbx_{tag}{secrets.token_hex(12)}"


def tag_of(sandbox_id: str) -> str:
    """The tag of the node a sandbox id names (its id is checked elsewhere)."""
    return sandbox_id[4:12]
