"""E2B's control plane (``E2B_API_URL``): create, get, list, kill, timeout, connect, fork,
pause, resume, network, metrics, filesystem snapshots -- the REST routes E2B's published
SDK calls, onto the engine.

Shapes follow the SDK's generated client (``e2b/api/client``): camelCase JSON,
``{"code", "message"}`` errors (plus our ``error``), 201 on create and fork,
204 on kill and timeout, the next page's token in ``X-Next-Token``.

Mapping: a template is a branchbox image name (E2B's own default template names
mean the default image); ``timeout`` is the sandbox's lifetime in seconds, as E2B
sends it; metadata is kept as the sandbox's labels; internet access is on unless
the client turns it off (E2B's default, unlike branchbox's own); E2B's fork with
``count`` is the engine's fork of n. A sandbox in E2B's default templates starts in
``/home/user``.
"""

from __future__ import annotations

import base64
import contextlib
import os
import urllib.parse
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from branchbox.engine import errors
from branchbox.engine.metrics import Sample
from branchbox.engine.sandboxes import Engine
from branchbox.server.deps import EngineDep
from branchbox.server.e2b_access import NOT_RUNNING, NOT_RUNNING_STATUS, access_token
from branchbox.server.errors import describe, validation_message
from branchbox.server.sandbox_json import SandboxJSON

# The envd version we answer as: the SDK gates features on it. 0.5.7 is the first with
# everything we serve (default user, stdin, octet-stream uploads) and none of what we do not
# (file metadata, entry info in watch events).
ENVD_VERSION = "0.5.7"
# Template names E2B's SDKs use by default: they get branchbox's default image.
DEFAULT_TEMPLATES = frozenset({"base", "code-interpreter-v1", "code-interpreter"})
E2B_HOME = "/home/user"
_DEFAULT_TIMEOUT = 15  # seconds: E2B's API default when a client sends none
_PAGE = 100
_METRICS_IDS = 100  # sandboxes of one metrics call (E2B's own limit)


class E2BRoute(APIRoute):
    """A route whose failures answer in E2B's error shape, which its SDK reads
    (``message``), beside our usual ``error``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return e2b_error(400, validation_message(exc))
            except errors.EngineError as exc:
                return self.failure(exc)

        return handle

    @staticmethod
    def failure(exc: errors.EngineError) -> Response:
        status, message, _ = describe(exc)
        return e2b_error(status, message)


class E2BSandboxRoute(E2BRoute):
    """A route of E2B's sandbox plane: as the control plane's, except that a sandbox not
    there is E2B's proxy's 502 (``e2b_access.NOT_RUNNING``), not a 404."""

    @staticmethod
    def failure(exc: errors.EngineError) -> Response:
        if isinstance(exc, errors.SandboxNotFound):
            return e2b_error(NOT_RUNNING_STATUS, NOT_RUNNING)
        return E2BRoute.failure(exc)


def e2b_error(status: int, message: str) -> JSONResponse:
    return SandboxJSON({"code": status, "message": message, "error": message},
                        status_code=status)


# E2B's routes are E2B's API, described by E2B's own specification, not by our OpenAPI
# document (whose property checks expect our error shape and our authentication).
router = APIRouter(tags=["e2b"], route_class=E2BRoute, include_in_schema=False)


class E2BBody(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class E2BNetwork(E2BBody):
    allow_out: list[str] | None = Field(None, alias="allowOut")
    deny_out: list[str] | None = Field(None, alias="denyOut")


class NewSandbox(E2BBody):
    template_id: str = Field(alias="templateID", min_length=1, max_length=255)
    timeout: int | None = Field(None, ge=1, le=7 * 86400)
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars")
    allow_internet_access: bool | None = None
    network: E2BNetwork | None = None


class NewSnapshot(E2BBody):
    name: str | None = Field(None, max_length=255)
    memory: bool | None = None


class SandboxTimeout(E2BBody):
    timeout: int = Field(ge=1, le=7 * 86400)


class ConnectSandbox(E2BBody):
    timeout: int | None = Field(None, ge=1, le=7 * 86400)


class ForkSandbox(E2BBody):
    timeout: int | None = Field(None, ge=1, le=7 * 86400)
    count: int | None = None


def _image(template: str) -> str:
    name = untagged(template)
    return "default" if name in DEFAULT_TEMPLATES else name


def untagged(name: str) -> str:
    """A template or snapshot name without E2B's default tag (``name:default``, as E2B
    writes ids): here each name has one version."""
    return name.removesuffix(":default")


def _created(request: Request, engine: Engine, sandbox_id: str) -> dict:
    """E2B's ``Sandbox`` (the answer to create, connect and each fork child)."""
    info = engine.info(sandbox_id)
    token = access_token(request, sandbox_id)
    return {"templateID": info["image"], "sandboxID": sandbox_id, "clientID": "branchbox",
            "envdVersion": ENVD_VERSION, "envdAccessToken": token,
            "trafficAccessToken": token, "domain": None}


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def _listed(engine: Engine, sandbox_id: str) -> dict:
    """E2B's ``ListedSandbox`` fields (``SandboxDetail`` adds a few)."""
    info = engine.info(sandbox_id)
    ends = engine.expires_at(sandbox_id)
    return {"templateID": info["image"], "sandboxID": sandbox_id, "clientID": "branchbox",
            "startedAt": _iso(info["created"]), "endAt": _iso(ends or 253402300799),
            # Sandboxes share the host's CPUs; memory is unlimited (0) unless one was set.
            "cpuCount": os.cpu_count() or 1,
            "memoryMB": engine.get(sandbox_id).record.meta.get("memory_mb") or 0,
            "diskSizeMB": info["disk_mb"] or 0,
            "state": "paused" if info["state"] == "paused" else "running",
            "envdVersion": ENVD_VERSION, "metadata": info["labels"]}


