"""deploy/kubernetes checked against the Kubernetes API's schemas, and against itself.

Nothing in this repository applies the manifests to a cluster, so a misspelt field, a
Service that selects no pod or a secretKeyRef to a key that does not exist would only show
on an operator's cluster. Here every resource is validated with kubernetes-validate in
strict mode (unknown fields fail, as `kubectl apply --validate=strict` would), against
the oldest and the newest Kubernetes release we validate for, and the references between
the resources are followed by hand: the schemas cannot see those.

kubernetes-validate and PyYAML come with the `test` extra. If either is missing the tests
fail and say so: a skip would pass CI with the manifests unchecked.
"""

from __future__ import annotations

import copy
import importlib
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"

# The oldest release the manifests are meant for, and the newest that the installed
# kubernetes-validate (>= 1.37, see pyproject.toml) bundles schemas for. Pinned rather
# than "latest": a new kubernetes-validate release should not change what passes here.
KUBERNETES_VERSIONS = ("1.30", "1.37")

HEALTH_PATH = "/v1/healthz"
SECRET = "branchbox-keys"
NODE_SERVICE = "branchbox-nodes"

Resource = dict[str, Any]


def _require(module: str, package: str) -> ModuleType:
    """Import ``module`` or fail the test, saying which package is missing (never skip)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{package} is not installed ({exc}); it validates deploy/kubernetes. "
                    "Install the test extra: .venv/bin/pip install -e '.[test]'", pytrace=False)


@pytest.fixture(scope="module")
def kustomization() -> Resource:
    yaml = _require("yaml", "PyYAML")
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def resources(kustomization: Resource) -> list[tuple[str, Resource]]:
    """Every document of every file kustomization.yaml lists, as (file name, resource)."""
    yaml = _require("yaml", "PyYAML")
    out = []
    for name in kustomization["resources"]:
        docs = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]
        assert docs, f"{name} holds no resource"
        out += [(name, doc) for doc in docs]
    return out


def _one(resources: list[tuple[str, Resource]], kind: str, name: str) -> Resource:
    found = [r for _, r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def _pod_spec(workload: Resource) -> Resource:
    return workload["spec"]["template"]["spec"]


def _argv(container: Resource) -> list[str]:
    """What the container runs: the command (the image's entrypoint if none) and args."""
    return [*container.get("command", ["branchbox"]), *container.get("args", [])]


def _option(argv: list[str], flag: str) -> str:
    """The value after ``flag`` in ``argv``."""
    assert flag in argv, f"{flag} missing from {argv}"
    index = argv.index(flag)
    assert index + 1 < len(argv), f"{flag} has no value in {argv}"
    return argv[index + 1]


def _env(container: Resource, name: str) -> Resource:
    found = [e for e in container.get("env", []) if e["name"] == name]
    assert len(found) == 1, f"container {container['name']}: env {name} defined {len(found)}x"
    return found[0]


def _port(container: Resource, name: str) -> int:
    found = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == name]
    assert len(found) == 1, f"container {container['name']} has no port named {name!r}"
    return found[0]


# -- the files and the schemas ------------------------------------------------------------


def test_kustomization_lists_every_file(kustomization: Resource) -> None:
    """A manifest left out of kustomization.yaml is never applied (nor validated here)."""
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed)), f"a file is listed twice: {listed}"
    present = {p.name for p in DEPLOY.glob("*.y*ml")} - {"kustomization.yaml"}
    assert set(listed) == present, (
        f"kustomization.yaml lists {sorted(listed)} but deploy/kubernetes holds "
        f"{sorted(present)}")
    assert kustomization["namespace"] == "branchbox"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_resource_is_valid(resources: list[tuple[str, Resource]], version: str) -> None:
    """Each resource against that release's schema, strictly: unknown fields fail."""
    kubernetes_validate = _require("kubernetes_validate", "kubernetes-validate")
    errors = []
    for name, resource in resources:
        what = f"{name}: {resource.get('kind')}/{resource.get('metadata', {}).get('name')}"
        try:
            validated = kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{what}: {path}: {exc.message}")
            continue
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{what}: {exc.message}")
            continue
        # The library falls back to an older bundled release without saying so.
        assert validated == version, f"{what} was validated against {validated}, not {version}"
    assert not errors, "\n".join(errors)


