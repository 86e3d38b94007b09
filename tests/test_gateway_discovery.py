"""The gateway's node discovery against a fake Kubernetes API server on loopback.

Real HTTP through lightkube: the fake serves EndpointSliceList answers as the API server
does, honours ``labelSelector`` and records every request, so a wrong path, a missing
selector or a wrong namespace fails the test rather than passing by accident.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from lightkube import KubeConfig
from lightkube.config.models import Cluster, User

from branchbox.gateway.discovery import DiscoveryError, KubernetesNodes

NS = "branchbox"
SERVICE = "branchbox-nodes"
SELECTOR = f"kubernetes.io/service-name={SERVICE}"
LIST_PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
TOKEN = "fake-service-account-token"


def endpoint(address: str, ready: bool | None) -> dict[str, Any]:
    """An endpoint as the API serves it; ``ready`` None leaves the field out (nil)."""
    conditions = {} if ready is None else {"ready": ready}
    return {"addresses": [address], "conditions": conditions, "nodeName": f"node-{address}"}


def endpoint_slice(name: str, service: str, endpoints: list[dict[str, Any]],
                   ports: list[tuple[str, int]], address_type: str = "IPv4") -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "resourceVersion": "7",
                     "labels": {"kubernetes.io/service-name": service,
                                "endpointslice.kubernetes.io/managed-by":
                                    "endpointslice-controller.k8s.io"}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
    }


def status(code: int, reason: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=code, content={
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code})


class FakeKube:
    """A Kubernetes API server that knows only EndpointSlices, run by uvicorn in a thread."""

    def __init__(self) -> None:
        self.slices: dict[str, list[dict[str, Any]]] = {}  # namespace -> its EndpointSlices
        self.answer: Response | None = None  # set: answered instead of the list
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (method, path, params)
        self.resource_version = 100
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
        async def serve(path: str, request: Request) -> Response:
            params = dict(request.query_params)
            self.requests.append((request.method, request.url.path, params))
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return status(401, "Unauthorized", "Unauthorized")
            parts = request.url.path.split("/")
            # /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices
            if (request.method != "GET" or len(parts) != 7
                    or parts[1:4] != ["apis", "discovery.k8s.io", "v1"]
                    or parts[4] != "namespaces" or parts[6] != "endpointslices"):
                return status(404, "NotFound", f"the server could not find {request.url.path}")
            if "watch" in params:
                return status(400, "BadRequest", "this fake serves lists only")
            if self.answer is not None:
                return self.answer
            selector = params.get("labelSelector")
            if selector is None or "=" not in selector:
                return status(400, "BadRequest", f"an equality labelSelector, not {selector!r}")
            wanted = dict(term.split("=", 1) for term in selector.split(","))
            items = [s for s in self.slices.get(parts[5], [])
                     if all(s["metadata"]["labels"].get(k) == v for k, v in wanted.items())]
            self.resource_version += 1
            return JSONResponse({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self.resource_version)},
                "items": items})

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(
            app, lifespan="off", ws="none", log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="fake-kube-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "fake API down"
            time.sleep(0.01)

    def list_requests(self) -> list[dict[str, str]]:
        """The params of every request, after checking that each was the expected list."""
        for method, path, _ in self.requests:
            assert (method, path) == ("GET", LIST_PATH)
        return [params for _, _, params in self.requests]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        assert not self._thread.is_alive()
        self._sock.close()


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    fake = FakeKube()
    try:
        yield fake
    finally:
        fake.stop()


def discover(kube_url: str, *calls: Any) -> list[Any]:
    """One KubernetesNodes for ``kube_url``: run each of ``calls`` (a function of nothing,
    run between ``urls()`` calls, or None for no change) then ``urls()``; the results."""

    async def run() -> list[Any]:
        config = KubeConfig.from_one(cluster=Cluster(server=kube_url), user=User(token=TOKEN))
        nodes = KubernetesNodes(SERVICE, NS, config=config)
        results: list[Any] = []
        try:
            for change in calls:
                if change is not None:
                    change()
                try:
                    results.append(await nodes.urls())
                except DiscoveryError as e:
                    results.append(e)
        finally:
            await nodes.aclose()
        return results

    return asyncio.run(run())


def test_ready_endpoints_of_all_slices_on_the_named_port(kube: FakeKube) -> None:
    kube.slices[NS] = [
        endpoint_slice("nodes-a", SERVICE, [
            endpoint("10.0.0.1", True),
            endpoint("10.0.0.2", False),  # not ready: left out
            endpoint("10.0.0.3", None),  # ready unset: "a nil value should be interpreted as true"
            {"addresses": ["10.0.0.4"]},  # no conditions at all: ready nil too
        ], [("metrics", 9090), ("http", 8321)]),
        endpoint_slice("nodes-b", SERVICE, [
            endpoint("10.0.1.1", True),
            endpoint("10.0.0.1", True),  # the same endpoint in two slices (a move): once
        ], [("http", 8321)]),
        endpoint_slice("nodes-v6", SERVICE, [endpoint("fd00::7", True)], [("http", 8321)],
                       address_type="IPv6"),
        # The Service's slice without a port named "http": nothing to route to there.
        endpoint_slice("nodes-c", SERVICE, [endpoint("10.0.2.1", True)], [("grpc", 8321)]),
        # Another Service in the same namespace, and this one in another namespace.
        endpoint_slice("others", "other-service", [endpoint("10.9.9.9", True)],
                       [("http", 8321)]),
    ]
    kube.slices["elsewhere"] = [
        endpoint_slice("nodes-x", SERVICE, [endpoint("10.8.8.8", True)], [("http", 8321)])]

    [urls] = discover(kube.url, None)

    assert urls == ["http://10.0.0.1:8321", "http://10.0.0.3:8321", "http://10.0.0.4:8321",
                    "http://10.0.1.1:8321", "http://[fd00::7]:8321"]
    [params] = kube.list_requests()
    assert params["labelSelector"] == SELECTOR


def test_nodes_added_and_removed_between_calls(kube: FakeKube) -> None:
    def nodes(*addresses: str) -> None:
        kube.slices[NS] = [endpoint_slice(
            "nodes-a", SERVICE, [endpoint(a, True) for a in addresses], [("http", 8321)])]

    results = discover(
        kube.url,
        lambda: nodes("10.0.0.1"),
        lambda: nodes("10.0.0.1", "10.0.0.2"),  # a node joins
        lambda: nodes("10.0.0.2"),  # one leaves
        lambda: kube.slices[NS].clear(),  # none left: no slices at all
    )

    assert results == [["http://10.0.0.1:8321"],
                       ["http://10.0.0.1:8321", "http://10.0.0.2:8321"],
                       ["http://10.0.0.2:8321"],
                       []]
    assert [p["labelSelector"] for p in kube.list_requests()] == [SELECTOR] * 4


def test_forbidden_says_which_rbac_permission_is_missing(kube: FakeKube) -> None:
    kube.answer = status(403, "Forbidden", (
        'endpointslices.discovery.k8s.io is forbidden: User "system:serviceaccount:branchbox:'
        'gateway" cannot list resource "endpointslices" in API group "discovery.k8s.io" in '
        'the namespace "branchbox"'))

    [error] = discover(kube.url, None)

    assert isinstance(error, DiscoveryError)
    message = str(error)
    assert "403" in message and "RBAC" in message and "endpointslices" in message
    assert "cannot list resource" in message  # the API server's own words are kept
    assert len(kube.list_requests()) == 1


def test_other_refusals_and_garbage_raise_discovery_error(kube: FakeKube) -> None:
    answers = [
        status(401, "Unauthorized", "Unauthorized"),
        status(500, "InternalError", "etcdserver: request timed out"),
        PlainTextResponse("upstream connect error", status_code=503),
        Response(b"\x00not json", status_code=200, media_type="application/json"),
    ]

    def answer(r: Response) -> Any:
        return lambda: setattr(kube, "answer", r)

    results = discover(kube.url, *(answer(r) for r in answers))

    assert all(isinstance(r, DiscoveryError) for r in results), results
    unauthorized, internal, unavailable, garbage = map(str, results)
    assert "401" in unauthorized and "credentials" in unauthorized
    assert "500" in internal and "etcdserver" in internal
    assert "503" in unavailable and "upstream connect error" in unavailable
    assert "not an EndpointSliceList" in garbage


def test_unreachable_api_raises_discovery_error() -> None:
    with socket.socket() as probe:  # a loopback port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"

    [error] = discover(url, None)

    assert isinstance(error, DiscoveryError)
    assert "cannot reach the Kubernetes API" in str(error) and url in str(error)


def test_no_configuration_raises_discovery_error(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists():
        pytest.skip("running inside a Kubernetes pod: the in-cluster configuration is there")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))

    with pytest.raises(DiscoveryError, match="no Kubernetes configuration"):
        KubernetesNodes(SERVICE, NS)