@router.post("/v2/sandboxes", status_code=201)
@router.post("/sandboxes", status_code=201)
async def create(body: NewSandbox, request: Request, engine: EngineDep) -> dict:
    """Start a sandbox from a template (= image); answers once it is ready."""
    image = _image(body.template_id)
    network = None
    if body.network is not None:
        network = {k: v for k, v in (("allow_out", body.network.allow_out),
                                     ("deny_out", body.network.deny_out)) if v is not None}
    internet = True if body.allow_internet_access is None else body.allow_internet_access
    if engine.is_snapshot(image):
        sb = await engine.start_from_snapshot(image, env=body.env_vars or None,
                                              timeout=body.timeout or _DEFAULT_TIMEOUT,
                                              internet=internet, network=network)
    else:
        sb = await engine.create(image=image, env=body.env_vars or None,
                                 cwd=E2B_HOME if image == "default" else None,
                                 timeout=body.timeout or _DEFAULT_TIMEOUT,
                                 internet=internet, network=network)
    engine.set_labels(sb.id, body.metadata or {})
    return _created(request, engine, sb.id)


# Before /sandboxes/{sandbox_id}, which would take "metrics" for an id.
@router.get("/sandboxes/metrics")
async def metrics_of_many(engine: EngineDep, sandbox_ids: Annotated[
        str, Query(max_length=_METRICS_IDS * 40)]) -> dict:
    """A metrics sample of each named sandbox that exists (comma-separated ids, at most
    ``_METRICS_IDS``): E2B's ``SandboxesWithMetrics``."""
    ids = list(dict.fromkeys(i for i in sandbox_ids.split(",") if i))
    if len(ids) > _METRICS_IDS:
        raise errors.InvalidRequest(f"at most {_METRICS_IDS} sandbox ids at once")
    found = {}
    for sandbox_id in ids:
        with contextlib.suppress(errors.SandboxNotFound):
            found[sandbox_id] = _metric(await engine.metrics(sandbox_id))
    return {"sandboxes": found}


@router.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(sandbox_id: str, engine: EngineDep,
                  start: Annotated[int | None, Query(ge=0)] = None,
                  end: Annotated[int | None, Query(ge=0)] = None) -> list[dict]:
    """E2B's metrics of one sandbox between ``start`` and ``end`` (unix seconds): here one
    sample, taken now (none if now is outside them). E2B keeps a series sampled every 5
    s; this daemon samples when asked (``engine/metrics``)."""
    sample = await engine.metrics(sandbox_id)
    if (start is not None and sample.at < start) or (end is not None and sample.at > end + 1):
        return []
    return [_metric(sample)]