def test_validator_rejects_a_broken_manifest(resources: list[tuple[str, Resource]]) -> None:
    """The check above can fail: a misspelt field and a wrongly typed one are refused."""
    kubernetes_validate = _require("kubernetes_validate", "kubernetes-validate")
    daemonset = _one(resources, "DaemonSet", "branchbox-node")
    version = KUBERNETES_VERSIONS[-1]

    misspelt = copy.deepcopy(daemonset)
    container = _pod_spec(misspelt)["containers"][0]
    container["securityContext"]["priviliged"] = container["securityContext"].pop("privileged")
    with pytest.raises(kubernetes_validate.ValidationError, match="priviliged"):
        kubernetes_validate.validate(misspelt, version, strict=True)

    mistyped = copy.deepcopy(daemonset)
    _pod_spec(mistyped)["containers"][0]["ports"][0]["containerPort"] = "8787"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(mistyped, version, strict=True)

    kubernetes_validate.validate(daemonset, version, strict=True)  # the original passes


# -- references between resources --------------------------------------------------------


def test_gateway_identity_may_read_endpointslices(resources: list[tuple[str, Resource]]) -> None:
    """The gateway runs as a ServiceAccount that exists and is bound to a Role that lets it
    list and watch EndpointSlices: without that it finds no node at all."""
    gateway = _one(resources, "Deployment", "branchbox-gateway")
    account = _pod_spec(gateway)["serviceAccountName"]
    _one(resources, "ServiceAccount", account)
    assert _pod_spec(gateway).get("automountServiceAccountToken", True), "needs its token"

    bindings = [(r, s) for _, r in resources if r["kind"] == "RoleBinding"
                for s in r["subjects"] if (s["kind"], s["name"]) == ("ServiceAccount", account)]
    assert len(bindings) == 1, f"expected one RoleBinding for ServiceAccount {account}"
    binding, subject = bindings[0]
    # No namespace: kustomize fills in its own; one written here it would leave stale.
    assert "namespace" not in subject
    assert binding["roleRef"]["kind"] == "Role"
    role = _one(resources, "Role", binding["roleRef"]["name"])
    granted = [rule for rule in role["rules"] if "discovery.k8s.io" in rule["apiGroups"]
               and "endpointslices" in rule["resources"]]
    assert granted, "the Role grants nothing on discovery.k8s.io endpointslices"
    assert {"get", "list", "watch"} <= set(granted[0]["verbs"])
    verbs = {verb for rule in role["rules"] for verb in rule["verbs"]}
    assert verbs <= {"get", "list", "watch"}, f"the gateway only reads, yet may {verbs}"


def test_services_select_their_pods(resources: list[tuple[str, Resource]]) -> None:
    """branchbox-nodes is headless and selects the DaemonSet's pods (their EndpointSlices
    are how the gateway finds nodes); branchbox-gateway selects the gateway's pods only."""
    daemonset = _one(resources, "DaemonSet", "branchbox-node")
    gateway = _one(resources, "Deployment", "branchbox-gateway")
    workloads = {"node": daemonset, "gateway": gateway}
    for workload in workloads.values():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()

    for service_name, own, port in ((NODE_SERVICE, "node", 8787),
                                     ("branchbox-gateway", "gateway", 8080)):
        service = _one(resources, "Service", service_name)
        selector = service["spec"]["selector"]
        for role, workload in workloads.items():
            labels = workload["spec"]["template"]["metadata"]["labels"]
            selects = selector.items() <= labels.items()
            assert selects == (role == own), (
                f"Service {service_name} {'does not select' if role == own else 'selects'} "
                f"the {role} pods")
        [service_port] = service["spec"]["ports"]
        assert (service_port["name"], service_port["port"]) == ("http", port)
        container = _pod_spec(workloads[own])["containers"][0]
        assert _port(container, service_port["targetPort"]) == port

    assert _one(resources, "Service", NODE_SERVICE)["spec"]["clusterIP"] == "None"


