"""Which node daemons exist, asked of Kubernetes each time.

The gateway keeps no state of its own (DESIGN.md, "Beyond one machine"): any replica must
route any request, and nodes come and go with the DaemonSet. So the list of node daemons is
not configured or remembered here but read from the Kubernetes API: the daemons are the ready
endpoints of a headless Service, which the EndpointSlice controller keeps current in that
Service's EndpointSlices (API group discovery.k8s.io/v1, label
``kubernetes.io/service-name=<service>``).

One list call per ``urls()`` (the gateway polls every few seconds; a selector-filtered list
of a few slices is cheap for the API server) keeps this module free of a background watch
whose staleness or death would have to be handled too.
"""

from __future__ import annotations

import ipaddress

import httpx2
from lightkube import ApiError, AsyncClient, ConfigError, KubeConfig, SingleConfig
from lightkube.resources.discovery_v1 import EndpointSlice

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


class DiscoveryError(Exception):
    """The node daemons could not be found through the Kubernetes API (the message says why)."""


class KubernetesNodes:
    """The node daemons' URLs: the ready endpoints of a headless Service, from its
    EndpointSlices."""

    def __init__(self, service: str, namespace: str, *, port_name: str = "http",
                 config: KubeConfig | SingleConfig | None = None) -> None:
        """``config`` None: lightkube's own loading (in-cluster service account token and CA,
        else the file ``$KUBECONFIG``, else ``~/.kube/config``). Raises DiscoveryError when
        there is no usable configuration."""
        self.service = service
        self.namespace = namespace
        self.port_name = port_name
        self._where = f"Service {namespace}/{service}"
        try:
            self._client = AsyncClient(config=config, namespace=namespace)
        except (ConfigError, KeyError, OSError, ValueError, AssertionError) as e:
            # KeyError: a service account is mounted but KUBERNETES_SERVICE_HOST/PORT unset;
            # AssertionError: lightkube asserts that the context names a user.
            raise DiscoveryError(
                f"no Kubernetes configuration to find the node daemons of {self._where}: "
                f"not in a cluster (no service account token) and no usable kubeconfig "
                f"($KUBECONFIG or ~/.kube/config): {type(e).__name__}: {e}") from e
        self._server = self._client.config.cluster.server

    async def urls(self) -> list[str]:
        """Sorted, deduplicated "http://ADDR:PORT" of every endpoint whose conditions.ready is
        not False (the API: "a nil value should be interpreted as true"), over all the
        Service's EndpointSlices, on the port named ``port_name`` (IPv6 addresses in brackets).
        Raises DiscoveryError when the API cannot be asked or refuses."""
        slices = await self._list_slices()
        found: set[str] = set()
        for eps in slices:
            port = next((p.port for p in eps.ports or ()
                         if (p.name or "") == self.port_name and p.port is not None), None)
            if port is None:
                continue
            for endpoint in eps.endpoints or ():
                if endpoint.conditions is not None and endpoint.conditions.ready is False:
                    continue
                for address in endpoint.addresses or ():
                    found.add(f"http://{_host(address)}:{port}")
        return sorted(found)

    async def _list_slices(self) -> list[EndpointSlice]:
        what = f"listing the EndpointSlices of {self._where} at {self._server}"
        try:
            return [eps async for eps in self._client.list(
                EndpointSlice, namespace=self.namespace,
                labels={SERVICE_NAME_LABEL: self.service})]
        except ApiError as e:
            status = e.status
            code, reason, message = status.code, status.reason, status.message
            if code == 403:
                raise DiscoveryError(
                    f"{what}: forbidden (403 {reason}): {message}. The gateway's service "
                    f"account needs RBAC permission to list and watch endpointslices "
                    f"(apiGroups: discovery.k8s.io) in namespace {self.namespace}: a Role "
                    f"with that rule and a RoleBinding to the account.") from e
            if code == 401:
                raise DiscoveryError(
                    f"{what}: unauthorized (401): the API server rejected the credentials "
                    f"(token expired or wrong kubeconfig user): {message}") from e
            raise DiscoveryError(f"{what}: the API refused ({code} {reason}): {message}") from e
        except httpx2.HTTPStatusError as e:  # an error answer that is not a Kubernetes Status
            r = e.response
            raise DiscoveryError(
                f"{what}: the API refused ({r.status_code}): {r.text[:200]!r}") from e
        except httpx2.HTTPError as e:
            raise DiscoveryError(
                f"{what}: cannot reach the Kubernetes API: {type(e).__name__}: {e}") from e
        except KeyError as e:
            # lightkube reads the Content-Type header of every error answer; none there.
            raise DiscoveryError(f"{what}: an error answer without a Content-Type") from e
        except ValueError as e:  # msgspec.DecodeError, or a JSON error answer that is not JSON
            raise DiscoveryError(
                f"{what}: the answer is not an EndpointSliceList (nor a Status): {e}") from e

    async def aclose(self) -> None:
        await self._client.aclose()


def _host(address: str) -> str:
    """``address`` as the host of a URL: an IPv6 address in brackets, others as they are."""
    try:
        if ipaddress.ip_address(address).version == 6:
            return f"[{address}]"
    except ValueError:  # addressType FQDN (deprecated): a host name
        pass
    return address
