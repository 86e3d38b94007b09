"""``branchbox image build``: an image from a spec, one cached layer per step.

Each step that changes files (RUN, COPY, WORKDIR) runs in a sandbox of the step
before it; that sandbox's writable layer is then frozen (the same capture as
``save_image``) and stacked on the previous step's layers. Layers are shared,
never copied. A step is cached under a key made of its parent's key and its
text (and, for COPY, a hash of what it copies), as Docker does: a second build
whose first changed step is the fourth reuses three layers and builds the rest.
ENV changes only what the next steps (and sandboxes of the image) start with.

A step is described by ``<data dir>/images/steps/<key>.json``, written after its
layer exists; an image by ``<data dir>/images/<name>.json`` (``"kind": "built"``),
written last, after every step succeeded: a failed build leaves no image, only
the cached layers of the steps that succeeded (reused by the next attempt,
collected when no image refers to them, see :func:`collect_steps`).

A step's sandbox is created as image ``step:<key>`` (a name no user image can
have), with the spec's ENV and WORKDIR and the egress the build asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import posixpath
import secrets
import tempfile
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from pathlib import Path

from branchbox.engine import errors
from branchbox.storage import image_spec
from branchbox.storage.build_context import Context, ContextError
from branchbox.storage.images import (
    KNOWN_IMAGES,
    SYSTEM_PYTHON,
    ImageBuildError,
    ImageSpec,
    ensure_image,
    image_manifest,
    write_atomically,
)

STEP_PREFIX = "step:"
# Debian suites FROM may name: the image is debootstrapped (minbase + python3, which the
# sandbox's agent needs) from the host's apt sources, like the default image.
SUITES = ("bullseye", "bookworm", "trixie", "forky", "sid", "oldstable", "stable", "testing",
          "unstable")
STEP_TIMEOUT = 3600.0  # seconds one RUN may take
_OUTPUT_TAIL = 40
# Run by the step's sandbox on its own files, so fully trusted (newer pythons' default
# filter would refuse the absolute symlinks a context may hold).
_EXTRACT = ("import os, sys, tarfile\n"
            "trust = {'filter': 'fully_trusted'} if hasattr(tarfile, 'fully_trusted_filter') "
            "else {}\n"
            "with tarfile.open(sys.argv[1]) as t: t.extractall('/', numeric_owner=True, **trust)\n"
            "os.unlink(sys.argv[1])\n")

Event = tuple[dict, bytes]


def _steps_dir(engine) -> Path:
    return engine._images_dir() / "steps"


def step_manifest(engine, key: str) -> dict | None:
    """The manifest of cached step ``key`` (its layers, python, env, workdir), or None."""
    if not key.isalnum():
        return None
    try:
        return json.loads((_steps_dir(engine) / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


async def build_from_upload(engine, name: str, upload: Path, spec_member: str,
                            internet: bool | None) -> AsyncIterator[Event]:
    """Build image ``name`` from the spec at ``spec_member`` of context tar ``upload``
    (removed when done). Everything that can be checked is checked before the first
    event (a bad spec, context or name raises InvalidRequest / Conflict); then events
    ``step``, ``output`` and finally ``done`` with the image's info. A failing step
    raises ImageBuildFailed with its output's end."""
    try:
        try:
            context = await asyncio.to_thread(Context, upload, exclude=spec_member)
            spec = image_spec.parse(context.spec_text(spec_member, image_spec.MAX_SPEC))
        except (ContextError, image_spec.SpecError) as exc:
            raise errors.InvalidRequest(str(exc)) from None
        engine.check_image_name(name)
        engine._check_image_room(0)
        base = _resolve_base(engine, spec.base)
        async for event in _build(engine, name, spec, context, base, internet):
            yield event
    finally:
        upload.unlink(missing_ok=True)


def _resolve_base(engine, base: str) -> tuple[str, str]:
    """("image" | "suite", name) of FROM's argument, or InvalidRequest."""
    if engine._saved(base) is not None or base in KNOWN_IMAGES:
        return "image", base
    if base in SUITES:
        return "suite", base
    raise errors.InvalidRequest(
        f"FROM {base!r}: no such image (`branchbox image ls`) and not a Debian suite "
        f"({', '.join(SUITES)})")