def test_secret_key_refs_exist(resources: list[tuple[str, Resource]]) -> None:
    """Every secretKeyRef names a key the Secret has: a missing one keeps the pod from
    starting (CreateContainerConfigError), only once it is applied."""
    secret = _one(resources, "Secret", SECRET)
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    assert keys == {"node-key", "api-key"}
    refs = []
    for _, resource in resources:
        if resource["kind"] not in ("DaemonSet", "Deployment"):
            continue
        for container in _pod_spec(resource)["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.append((ref["name"], ref["key"]))
                    assert ref["name"] == SECRET and ref["key"] in keys, (
                        f"{container['name']}: {env['name']} refers to {ref}")
                    assert not ref.get("optional"), "a missing key must not go unnoticed"
    # The node trusts only the gateway's key; the gateway holds both.
    assert refs.count((SECRET, "node-key")) == 2 and refs.count((SECRET, "api-key")) == 1
    daemon = _pod_spec(_one(resources, "DaemonSet", "branchbox-node"))["containers"][0]
    key = _env(daemon, "BRANCHBOX_API_KEY")["valueFrom"]["secretKeyRef"]["key"]
    assert key == "node-key"


def test_probes_hit_healthz(resources: list[tuple[str, Resource]]) -> None:
    """Every probe asks /v1/healthz (the one endpoint open without a key) on the port the
    container serves: a probe with a key-protected path would get 401 and never pass."""
    for _, resource in resources:
        if resource["kind"] not in ("DaemonSet", "Deployment"):
            continue
        for container in _pod_spec(resource)["containers"]:
            probes = {k: v for k, v in container.items() if k.endswith("Probe")}
            assert {"readinessProbe", "livenessProbe"} <= probes.keys(), container["name"]
            for kind, probe in probes.items():
                http = probe["httpGet"]
                assert http["path"] == HEALTH_PATH, f"{container['name']} {kind}"
                port = http["port"]
                if isinstance(port, str):
                    port = _port(container, port)
                assert port == int(_option(_argv(container), "--port")), container["name"]


def test_commands(resources: list[tuple[str, Resource]]) -> None:
    """The node runs `serve` with --node from the downward API and --keep; the gateway runs
    `gateway --kubernetes branchbox-nodes` in its own namespace. Every $(VAR) in an argv is
    defined: Kubernetes passes an undefined one on verbatim, silently."""
    daemonset = _one(resources, "DaemonSet", "branchbox-node")
    gateway = _one(resources, "Deployment", "branchbox-gateway")
    for workload in (daemonset, gateway):
        for container in _pod_spec(workload)["containers"]:
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(_argv(container))):
                _env(container, var)

    [node] = _pod_spec(daemonset)["containers"]
    argv = _argv(node)
    assert argv[:2] == ["branchbox", "serve"], argv
    assert "--keep" in argv
    assert _option(argv, "--node") == "$(NODE_NAME)"
    assert _env(node, "NODE_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert int(_option(argv, "--port")) == _port(node, "http") == 8787
    assert _option(argv, "--host") == "0.0.0.0"
    data_dir = _option(argv, "--data-dir")
    mounts = {m["mountPath"]: m["name"] for m in node["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod_spec(daemonset)["volumes"]}
    assert volumes[mounts[data_dir]]["hostPath"] == {"path": data_dir,
                                                     "type": "DirectoryOrCreate"}

    [front] = _pod_spec(gateway)["containers"]
    argv = _argv(front)
    assert argv[:2] == ["branchbox", "gateway"], argv
    assert _option(argv, "--kubernetes") == NODE_SERVICE
    _one(resources, "Service", NODE_SERVICE)
    assert _option(argv, "--namespace") == "$(POD_NAMESPACE)"
    assert _env(front, "POD_NAMESPACE")["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.namespace")
    assert int(_option(argv, "--port")) == _port(front, "http") == 8080


def test_privileges(resources: list[tuple[str, Resource]]) -> None:
    """The node daemon is privileged with the node's store, cgroups and devices, and no
    more (no host PID or network namespace); the gateway has no privilege at all."""
    daemonset = _one(resources, "DaemonSet", "branchbox-node")
    pod = _pod_spec(daemonset)
    [node] = pod["containers"]
    assert node["securityContext"]["privileged"] is True
    assert pod["hostPID"] is False and not pod.get("hostNetwork") and not pod.get("hostIPC")
    assert pod["terminationGracePeriodSeconds"] >= 60
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {"/var/lib/branchbox", "/var/cache/branchbox", "/sys/fs/cgroup",
                          "/dev"}
    mounted = {m["name"] for m in node["volumeMounts"]}
    assert mounted == {v["name"] for v in pod["volumes"]}, "a volume is not mounted"

    gateway = _pod_spec(_one(resources, "Deployment", "branchbox-gateway"))
    assert _one(resources, "Deployment", "branchbox-gateway")["spec"]["replicas"] == 2
    assert not any(gateway.get(k) for k in ("hostPID", "hostNetwork", "hostIPC"))
    assert not any("hostPath" in v for v in gateway.get("volumes", []))
    [front] = gateway["containers"]
    context = front["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] != 0  # the image's own user is root
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert not context.get("privileged")


def test_image_can_be_overridden(kustomization: Resource,
                                 resources: list[tuple[str, Resource]]) -> None:
    """Both workloads use the image that kustomization.yaml's `images:` entry names, so
    one `kustomize edit set image` moves both."""
    [entry] = kustomization["images"]
    for _, resource in resources:
        if resource["kind"] in ("DaemonSet", "Deployment"):
            for container in _pod_spec(resource)["containers"]:
                name, _, tag = container["image"].rpartition(":")
                assert (name, tag) == (entry["name"], entry["newTag"]), container["image"]
