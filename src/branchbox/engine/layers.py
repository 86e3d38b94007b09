"""Layer bookkeeping: which volumes a sandbox's root is stacked from, and when to free them.

A sandbox body (an *instance*) owns one writable volume (``upper/`` +
``work/``, and ``ws/`` for a workspace) and shares frozen layers with its
relatives. A frozen layer is a
read-only snapshot of a parent's writable volume taken at fork time; every
instance stacked on it holds a reference, and the last one to go deletes it
(in the background: :mod:`branchbox.storage.deleter`).

Each writable volume may carry a disk limit (bytes, enforced by the store's
kernel quota). A frozen layer remembers the limit of the volume it was frozen
from, so a stack built on it (a fork child) inherits its parent's limit.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from branchbox.engine.made_ahead import MadeAhead
from branchbox.runtime import rootfs
from branchbox.runtime.cgroups import SandboxCgroup
from branchbox.storage import squash
from branchbox.storage.deleter import Deleter

if TYPE_CHECKING:
    from branchbox.engine.idranges import IdRange


@dataclass(eq=False)
class FrozenLayer:
    path: Path  # the snapshot volume; its upper/ is the overlay lower dir
    refs: int = 0
    disk_bytes: int | None = None  # the limit of the volume it was frozen from

    @property
    def lowerdir(self) -> Path:
        return self.path / "upper"


@dataclass(eq=False)
class WorkspaceLower:
    """A host directory as a workspace's bottom layer: an idmapped detached mount of it
    (host owners appear as the same ids inside the sandbox), shared by every branch
    of the families of one id slot (the mapping is the slot's)."""

    host: Path
    fd: int
    users: int = 0


@dataclass
class WorkspaceBranch:
    """One sandbox's view of a workspace: what it started from, for commit's checks."""

    lower: WorkspaceLower
    since: float  # host changes after this instant are conflicts
    version: int  # the workspace version this branch started from (first commit wins)


@dataclass
class LayerStack:
    """The layers of one instance: its writable volume, frozen layers (top first), base,
    and optionally a workspace whose layers live in the same volumes under ws/."""

    volume: Path
    frozen: list[FrozenLayer] = field(default_factory=list)
    base: list[Path] = field(default_factory=list)  # agent layer over the image
    workspace: WorkspaceBranch | None = None
    disk_bytes: int | None = None  # what ``volume`` may hold; None: unbounded
    ids: IdRange | None = None  # the family's host id range (held while the stack lives)
    frozen_once: bool = False  # a frozen layer was made of it: may outlive it charged to it

    def lowers(self) -> list[Path]:
        return [layer.lowerdir for layer in self.frozen] + self.base

    def layer_dirs(self) -> list[Path]:
        """Every layer directory of the root, top first (for diff)."""
        return [self.volume / "upper", *self.lowers()]

    def tree(self) -> int:
        """A detached overlay mount of this stack (the sandbox's root). The base layers
        stack as the family's range sees them (the image id-mapped into it)."""
        lowers: list[Path | int] = [layer.lowerdir for layer in self.frozen]
        lowers += [self.ids.lower(path) for path in self.base]
        return rootfs.overlay_tree(self.volume / "upper", self.volume / "work", lowers)

    def workspace_dirs(self) -> list[Path]:
        """The workspace's layer directories above the host directory, top first."""
        return [self.volume / "ws" / "upper", *(f.path / "ws" / "upper" for f in self.frozen)]

    def mounts(self) -> list[tuple[int, str]]:
        """Trees to attach inside the root: the workspace at its host path, if any."""
        if self.workspace is None:
            return []
        lowers: list[Path | int] = [*self.workspace_dirs()[1:], self.workspace.lower.fd]
        tree = rootfs.overlay_tree(self.volume / "ws" / "upper", self.volume / "ws" / "work",
                                   lowers)
        return [(tree, str(self.workspace.lower.host))]


class Layers:
    """Creates, snapshots and frees volumes through one snapshot backend.

    ``set_limit(volume, bytes)`` bounds a volume in the kernel (the store's quota;
    None when the store has none); ``disk_bytes`` is the limit of a new stack that
    neither asks for one nor inherits one (None: unbounded).
    """

    def __init__(self, backend, root: Path, *,
                 set_limit: Callable[[Path, int | None], None] | None = None,
                 disk_bytes: int | None = None) -> None:
        self.backend = backend
        self.root = root
        self.set_limit = set_limit
        self.disk_bytes = disk_bytes if set_limit is not None else None
        root.mkdir(parents=True, exist_ok=True)
        # Empty volumes made ahead for forks, per disk limit, in their own directory
        # (made by clear()): the store's root lists sandboxes' and images' volumes only.
        self.ready = root / "ready"
        self.blank: MadeAhead[int | None, Path] = MadeAhead("volumes", self._blank,
                                                            backend.delete)
        self.deleter = Deleter(backend.delete)

    def _new_path(self, prefix: str) -> Path:
        return self.root / f"{prefix}-{secrets.token_hex(8)}"

    def clear(self, keep: set[str]) -> None:
        """At start: delete every volume of the store not named in ``keep`` (what an
        earlier daemon left, its empty volumes made ahead too)."""
        for path in sorted(self.root.iterdir()):
            if path.name not in keep:
                self.backend.delete(path)
        self.ready.mkdir()

    def _blank(self, disk_bytes: int | None) -> Path:
        """An empty writable volume bounded to ``disk_bytes`` (None: unbounded), in
        ``root/ready``; :meth:`new_stack` moves it among the sandboxes' volumes."""
        volume = self.ready / f"w-{secrets.token_hex(8)}"
        self.backend.create_volume(volume)
        try:
            if disk_bytes is not None and self.set_limit is not None:
                self.set_limit(volume, disk_bytes)
            rootfs.blank_writable(volume)
        except BaseException:
            self.backend.delete(volume)
            raise
        return volume

    def _limit_of(self, frozen: list[FrozenLayer]) -> int | None:
        """The disk limit of a stack over ``frozen`` that does not ask for its own: the
        sandbox's the top frozen layer came from (fork inherits), else the default."""
        return frozen[0].disk_bytes if frozen else self.disk_bytes

    def want_blank(self, frozen: list[FrozenLayer], n: int) -> None:
        """Have ``n`` empty volumes made ahead for stacks over ``frozen`` (a fork's)."""
        self.blank.want(self._limit_of(frozen), n)

    def new_stack(self, frozen: list[FrozenLayer], base: list[Path],
                  workspace: WorkspaceBranch | None = None, *, ids: IdRange,
                  disk_bytes: int | None = None) -> LayerStack:
        """A new writable volume of the family of id range ``ids`` over ``frozen`` and
        ``base``, bounded to ``disk_bytes`` if given, else to the limit of the sandbox the
        top frozen layer came from (fork inherits), else to the default.

        The limit is set before anything is written to the volume, and before the
        sandbox runs: a volume is never unbounded while hostile code can reach it.
        """
        volume = self._new_path("w")
        if disk_bytes is None:
            disk_bytes = self._limit_of(frozen)
        blank = self.blank.take(disk_bytes)  # bounded already, as long as it exists
        try:
            os.rename(blank, volume)
            rootfs.prepare_writable(volume, ids.base,
                                    workspace.lower.host if workspace else None)
        except BaseException:
            for path in (blank, volume):  # wherever it is (a missing one is no error)
                self.backend.delete(path)
            raise
        for layer in frozen:
            layer.refs += 1
        ids.hold()
        stack = LayerStack(volume, list(frozen), list(base), disk_bytes=disk_bytes, ids=ids)
        if workspace is not None:
            self.join_workspace(stack, workspace)
        return stack

    def limit(self, stack: LayerStack, disk_bytes: int | None) -> None:
        """Change what ``stack``'s volume may hold (a warm sandbox handed out with a
        request's disk_mb); bytes already there stay, further writes fail past it."""
        if self.set_limit is None:
            raise ValueError("this store has no disk limits")
        self.set_limit(stack.volume, disk_bytes)
        stack.disk_bytes = disk_bytes

    def add_workspace(self, stack: LayerStack, workspace: WorkspaceBranch) -> None:
        """Give a running sandbox's stack (a warm one) a workspace after the fact."""
        rootfs.prepare_workspace(stack.volume, workspace.lower.host, stack.ids.base)
        self.join_workspace(stack, workspace)

    @staticmethod
    def join_workspace(stack: LayerStack, workspace: WorkspaceBranch) -> None:
        """``stack`` (whose volume has the workspace's layers) branches ``workspace``."""
        stack.workspace = replace(workspace)
        workspace.lower.users += 1

    def freeze(self, stack: LayerStack, hold: SandboxCgroup | None = None) -> FrozenLayer:
        """Capture ``stack``'s writable volume as a new frozen layer (O(1) on btrfs).

        A btrfs snapshot is one atomic instant whatever runs meanwhile. Any other
        backend copies the live volume file by file, so with ``hold`` (the sandbox's
        cgroup) the whole sandbox, REPL threads included, is frozen for the copy: a
        frozen layer that children share must be one instant, not a mix of before
        and after a thread's renames. Raises FreezeFailed if it would not freeze.
        """
        path = self._new_path("f")
        stack.frozen_once = True
        if hold is None or self.backend.name == "btrfs":
            self.backend.snapshot(stack.volume, path, readonly=True)
        else:
            hold.freeze()
            try:
                self.backend.snapshot(stack.volume, path, readonly=True)
            finally:
                hold.freeze(frozen=False)  # a leaf frozen on its own stays frozen
        return FrozenLayer(path, disk_bytes=stack.disk_bytes)

    def squash(self, layers: list[FrozenLayer]) -> FrozenLayer:
        """One frozen layer equal to ``layers`` (top first) stacked: bounds the chain."""
        path = self._new_path("s")
        squash.squash(self.backend, [layer.path for layer in layers], path)
        return FrozenLayer(path, disk_bytes=layers[0].disk_bytes)

    def release(self, stack: LayerStack) -> None:
        """Have the writable volume deleted and drop references to frozen layers; then
        let go of the family's id range (nothing mounts its layers any more)."""
        self.deleter.put(stack.volume)
        for layer in stack.frozen:
            self.drop(layer)
        stack.frozen = []
        ids, stack.ids = stack.ids, None
        if ids is not None:
            ids.drop()
        if stack.workspace is not None:
            stack.workspace.lower.users -= 1
            if stack.workspace.lower.users == 0:
                os.close(stack.workspace.lower.fd)
            stack.workspace = None

    def drop(self, layer: FrozenLayer) -> None:
        layer.refs -= 1
        if layer.refs <= 0:
            self.deleter.put(layer.path)

    def close(self) -> None:
        """Wait for the volumes freed so far to be deleted (before the store goes)."""
        self.deleter.close()