async def _build(engine, name: str, spec: image_spec.Spec, context: Context,
                 base: tuple[str, str], internet: bool | None) -> AsyncIterator[Event]:
    # Steps of builds under way (counted: two builds may share steps), kept from collection.
    building: Counter[str] = engine.__dict__.setdefault("_building_steps", Counter())
    keys: list[str] = []
    started = time.monotonic()
    total = len(spec.steps) + 1
    try:
        yield {"ev": "step", "index": 1, "total": total, "text": f"FROM {spec.base}",
               "cached": False}, b""
        state = await _from_step(engine, *base)
        keys.append(state["key"])
        building[state["key"]] += 1
        for index, written in enumerate(spec.steps, 2):
            step = image_spec.expanded(written, state["env"])  # the key keeps the text
            digest = ""
            chosen: list = []
            if step.kind == "COPY":
                try:
                    chosen = context.select(list(step.args[:-1]))
                except ContextError as exc:
                    raise errors.ImageBuildFailed(f"step {index}/{total} {step.text}: {exc}"
                                                  ) from None
                digest = await asyncio.to_thread(context.digest, chosen)
            key = hashlib.sha256(f"{state['key']}\n{step.text}\n{digest}".encode()).hexdigest()
            cached = step_manifest(engine, key)
            yield {"ev": "step", "index": index, "total": total, "text": step.text,
                   "cached": cached is not None}, b""
            building[key] += 1
            keys.append(key)
            if cached is not None:
                state = cached
                continue
            if step.kind == "ENV":
                env = dict(state["env"])
                env.update(pair.split("=", 1) for pair in step.args)
                state = {**state, "key": key, "volume": None, "env": env}
            else:
                sb = await engine.create(image=STEP_PREFIX + state["key"],
                                         env=state["env"] or None,
                                         cwd=state["workdir"] or "/", internet=internet)
                try:
                    async for event in _run_step(engine, sb.id, state, step, context, chosen,
                                                 f"step {index}/{total} {step.text}"):
                        yield event
                    volume = await engine.content.run(sb.body.layers.ids.family,
                                                      engine._capture, sb.body)
                finally:
                    with contextlib.suppress(errors.EngineError):
                        await engine.close(sb.id)
                workdir = (image_spec.workdir(state["workdir"] or "/", step.args[0])
                           if step.kind == "WORKDIR" else state["workdir"])
                state = {**state, "key": key, "volume": str(volume), "workdir": workdir,
                         "lowers": [str(volume / "upper"), *state["lowers"]]}
            write_atomically(_steps_dir(engine) / f"{key}.json", json.dumps(state))
        info = await _finish(engine, name, spec, state, keys, time.monotonic() - started)
        yield {"ev": "done", "result": info}, b""
    finally:
        building.subtract(keys)
        for key in keys:
            if building[key] <= 0:
                del building[key]


async def _from_step(engine, kind: str, base: str) -> dict:
    """The build's first step: FROM's image as a step (its layers, python, env, workdir)."""
    if kind == "suite":
        image = f"debian-{base}"
        spec = ImageSpec(suite=base, packages=("python3",))
        try:
            rootfs = await asyncio.to_thread(ensure_image, image, engine.config.image_cache,
                                             True, spec)
        except ImageBuildError as exc:
            raise errors.ImageBuildFailed(f"FROM {base}: {exc}") from None
        manifest = image_manifest(image, engine.config.image_cache) or {}
        state = {"lowers": [str(rootfs)], "python_path": SYSTEM_PYTHON, "env": {},
                 "workdir": None, "identity": f"{image}\n{manifest.get('created')}"}
    elif (saved := engine._saved(base)) is not None:
        state = {"lowers": saved["lowers"], "python_path": saved.get("python_path"),
                 "env": saved.get("env") or {}, "workdir": saved.get("workdir"),
                 "identity": f"{base}\n{saved.get('created')}\n{saved['lowers'][0]}"}
    else:
        rootfs = await asyncio.to_thread(ensure_image, base, engine.config.image_cache, True)
        manifest = image_manifest(base, engine.config.image_cache) or {}
        state = {"lowers": [str(rootfs)], "python_path": engine.image_python(base),
                 "env": {}, "workdir": None,
                 "identity": f"{base}\n{manifest.get('version')}\n{manifest.get('created')}"}
    state["key"] = hashlib.sha256(f"FROM\n{state['identity']}".encode()).hexdigest()
    state["volume"] = None
    if step_manifest(engine, state["key"]) is None:
        _steps_dir(engine).mkdir(parents=True, exist_ok=True)
        write_atomically(_steps_dir(engine) / f"{state['key']}.json", json.dumps(state))
    return state


