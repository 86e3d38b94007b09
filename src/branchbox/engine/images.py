"""Images made from live sandboxes: ``save_image``, listing and removing images.

A saved image is one layer (the sandbox's own changes: its writable layer and
the frozen layers below it, squashed into one volume of the store) stacked on
the layers the sandbox itself was stacked on. The layers below are referenced,
never copied; the new layer is a snapshot (O(1) on btrfs) whose ownership is
moved from the family's host id range into the images' range (slot 0), so every
family sees it through its own id-mapped view, exactly like a built image. Only
the filesystem is saved, never memory or processes.

Each saved image is described by ``<data dir>/images/<name>.json``, written
last: a crash mid-save leaves at most an orphan volume, never a half image.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import stat
import time
from pathlib import Path

from branchbox.engine import errors
from branchbox.engine.host_image import HOST
from branchbox.engine.image_build import STEP_PREFIX, collect_steps, step_manifest
from branchbox.storage import btrfs
from branchbox.storage.copyfs import DIR_FLAGS, remove_tree, walk
from branchbox.storage.idmap import UID_BASE, UID_COUNT
from branchbox.storage.images import KNOWN_IMAGES, SYSTEM_PYTHON, image_manifest, write_atomically

# Lower case, digits and . _ -; at most 64; not a path, so it can name a file.
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
RESERVED = (HOST,)  # the host's own root (engine/host_image.py)
_SETID = stat.S_ISUID | stat.S_ISGID


# What of the store saved and built images may hold together: the rest is the sandboxes'.
IMAGES_SHARE = 0.5


class SavedImages:
    """Mixed into Engine (uses its config, store, layers, live sandboxes and warm pool)."""

    # ------------------------------------------------------------------ lookups
    def _images_dir(self) -> Path:
        return self.config.data_dir / "images"

    def _saved(self, name: str) -> dict | None:
        """The manifest of saved (or built) image ``name``, or None if there is none; a
        build step's (``step:<key>``) for the sandbox a build runs that step in."""
        if name.startswith(STEP_PREFIX):
            return step_manifest(self, name[len(STEP_PREFIX):])
        if not _NAME.match(name):
            return None
        try:
            return json.loads((self._images_dir() / f"{name}.json").read_text())
        except FileNotFoundError:
            return None

    def _saved_all(self) -> list[dict]:
        found = []
        with contextlib.suppress(FileNotFoundError):
            for path in sorted(self._images_dir().glob("*.json")):
                with contextlib.suppress(OSError, ValueError):
                    found.append(json.loads(path.read_text()))
        return found

    def image_python(self, image: str) -> str:
        """The interpreter the REPL of a sandbox of ``image`` runs: the image's venv python
        if its build made one (so ``pip install`` then ``import`` works in the REPL)."""
        saved = self._saved(image)
        if saved is not None:
            return saved.get("python_path") or SYSTEM_PYTHON
        manifest = image_manifest(image, self.config.image_cache)
        return (manifest or {}).get("python_path") or SYSTEM_PYTHON

    def _users_of(self, name: str) -> list[str]:
        """Ids of live (and stopped, still recorded) sandboxes started from ``name``."""
        users = {sid for sid, sb in self.live.items() if sb.record.image == name}
        with contextlib.suppress(Exception):  # the records' view; live ones are above
            users.update(rec.id for rec in self.records.live() if rec.image == name)
        return sorted(users)

    def check_image(self, image: str) -> None:
        """InvalidRequest unless ``image`` can start a sandbox: built in, the host's, or
        saved or built here. Checked before the warm pool keeps anything per image name
        (a create of a name that is none made it start sandboxes of it, and keep a pool
        and a count per name sent)."""
        if image in KNOWN_IMAGES or image == HOST or self._saved(image) is not None:
            return
        raise errors.InvalidRequest(
            f"unknown image {str(image)[:80]!r}; `branchbox image ls` (GET /v1/images) lists "
            "the images, GET /v1/snapshots the snapshots (Sandbox(snapshot=...))")

    def check_image_name(self, name: object) -> None:
        """InvalidRequest unless ``name`` can name a new image; Conflict if it is taken."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise errors.InvalidRequest(
                "an image name is 1-64 of a-z 0-9 . _ - and starts with a letter or digit")
        if name in KNOWN_IMAGES or name in RESERVED:
            raise errors.Conflict(f"image name {name!r} is reserved")
        if self._saved(name) is not None:
            raise errors.Conflict(f"image {name!r} exists; remove it first")
        if name in self._snapshots:  # E2B starts sandboxes from either by name
            raise errors.Conflict(f"a snapshot is named {name!r}; delete it first")

    # --------------------------------------------------------------------- save
    async def save_image(self, sandbox_id: str, name: str, workdir: str | None = None) -> dict:
        """Freeze ``sandbox_id``'s filesystem as image ``name``; returns the image's info.
        Its sandboxes start in ``workdir`` if given, else where the sandbox's image's do.

        Holds the sandbox's lock (as fork does): a merge or restore cannot swap its body
        while its layers are captured, and a call under way finishes first."""
        self.check_image_name(name)
        self._check_image_room(0)
        sb = self.get(sandbox_id)
        if sb.record.image == HOST:
            raise errors.InvalidRequest(
                "a sandbox of image 'host' cannot be saved: its root is the host's own")
        await self._acquire(sb, self.config.busy_wait)
        try:
            self.check_image_name(name)
            manifest = await self._save_locked(sb, name, workdir)
        finally:
            self._unlock(sb)
        return self._image_info(manifest)

    async def _save_locked(self, sb, name: str, workdir: str | None) -> dict:
        """Capture ``sb`` (locked) as image ``name``. The capture takes as long as the
        sandbox's files (8 s for 300,000) and runs outside the daemon's image lock, so
        other saves and builds go on meanwhile; the name is taken under the lock, and a
        capture that lost it to another save is deleted."""
        body = sb.body
        family = body.layers.ids.family
        volume = await self.content.run(family, self._capture, body)
        stack = body.layers
        try:
            manifest = {
                "name": name,
                "kind": "saved",
                "created": time.time(),
                "from_sandbox": sb.id,
                "from_image": sb.record.image,
                "volume": str(volume),
                # top first: this image's layer, then what the sandbox stood on
                # (its base layers but the agent's, which every sandbox gets anew)
                "lowers": [str(volume / "upper"), *map(str, stack.base[1:])],
                "python_path": self.image_python(sb.record.image),
                # what the sandbox's image gave its sandboxes, its sandboxes get too
                **{k: v for k, v in (self._saved(sb.record.image) or {}).items()
                   if k in ("env", "workdir")},
                **({"workdir": workdir} if workdir is not None else {}),
                "size_bytes": await self.content.run(family, _usage, volume / "upper"),
            }
            async with self.__dict__.setdefault("_image_lock", asyncio.Lock()):
                self.check_image_name(name)  # a save or build took it meanwhile
                self._check_image_room(manifest["size_bytes"])
                self._images_dir().mkdir(parents=True, exist_ok=True)
                write_atomically(self._images_dir() / f"{name}.json", json.dumps(manifest))
        except BaseException:
            self.layers.deleter.put(volume)
            raise
        return manifest

    def _check_image_room(self, adding: int) -> None:
        """Refuse an image of ``adding`` bytes past the images' share of the store: they
        outlive every sandbox and every limit (a loop of create, write, save, close filled
        the store for every family), so together they hold at most
        :data:`IMAGES_SHARE` of it and number at most ``config.max_images``."""
        manifests = self._saved_all()
        held = sum(m.get("size_bytes") or 0 for m in manifests)
        room = int(self.store.capacity() * IMAGES_SHARE)
        if len(manifests) >= self.config.max_images:
            raise errors.InsufficientStorage(
                f"the server holds {len(manifests):,} images, its limit "
                f"(BRANCHBOX_MAX_IMAGES); delete some first")
        if held + adding > room:
            raise errors.InsufficientStorage(
                f"images would hold {(held + adding) >> 20:,} MiB, past their share of the "
                f"store ({room >> 20:,} MiB, half of it); delete some first")

    def _image_volumes(self) -> set[str]:
        """Names of the store's volumes images stand on (saved images' and cached build
        steps'), which a starting daemon keeps."""
        manifests = self._saved_all()
        with contextlib.suppress(FileNotFoundError):
            for path in (self._images_dir() / "steps").glob("*.json"):
                with contextlib.suppress(OSError, ValueError):
                    manifests.append(json.loads(path.read_text()))
        return {Path(m["volume"]).name for m in manifests if m.get("volume")}

    def layer_bytes(self, path: Path) -> int:
        """Bytes a layer directory holds (for an image's size)."""
        return _usage(path)

    def image_defaults(self, image: str) -> tuple[dict[str, str], str | None]:
        """The environment and working directory sandboxes of ``image`` start with (a
        built image's ENV and WORKDIR)."""
        manifest = self._saved(image) or {}
        return dict(manifest.get("env") or {}), manifest.get("workdir")

    def _capture(self, body) -> Path:
        """A new store volume whose upper/ is ``body``'s root as it is now, minus the
        image below it, owned in the images' id range (runs in a thread)."""
        stack = body.layers
        layers, backend = self.layers, self.layers.backend
        hold = backend.name != "btrfs"  # a copy must be one instant: freeze the sandbox
        if hold:
            body.cgroup.freeze()
        try:
            if stack.frozen:
                top = layers.freeze(stack)
                try:
                    squashed = layers.squash([top, *stack.frozen])
                finally:
                    backend.delete(top.path)
                volume = squashed.path
            else:
                volume = layers.root / f"i-{secrets.token_hex(8)}"
                backend.snapshot(stack.volume, volume, readonly=False)
        finally:
            if hold:
                body.cgroup.freeze(frozen=False)
        try:
            final = layers.root / f"i-{secrets.token_hex(8)}"
            os.rename(volume, final)
            volume = final
            for extra in ("work", "ws"):  # overlay's scratch, and a workspace (a host dir)
                extra_path = volume / extra
                if extra_path.exists():
                    remove_tree(extra_path)
            _rebase_tree(volume / "upper", stack.ids.base, UID_BASE)
            if backend.name == "btrfs":
                btrfs.set_readonly(volume, True)
        except BaseException:
            backend.delete(volume)
            raise
        return volume

    # ----------------------------------------------------------------- ls and rm
    def list_images(self) -> list[dict]:
        """Built-in images (built or not yet), the host's root, and saved and built ones,
        with their users."""
        out = [{"name": HOST, "kind": "host", "built": True, "created": None,
                "size_bytes": None, "python": SYSTEM_PYTHON, "users": self._users_of(HOST)}]
        for name in KNOWN_IMAGES:
            manifest = image_manifest(name, self.config.image_cache) or {}
            out.append({"name": name, "kind": "built-in", "built": bool(manifest),
                        "created": manifest.get("created"),
                        "size_bytes": manifest.get("size_bytes"),
                        "python": manifest.get("python_path"),
                        "users": self._users_of(name)})
        out += [self._image_info(m) for m in self._saved_all()]
        return out

    def _image_info(self, manifest: dict) -> dict:
        return {"name": manifest["name"], "kind": manifest.get("kind", "saved"), "built": True,
                "created": manifest.get("created"), "size_bytes": manifest.get("size_bytes"),
                "python": manifest.get("python_path"), "from_image": manifest.get("from_image"),
                "from_sandbox": manifest.get("from_sandbox"),
                "steps": len(manifest.get("steps") or []) or None,
                "build_seconds": manifest.get("build_seconds"),
                "users": self._users_of(manifest["name"])}

    async def remove_image(self, name: str) -> None:
        """Delete saved or built image ``name``; refused while a sandbox uses it, or while
        another image stands on a saved image's layer. A built image's steps stay cached
        while another image refers to them; the others go with it."""
        if name in KNOWN_IMAGES:
            raise errors.Conflict(
                f"image {name!r} is built in (rebuilt on use); only saved images can be removed")
        lock = self.__dict__.setdefault("_image_lock", asyncio.Lock())
        async with lock:
            manifest = self._saved(name) if not name.startswith(STEP_PREFIX) else None
            if manifest is None:
                raise errors.InvalidRequest(f"no image {name!r}; `branchbox image ls` lists them")
            users = self._users_of(name)
            if users:
                raise errors.Conflict(
                    f"image {name!r} is used by {len(users)} sandbox(es): {', '.join(users)}")
            own = manifest["lowers"][0] if manifest.get("volume") else None
            built_on = [m["name"] for m in self._saved_all()
                        if m["name"] != name and own in m.get("lowers", [])]
            if built_on:
                raise errors.Conflict(
                    f"image {name!r} is the base of image(s) {', '.join(built_on)}")
            await self._drop_warm_of(name)
            (self._images_dir() / f"{name}.json").unlink()
            self._base_cache.pop(name, None)
            if own is not None:
                self.ids.forget(Path(own))  # the slots' id-mapped views of it
                self.layers.deleter.put(Path(manifest["volume"]))
            await asyncio.to_thread(collect_steps, self)

    async def _drop_warm_of(self, image: str) -> None:
        """Stop the warm sandboxes kept for ``image`` (nobody asked for them)."""
        task = self._refilling.get(image)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        pool = self._warm.pop(image, [])
        while pool:
            sb = pool.pop()
            await self._destroy_body(sb.body)
            await sb.family.family.kill()

    def _saved_lowers(self, image: str) -> list[Path] | None:
        """The layers (top first, below the agent's) of saved image ``image``, or None."""
        manifest = self._saved(image)
        return None if manifest is None else [Path(p) for p in manifest["lowers"]]


