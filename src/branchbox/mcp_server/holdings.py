"""The sandboxes one MCP session holds, and closing them when the session ends.

An agent that forks a hundred times and then disconnects must not leave a
hundred sandboxes running: every sandbox a session creates (or forks) is
closed when the session ends, unless the client asked to ``keep`` it.
Sandboxes the session only reached by id (made elsewhere) are let go, never
closed, at the end.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from branchbox.sdk import AsyncSandbox

log = logging.getLogger(__name__)


@dataclass
class Held:
    sandbox: AsyncSandbox
    owned: bool  # made by this session: closed at its end unless kept
    keep: bool = False


class Holdings:
    """``url``/``api_key`` name the daemon (None: ``$BRANCHBOX_URL``, else the local one)."""

    def __init__(self, url: str | None, api_key: str | None) -> None:
        self.url = url
        self.api_key = api_key
        self._held: dict[str, Held] = {}
        self._connecting = asyncio.Lock()

    async def create(self, *, keep: bool, **spec: object) -> AsyncSandbox:
        sandbox = await AsyncSandbox(url=self.url, api_key=self.api_key, **spec).start()
        self._held[sandbox.id] = Held(sandbox, owned=True, keep=keep)
        return sandbox

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """The sandbox by id: one this session holds, else attached (``SandboxNotFound``)."""
        async with self._connecting:  # two calls on one new id attach it once
            if sandbox_id not in self._held:
                sandbox = await AsyncSandbox.connect(sandbox_id, url=self.url,
                                                     api_key=self.api_key)
                self._held[sandbox_id] = Held(sandbox, owned=False)
            return self._held[sandbox_id].sandbox

    def adopt(self, children: list[AsyncSandbox], parent_id: str, keep: bool | None) -> None:
        """Fork children are the session's own; ``keep`` None follows the parent."""
        if keep is None:
            parent = self._held.get(parent_id)
            keep = parent is not None and parent.owned and parent.keep
        for child in children:
            self._held[child.id] = Held(child, owned=True, keep=keep)

    def forget(self, sandbox_id: str) -> None:
        """A sandbox that no longer exists under this id (closed, merged away)."""
        self._held.pop(sandbox_id, None)

    async def end(self) -> None:
        """Close what the session made and did not keep; let go of the rest."""
        held, self._held = list(self._held.values()), {}
        results = await asyncio.gather(*(
            item.sandbox.close() if item.owned and not item.keep else item.sandbox.detach()
            for item in held), return_exceptions=True)
        for item, result in zip(held, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("could not close sandbox %s at the end of the MCP session: %s",
                            item.sandbox.id, result)