async def _run_step(engine, sandbox_id: str, state: dict, step: image_spec.Step,
                    context: Context, chosen: list, where: str) -> AsyncIterator[Event]:
    """Run one RUN / COPY / WORKDIR in ``sandbox_id`` (a sandbox of ``state``), its output
    as events; ImageBuildFailed with the output's end unless it exits 0."""
    cwd = state["workdir"] or "/"
    if step.kind == "RUN":
        cmd = list(step.args)
    elif step.kind == "WORKDIR":
        cmd = ["mkdir", "-p", image_spec.workdir(cwd, step.args[0])]
    else:
        staged = f"/.bb-copy-{secrets.token_hex(8)}.tar"
        await _send_copy(engine, sandbox_id, context, chosen, cwd, step.args, staged)
        cmd = [engine.image_python(STEP_PREFIX + state["key"]), "-c", _EXTRACT, staged]
    output: deque[str] = deque(maxlen=_OUTPUT_TAIL)
    exit_code = None
    try:
        async for header, _ in engine.stream(sandbox_id, "exec", {"cmd": cmd, "cwd": cwd,
                                                                  "timeout": STEP_TIMEOUT}):
            kind = header.get("ev")
            if kind in ("stdout", "stderr"):
                data = str(header.get("data", ""))
                output.extend(data.splitlines())
                yield {"ev": "output", "stream": kind, "data": data}, b""
            elif kind == "done":
                exit_code = (header.get("result") or {}).get("exit_code")
    except errors.EngineError as exc:
        raise errors.ImageBuildFailed(f"{where}: {exc.message}") from None
    if exit_code != 0:
        raise errors.ImageBuildFailed(
            f"{where}: exited with status {exit_code}; last output:\n" + "\n".join(output))


async def _send_copy(engine, sandbox_id: str, context: Context, chosen: list, cwd: str,
                     words: tuple[str, ...], staged: str) -> None:
    """Put a COPY's tar at ``staged`` in the sandbox (it unpacks it itself)."""
    dest = posixpath.normpath(posixpath.join(cwd, words[-1]))
    # One source naming one file is copied as ``dest`` itself, unless dest ends with "/";
    # directories (their contents), globs and several sources go into directory ``dest``.
    one_file = (len(words) == 2 and len(chosen) == 1
                and chosen[0][0].name == posixpath.normpath(words[0].lstrip("/")))
    into_dir = words[-1].endswith("/") or not one_file
    with tempfile.TemporaryFile(dir=engine.config.data_dir / "run") as out:
        await asyncio.to_thread(context.copy_tar, chosen, dest, out, into_dir)
        out.seek(0)

        async def chunks() -> AsyncIterator[bytes]:
            while chunk := await asyncio.to_thread(out.read, 1 << 20):
                yield chunk

        await engine.write_file(sandbox_id, staged, chunks(), 0o600)


async def _finish(engine, name: str, spec: image_spec.Spec, state: dict, keys: list[str],
                  seconds: float) -> dict:
    """Record image ``name`` (last: until then no image exists)."""
    lock = engine.__dict__.setdefault("_image_lock", asyncio.Lock())
    own = [Path(step["volume"]) / "upper" for key in keys
           if (step := step_manifest(engine, key)) and step.get("volume")]
    manifest = {
        "name": name, "kind": "built", "created": time.time(), "from_image": spec.base,
        "lowers": state["lowers"], "steps": keys, "python_path": state["python_path"],
        "env": state["env"], "workdir": state["workdir"],
        "size_bytes": sum([await engine.content.run(f"build:{name}", engine.layer_bytes, p)
                           for p in own]),
        "build_seconds": round(seconds, 1),
    }
    async with lock:
        engine.check_image_name(name)
        engine._check_image_room(manifest["size_bytes"])
        write_atomically(engine._images_dir() / f"{name}.json", json.dumps(manifest))
    return engine._image_info(manifest)


def collect_steps(engine) -> None:
    """Delete the cached steps no image and no build in progress refers to (and every
    slot's id-mapped view of their layers)."""
    referenced = {layer for m in engine._saved_all() for layer in m.get("lowers", [])}
    building: Counter[str] = engine.__dict__.get("_building_steps", Counter())
    with contextlib.suppress(FileNotFoundError):
        for path in sorted(_steps_dir(engine).glob("*.json")):
            step = step_manifest(engine, path.stem)
            if step is None or path.stem in building:
                continue
            if step.get("volume") and step["lowers"][0] in referenced:
                continue
            if not step.get("volume") and any(
                    (s := step_manifest(engine, k)) and s.get("lowers") == step["lowers"]
                    for k in building):
                continue
            path.unlink()
            engine._base_cache.pop(STEP_PREFIX + path.stem, None)
            if step.get("volume"):
                engine.ids.forget(Path(step["lowers"][0]))
                engine.layers.backend.delete(Path(step["volume"]))