def _metric(sample: Sample) -> dict:
    """E2B's ``SandboxMetric``: a disk the store does not count or bound is 0 of 0."""
    return {"timestamp": _iso(sample.at), "timestampUnix": int(sample.at),
            "cpuCount": sample.cpu_count, "cpuUsedPct": sample.cpu_used_pct,
            "memUsed": sample.memory_bytes, "memTotal": sample.memory_limit_bytes,
            "memCache": sample.memory_cache_bytes, "diskUsed": sample.disk_bytes or 0,
            "diskTotal": sample.disk_limit_bytes or 0}


@router.get("/sandboxes/{sandbox_id}")
async def get(sandbox_id: str, engine: EngineDep) -> dict:
    """E2B's ``SandboxDetail``."""
    info = engine.info(sandbox_id)
    policy = info["network"] or {}
    return {**_listed(engine, sandbox_id), "allowInternetAccess": policy.get("internet"),
            "domain": None}


@router.get("/v2/sandboxes")
async def list_sandboxes(
    engine: EngineDep, response: Response,
    metadata: Annotated[str | None, Query(max_length=8192)] = None,
    state: Annotated[str | None, Query(max_length=64)] = None,
    next_token: Annotated[str | None, Query(alias="nextToken", max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = _PAGE,
) -> list[dict]:
    """Sandboxes whose labels match every ``metadata`` pair (``k=v&...``, URL-encoded),
    oldest first, ``limit`` a page; the next page's token is in ``X-Next-Token``."""
    wanted = dict(urllib.parse.parse_qsl(metadata or "", keep_blank_values=True))
    states = set((state or "running,paused").split(","))
    found = [(_order(sb), _listed(engine, sb.id)) for sb in engine.list()]
    found = sorted((f for f in found if f[1]["state"] in states
                    and all(f[1]["metadata"].get(k) == v for k, v in wanted.items())),
                   key=lambda f: f[0])
    return _page(found, next_token, limit, response)


@router.get("/sandboxes")
async def list_sandboxes_v1(engine: EngineDep) -> list[dict]:
    """The older, unpaged list."""
    return [_listed(engine, sb.id) for sb in sorted(engine.list(), key=_order)]


def _order(sb: Any) -> tuple[float, str]:
    return sb.record.created, sb.id


def _page(found: list[tuple[tuple[float, str], Any]], next_token: str | None, limit: int,
          response: Response) -> list:
    """The page of ``found`` ((position, item) pairs in listing order: creation time,
    name) after ``next_token``'s position; the next page's token in ``X-Next-Token``."""
    after = _position(next_token) if next_token else None
    found = [f for f in found if after is None or f[0] > after]
    if len(found) > limit:
        last = found[limit - 1][0]
        response.headers["X-Next-Token"] = base64.urlsafe_b64encode(
            f"{last[0]!r}:{last[1]}".encode()).decode()
    return [item for _, item in found[:limit]]


def _position(token: str) -> tuple[float, str]:
    """The place in the listing order (creation time, id) of the previous page's last
    sandbox, which the token names; the next page starts after it, even if it is gone."""
    try:
        created, _, sandbox_id = base64.b64decode(
            token.encode(), altchars=b"-_", validate=True).decode().partition(":")
        return float(created), sandbox_id
    except ValueError:
        raise errors.InvalidRequest("nextToken is not a token this server gave") from None


@router.delete("/sandboxes/{sandbox_id}", status_code=204, response_class=Response)
async def kill(sandbox_id: str, engine: EngineDep) -> None:
    await engine.close(sandbox_id)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204, response_class=Response)
async def set_timeout(sandbox_id: str, body: SandboxTimeout, engine: EngineDep) -> None:
    """The sandbox now ends ``timeout`` seconds from now."""
    engine.set_timeout(sandbox_id, body.timeout)


@router.post("/v2/sandboxes/{sandbox_id}/connect")
@router.post("/sandboxes/{sandbox_id}/connect")
async def connect(sandbox_id: str, request: Request, engine: EngineDep, response: Response,
                  body: Annotated[ConnectSandbox, Body(default_factory=ConnectSandbox)]
                  ) -> dict:
    """Attach to a sandbox (200), resuming it first if it was paused (201); ``timeout``
    extends its lifetime."""
    if engine.info(sandbox_id)["state"] == "paused":
        await engine.resume(sandbox_id)
        response.status_code = 201
    if body.timeout is not None:
        engine.set_timeout(sandbox_id, body.timeout)
    return _created(request, engine, sandbox_id)


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204, response_class=Response)
async def pause(sandbox_id: str, engine: EngineDep) -> None:
    """Freeze everything in the sandbox (memory kept); connect or resume thaws it."""
    await engine.pause(sandbox_id)