def _rebase_tree(root: Path, old_base: int, new_base: int) -> None:
    """Move the owners of everything under ``root`` from host range ``old_base``.. to
    ``new_base``.. (ids outside the old range are left alone). Symlinks are not
    followed; chown's clearing of setuid/setgid is undone, as shift_tree does."""
    fd = os.open(root, DIR_FLAGS)
    try:
        top = os.fstat(fd)
        _rebase(fd, ".", top, old_base, new_base)
        for parent, name, st in walk(fd):
            if st.st_dev == top.st_dev:  # never leave the volume
                _rebase(parent, name, st, old_base, new_base)
    finally:
        os.close(fd)


def _rebase(parent: int, name: str, st: os.stat_result, old_base: int, new_base: int
            ) -> None:
    def move(value: int) -> int:
        return value - old_base + new_base if old_base <= value < old_base + UID_COUNT else value

    uid, gid = move(st.st_uid), move(st.st_gid)
    if (uid, gid) == (st.st_uid, st.st_gid):
        return
    os.chown(name, uid, gid, dir_fd=parent, follow_symlinks=False)
    if st.st_mode & _SETID and not stat.S_ISLNK(st.st_mode):
        os.chmod(name, stat.S_IMODE(st.st_mode), dir_fd=parent)


def _usage(root: Path) -> int:
    """Bytes the files under ``root`` take (a tree of any depth: ``copyfs.walk``)."""
    fd = os.open(root, DIR_FLAGS)
    try:
        return sum(st.st_blocks * 512 for _, _, st in walk(fd))
    finally:
        os.close(fd)
