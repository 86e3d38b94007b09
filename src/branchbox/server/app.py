"""The REST application: routes that translate HTTP to engine calls, and nothing else.

The engine is started and stopped by the application's lifespan, so a server
that shuts down gracefully (SIGINT, SIGTERM) closes every sandbox it ran.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.responses import PlainTextResponse

from branchbox.engine.sandboxes import Engine
from branchbox.server import (
    call_channel,
    e2b_control,
    e2b_envd,
    e2b_interpreter,
    events,
    execution,
    files,
    images,
    instants,
    node,
    ports,
    sandboxes,
    snapshots,
)
from branchbox.server.deps import require_api_key
from branchbox.server.disconnect import DisconnectWatch
from branchbox.server.e2b_access import require_e2b_key
from branchbox.server.e2b_ports import SandboxPorts
from branchbox.server.errors import install_error_handlers
from branchbox.server.limits import BodyLimit
from branchbox.server.replay import EventLog
from branchbox.server.sandbox_json import SandboxJSON
from branchbox.server.stopping import StopGate, StopSignal
from branchbox.server.ui import routes as ui

DEFAULT_MAX_UPLOAD = 1 << 30
# Any body but a file upload is parsed whole in memory, so it has its own, smaller limit
# (Podflare's SDK uploads by embedding base64 in code: this allows ~48 MB files that way).
MAX_JSON_BODY = 64 << 20


def create_app(engine: Engine, *, api_keys: Iterable[str] = (),
               max_upload: int = DEFAULT_MAX_UPLOAD) -> FastAPI:
    """The API over ``engine``.

    With ``api_keys``, every endpoint but ``/v1/healthz`` wants ``Authorization:
    Bearer <key>``. Uploads larger than ``max_upload`` bytes, and other bodies larger than
    ``MAX_JSON_BODY``, are refused (413).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            client = getattr(app.state, "port_client", None)  # the port proxy's pool
            if client is not None:
                await client.aclose()
            app.state.stop_signal.begin()
            await engine.stop()

    app = FastAPI(title="branchbox", version="0.1.0", lifespan=lifespan,
                  default_response_class=SandboxJSON,
                  description="Linux sandboxes with a persistent Python REPL that fork.")
    app.state.engine = engine
    app.state.api_keys = frozenset(api_keys)
    app.state.max_upload = max_upload
    app.state.events = EventLog()
    app.add_middleware(BodyLimit, limit=MAX_JSON_BODY)
    app.add_middleware(DisconnectWatch)  # calls of clients that hung up never run
    app.state.stop_signal = StopSignal()  # serve() begins it at SIGTERM / SIGINT
    app.add_middleware(StopGate, signal=app.state.stop_signal)  # then calls get 503

    @app.get("/v1/healthz", response_class=PlainTextResponse, tags=["server"])
    async def healthz() -> str:
        """``ok`` once the engine has started (open to all, even with API keys)."""
        return "ok"

    for module in (sandboxes, execution, files, images, snapshots, ports, events, node):
        app.include_router(module.router, dependencies=[Depends(require_api_key)])
    app.include_router(instants.router, dependencies=[Depends(require_api_key)])
    app.include_router(ports.ws_router)  # checks the same key itself
    app.include_router(call_channel.router)  # likewise
    app.include_router(ui.router)  # the page checks the key itself (a refusal is HTML)
    # E2B's SDKs: its control plane with X-API-Key; its sandbox plane with the per-sandbox
    # token the control plane hands out (checked per request, see e2b_access).
    app.include_router(e2b_control.router, dependencies=[Depends(require_e2b_key)])
    app.include_router(e2b_envd.router)
    app.include_router(e2b_interpreter.router)
    app.add_middleware(SandboxPorts)  # E2B-addressed requests for a sandbox's own ports
    install_error_handlers(app)  # last: its middleware is the outermost
    return app
