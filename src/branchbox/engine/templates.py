"""Templates: a create forks a ready interpreter of its image instead of starting one.

A cold create used to cost an interpreter start and the agent's imports (~30 ms of
CPU) on top of its namespaces and mounts; 50 clients creating at once queued on that
CPU for seconds. Each built-in image gets a template (``runtime.family.Template``,
``agent.launching``) on its first create: the image's python3 with the agent loaded,
which forks the launcher of every later family of that image, and the REPL serves in
that fork. Families born this way are what the zygote's are (own user namespace
and id slot, own PID namespace, confined, entered the same way) and outlive the
template; a stop, a restart or a template that fails closes it, and the next create
starts another.

Only built-in images get one: a template's interpreter has authority over every
family it starts, and a saved or built image's python3 and libraries are a user's
files. A create whose environment sets what an interpreter reads at its start
differently (``runtime.family.START_VARIABLES``) starts its own interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from branchbox.engine.idranges import IdRange
from branchbox.engine.layers import LayerStack
from branchbox.runtime.family import Template, start_template
from branchbox.storage.idmap import slot_base, template_map
from branchbox.storage.images import KNOWN_IMAGES

log = logging.getLogger("branchbox.engine")

RETRY_AFTER = 60.0
"""Seconds after a template failed to start before another is tried (creates start
their own interpreter meanwhile)."""
RETIRE_AFTER = (600.0, 256)
"""A template is replaced after this many seconds or launches, whichever comes first:
the families it forks share its address space layout, stack canary and hash secret
(a fork's, where an exec would draw new ones), so that sharing is bounded in time and
number. The replacement starts in the background; the old one serves until it is up."""


@dataclass(eq=False)
class _Held:
    template: Template
    stack: LayerStack  # its root: the image under an empty layer of its own slot
    ids: IdRange

    def stale(self) -> bool:
        seconds, launches = RETIRE_AFTER
        return (time.monotonic() - self.template.started > seconds
                or self.template.launches >= launches)


class Templates:
    """Mixed into Engine (uses its config, zygote, ids, layers and images)."""

    async def _forker_for(self, image: str, env: dict[str, str]):
        """What forks the launcher of a new family of ``image`` whose REPL starts with
        ``env``: the image's template if it has one that serves ``env``, else the zygote."""
        if image not in KNOWN_IMAGES or not self.config.templates or self._stopping:
            return self.zygote
        held = self._templates.get(image)
        if held is None or held.template.broken:
            held = await self._template(image)
        if held is None or not held.template.serves(env):
            return self.zygote
        if held.stale() and image not in self._retiring and \
                time.monotonic() >= self._template_failed.get(image, 0.0):
            task = asyncio.get_running_loop().create_task(self._replace_template(image, held))
            self._retiring[image] = task
            task.add_done_callback(lambda _: self._retiring.pop(image, None))
        return held.template

    async def _replace_template(self, image: str, old: _Held) -> None:
        """A new template for ``image`` in the place of ``old`` (which then closes)."""
        async with self._template_lock:
            if self._templates.get(image) is not old or self._stopping:
                return
            try:
                self._templates[image] = await self._start_template(image)
            except Exception as exc:  # noqa: BLE001 - the old one serves on
                log.warning("could not replace the template of image %s (retried in "
                            "%g s): %s", image, RETRY_AFTER, exc)
                self._template_failed[image] = time.monotonic() + RETRY_AFTER
                return
        try:  # a launch it began still needs its map writer, for at most a spawn's timeout
            await asyncio.sleep(self.config.spawn_timeout)
        finally:  # or at once, at stop
            await self._let_go(old)

    async def _template(self, image: str) -> _Held | None:
        async with self._template_lock:
            held = self._templates.get(image)
            if held is not None and not held.template.broken:
                return held
            if held is not None:
                await self._close_template(image)
            if time.monotonic() < self._template_failed.get(image, 0.0):
                return None
            try:
                held = self._templates[image] = await self._start_template(image)
                return held
            except Exception as exc:  # noqa: BLE001 - whatever it was, creates go on without
                log.warning("no template for image %s (creates start their own "
                            "interpreter; retried in %g s): %s", image, RETRY_AFTER, exc)
                self._template_failed[image] = time.monotonic() + RETRY_AFTER
                return None

    async def _start_template(self, image: str) -> _Held:
        from branchbox.engine.sandboxes import ATTACH_DIR, DEFAULT_ENV

        base = await self._base_layers(image)
        ids = self.ids.allocate(f"template:{image}")
        try:
            for path in base:
                await asyncio.to_thread(ids.lower, path)
            stack = self.layers.new_stack([], base, None, ids=ids)
        except BaseException:
            ids.drop()
            raise
        try:
            template = await start_template(
                zygote=self.zygote,
                tree_fd=stack.tree(),
                id_map=template_map(ids.slot, self.ids.family_slots()),
                owner=slot_base(ids.slot),
                hostname="template",
                env={**DEFAULT_ENV, **self.image_defaults(image)[0]},
                attach=ATTACH_DIR,
                log_path=self.config.data_dir / "logs" / f"template-{image}.log",
                python=self.image_python(image),
                timeout=self.config.spawn_timeout,
            )
        except BaseException:
            self.layers.release(stack)
            ids.drop()
            raise
        return _Held(template, stack, ids)

    async def _close_template(self, image: str) -> None:
        held = self._templates.pop(image, None)
        if held is not None:
            await self._let_go(held)

    async def _let_go(self, held: _Held) -> None:
        """Close a template (its families run on), then its root and id slot go."""
        await held.template.close()
        self.layers.release(held.stack)
        held.ids.drop()

    async def _close_templates(self) -> None:
        """At stop: no family starts any more; those the templates started run on."""
        for task in list(self._retiring.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        async with self._template_lock:
            for image in list(self._templates):
                await self._close_template(image)