@router.post("/sandboxes/{sandbox_id}/resume", status_code=201)
async def resume(sandbox_id: str, request: Request, engine: EngineDep,
                 body: Annotated[ConnectSandbox, Body(default_factory=ConnectSandbox)]) -> dict:
    await engine.resume(sandbox_id)
    if body.timeout is not None:
        engine.set_timeout(sandbox_id, body.timeout)
    return _created(request, engine, sandbox_id)


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork(sandbox_id: str, request: Request, engine: EngineDep,
               body: Annotated[ForkSandbox, Body(default_factory=ForkSandbox)]) -> list[dict]:
    """``count`` children from this instant of the sandbox (memory, files, env, cwd)."""
    children = await engine.fork(sandbox_id, 1 if body.count is None else body.count)
    if body.timeout is not None:
        for child in children:
            engine.set_timeout(child.id, body.timeout)
    return [{"sandbox": _created(request, engine, child.id)} for child in children]


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def create_snapshot(sandbox_id: str, engine: EngineDep,
                          body: Annotated[NewSnapshot, Body(default_factory=NewSnapshot)]
                          ) -> dict:
    """E2B's snapshot: with memory (E2B's default), this instant of the sandbox kept
    beyond it (engine.snapshots), which ``Sandbox.create(snapshot_id)`` forks; with
    ``memory: false`` (``mode="filesystem"``), the sandbox's files saved as an image
    (``save_image``), which a create starts fresh from."""
    if body.memory is not False:
        cp = await engine.snapshot(sandbox_id, body.name)
        return {"snapshotID": cp.snapshot, "names": [cp.snapshot]}
    name = body.name or f"snapshot-{os.urandom(6).hex()}"
    workdir = E2B_HOME if engine.info(sandbox_id)["image"] == "default" else None
    await engine.save_image(sandbox_id, name, workdir=workdir)
    return {"snapshotID": name, "names": [name]}


@router.get("/snapshots")
async def list_snapshots(
    engine: EngineDep, response: Response,
    sandbox_id: Annotated[str | None, Query(alias="sandboxID", max_length=64)] = None,
    name: Annotated[str | None, Query(max_length=255)] = None,
    next_token: Annotated[str | None, Query(alias="nextToken", max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = _PAGE,
) -> list[dict]:
    """Snapshots with memory and images saved from a sandbox (of ``sandboxID``, named
    ``name``), oldest first, a page of ``limit``; the next page's token in
    ``X-Next-Token``."""
    name = None if name is None else untagged(name)
    made = [(image["created"], image["name"], image["from_sandbox"])
            for image in engine.list_images()
            if image.get("from_sandbox") and image["kind"] == "saved"]
    made += [(cp.record.created, cp.snapshot, cp.sandbox_id) for cp in engine.snapshots()]
    found = sorted((((created, snapshot), {"snapshotID": snapshot, "names": [snapshot]})
                    for created, snapshot, source in made
                    if sandbox_id in (None, source) and name in (None, snapshot)),
                   key=lambda f: f[0])
    return _page(found, next_token, limit, response)


@router.delete("/templates/{template_id}", response_class=Response)
async def delete_snapshot(template_id: str, engine: EngineDep) -> Response:
    template_id = untagged(template_id)
    """E2B's ``delete_snapshot`` (a template delete): end a snapshot, or remove a saved
    image; 404 if there is none of that name, 409 while a sandbox or another image
    stands on the image (sandboxes started from a snapshot do not need it)."""
    if engine.is_snapshot(template_id):
        await engine.delete_snapshot(template_id)
        return Response(status_code=204)
    if not any(image["name"] == template_id and image["kind"] == "saved"
               for image in engine.list_images()):
        return e2b_error(404, f"no snapshot {template_id!r}")
    await engine.remove_image(template_id)
    return Response(status_code=204)


@router.put("/sandboxes/{sandbox_id}/network", status_code=204, response_class=Response)
async def update_network(sandbox_id: str, body: E2BNetwork, engine: EngineDep) -> None:
    lists = {k: v for k, v in (("allow_out", body.allow_out), ("deny_out", body.deny_out))
             if v is not None}
    await engine.update_network(sandbox_id, None, lists)
