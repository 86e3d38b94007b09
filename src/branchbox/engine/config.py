"""Engine configuration: one object, filled from arguments, then environment, then defaults."""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_DATA_DIR = Path("/var/lib/branchbox")
DEFAULT_IMAGE_CACHE = Path("/var/cache/branchbox/images")


# Default disk limit of a sandbox's writable layer, MiB (``BRANCHBOX_DISK_MB``; 0 turns
# the default off, a request's disk_mb still applies). 10 GiB: far above what an agent's
# scratch work needs, far below a store, so one runaway sandbox cannot fill the store
# for every family. A fork child inherits its parent's limit.
DEFAULT_DISK_MB = 10240


def _env_path(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    return Path(value) if value else default


@dataclass
class EngineConfig:
    data_dir: Path = field(
        default_factory=lambda: _env_path("BRANCHBOX_DATA_DIR", DEFAULT_DATA_DIR)
    )
    storage: str = field(default_factory=lambda: os.environ.get("BRANCHBOX_STORAGE", "auto"))
    image_cache: Path = field(
        default_factory=lambda: _env_path("BRANCHBOX_IMAGE_CACHE", DEFAULT_IMAGE_CACHE)
    )
    max_fork: int = field(default_factory=lambda: int(os.environ.get("BRANCHBOX_MAX_FORK", "32")))
    memory_mb: int = 4096
    disk_mb: int = field(
        default_factory=lambda: int(os.environ.get("BRANCHBOX_DISK_MB", str(DEFAULT_DISK_MB)))
    )
    pids_max: int = 1024
    # The most memory this daemon's sandboxes hold together, MiB (None: all of RAM but
    # what the host keeps, runtime.cgroups.bound_all_sandboxes). Near it, the family
    # holding the most gives way (engine.memory_guard).
    sandboxes_memory_mb: int | None = field(default_factory=lambda: int(
        os.environ["BRANCHBOX_SANDBOXES_MEMORY_MB"])
        if os.environ.get("BRANCHBOX_SANDBOXES_MEMORY_MB") else None)
    # Live sandboxes a family may hold at once (a fork past it is a 429): each child is a
    # few processes and ~2.6 MiB of memory drawn from what all sandboxes share.
    max_family: int = field(
        default_factory=lambda: int(os.environ.get("BRANCHBOX_MAX_FAMILY", "2048")))
    # Saved and built images the server holds at once (each also within half the store).
    max_images: int = field(
        default_factory=lambda: int(os.environ.get("BRANCHBOX_MAX_IMAGES", "1024")))
    # Checkpoints a family may hold at once (each a process forked from a REPL that runs
    # nothing, a cgroup and a frozen layer).
    max_checkpoints: int = field(
        default_factory=lambda: int(os.environ.get("BRANCHBOX_MAX_CHECKPOINTS", "256")))
    # Snapshots the server holds at once (engine.snapshots): each keeps a sandbox's
    # instant, memory and files, and its family, after the sandbox is gone.
    max_snapshots: int = field(
        default_factory=lambda: int(os.environ.get("BRANCHBOX_MAX_SNAPSHOTS", "64")))
    # How long a call waits for a sandbox busy with another before 409 (nothing waits on
    # a sandbox's lock without a bound).
    busy_wait: float = field(
        default_factory=lambda: float(os.environ.get("BRANCHBOX_BUSY_WAIT", "30")))
    # The longest a fork may hold its parent frozen and locked before it is undone (408).
    fork_deadline: float = field(
        default_factory=lambda: float(os.environ.get("BRANCHBOX_FORK_DEADLINE", "60")))
    spawn_timeout: float = 60.0
    # Sandboxes kept started per image, so that create hands one out in milliseconds.
    warm_pool: int = field(default_factory=lambda: int(os.environ.get("BRANCHBOX_WARM_POOL", "2")))
    # The most the warm pool grows to after a burst of creates (engine.warm).
    warm_max: int = field(
        default_factory=lambda: int(os.environ.get("BRANCHBOX_WARM_MAX", "32")))
    # Creates of a built-in image fork its template's interpreter (engine.templates);
    # BRANCHBOX_TEMPLATES=off starts an interpreter per family (to compare, or to rule
    # templates out).
    templates: bool = field(
        default_factory=lambda: os.environ.get("BRANCHBOX_TEMPLATES", "on") != "off")
    # Lifecycle events kept for GET /v1/events to resume from (engine.events, also 8 MiB).
    events_kept: int = field(
        default_factory=lambda: int(os.environ.get("BRANCHBOX_EVENTS_KEPT", "4096")))

    # On stop, leave every sandbox running (``branchbox serve --keep``): the next daemon on
    # this data directory re-attaches to them (engine.reattach).
    keep: bool = field(
        default_factory=lambda: os.environ.get("BRANCHBOX_KEEP", "") in ("1", "true"))
    # Egress for sandboxes that do not say (``branchbox serve --internet``).
    internet: bool = field(
        default_factory=lambda: os.environ.get("BRANCHBOX_INTERNET", "") in ("1", "true"))
    # Host paths image "host" hides beyond its default deny list (storage/host_mask.py):
    # ``branchbox serve --host-deny``, or $BRANCHBOX_HOST_DENY (entries joined by ':').
    host_deny: list[str] = field(default_factory=lambda: [
        p for p in os.environ.get("BRANCHBOX_HOST_DENY", "").split(os.pathsep) if p])
    # The sandboxes' subnet; None: the first free /16 from 10.89.0.0 (runtime.network).
    subnet: str | None = field(default_factory=lambda: os.environ.get("BRANCHBOX_SUBNET"))
    # The node's name in a cluster (a gateway shows it; Kubernetes passes spec.nodeName).
    node_name: str = field(
        default_factory=lambda: os.environ.get("BRANCHBOX_NODE") or socket.gethostname())

    @property
    def cgroup_group(self) -> str:
        """Cgroup directory of this daemon: distinct per data directory, so two daemons
        (say, a test run beside `make run`) never clean up each other's sandboxes."""
        digest = hashlib.sha256(str(self.data_dir.resolve()).encode()).hexdigest()[:10]
        return f"d-{digest}"
