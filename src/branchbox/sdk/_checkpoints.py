"""``AsyncCheckpoint``: a checkpoint in the SDK (``Checkpoint`` is its blocking face).

A checkpoint is a frozen instant of one sandbox (memory and files), kept by the
server until deleted or until its sandbox ends; it is addressed through its
sandbox (``/v1/sandboxes/{id}/checkpoints/{cp}``).
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from branchbox.sdk._async import AsyncSandbox


class AsyncCheckpoint:
    """An instant of ``sandbox``: ``await sandbox.restore(cp)`` goes back to it,
    ``await cp.fork(n)`` branches from it, ``await cp.delete()`` frees it."""

    def __init__(self, sandbox: AsyncSandbox, info: dict) -> None:
        self.sandbox = sandbox
        self.id: str = info["id"]
        self.name: str | None = info.get("name")
        self.created: float | None = info.get("created")
        # The host processes holding it and their memory, when it was listed.
        self.resources: dict = info.get("resources") or {}

    def _url(self, suffix: str = "") -> str:
        return self.sandbox._url(f"/checkpoints/{self.id}{suffix}")

    async def fork(self, n: int = 1) -> builtins.list[AsyncSandbox]:
        """``n`` new sandboxes as the sandbox was at this instant (children of it)."""
        reply = await self.sandbox._api.answer(
            "fork_checkpoint", self.sandbox.id, {"checkpoint": self.id, "n": n},
            self._url("/fork"), {"n": n})
        return self.sandbox._children(reply)

    async def delete(self) -> None:
        """Free the checkpoint (its process and layers)."""
        await self.sandbox._api.call("DELETE", self._url())

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"<{type(self).__name__} {self.id}{label} of {self.sandbox._id}>"
