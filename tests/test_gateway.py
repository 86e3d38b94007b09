"""``branchbox gateway`` in front of three daemons standing in for three nodes.

Each daemon has its own data directory and loopback port, and the cluster's internal
node key as its only key; two gateway replicas (real ``branchbox gateway`` processes,
a static node list) take the clients' key. Everything goes through the published
clients unchanged: our SDK, Podflare's, E2B's, and a raw calls WebSocket.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import podflare
import pytest
from e2b_sdk import sdk_python
from served import ServedDaemon, env_with_key
from waiting import eventually
from websockets.sync.client import connect

from branchbox import NodeUnavailable, Sandbox, SandboxNotFound
from branchbox.bench.daemon import Gateway
from branchbox.engine.node import TAG_FILE

NODE_KEY = "gw-test-node-key"
USER_KEY = "gw-test-user-key"
USER = {"Authorization": f"Bearer {USER_KEY}"}


def raw_get(base: str, path: str) -> bytes:
    """The start of the answer to ``GET path`` sent byte for byte, with the client key."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
                     f"{USER_KEY}\r\nConnection: close\r\n\r\n".encode())
        return sock.recv(4096)


@dataclass
class Cluster:
    nodes: list[ServedDaemon]
    gateways: list[Gateway]

    def up(self, gateway: int) -> list[dict]:
        """The nodes gateway ``gateway`` sees up."""
        return [n for n in httpx.get(f"{self.gateways[gateway].url}/v1/nodes", headers=USER,
                                     timeout=10).json()["nodes"] if n["up"]]
    tags: dict[str, int]  # node tag -> index in nodes

    def node_of(self, sandbox_id: str) -> int:
        return self.tags[sandbox_id[4:12]]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    nodes: list[ServedDaemon] = []
    gateways: list[Gateway] = []
    try:
        for index in range(3):
            nodes.append(ServedDaemon(f"gw-n{index}", env_with_key(NODE_KEY),
                                      "--node", f"node-{index}"))
        gateways = [Gateway([n.url for n in nodes], USER_KEY, NODE_KEY) for _ in range(2)]
        cluster = Cluster(nodes, gateways, {})
        assert eventually(lambda: len(cluster.up(0)) == len(cluster.up(1)) == 3, within=30)
        cluster.tags = {n["tag"]: int(n["name"].removeprefix("node-")) for n in cluster.up(0)}
        yield cluster
    finally:
        for gateway in gateways:
            gateway.stop()
        for node in nodes:
            node.stop()


def test_creates_spread_and_calls_reach_their_node(cluster: Cluster, tmp_path: Path) -> None:
    """30 creates through both replicas land on all three nodes; then every kind of call,
    through the other replica, reaches the node that holds the sandbox."""
    one, other = (g.url for g in cluster.gateways)

    def create(index: int) -> Sandbox:
        return Sandbox(url=(one, other)[index % 2], api_key=USER_KEY)

    with ThreadPoolExecutor(6) as pool:
        made = list(pool.map(create, range(30)))
    try:
        spread = Counter(cluster.node_of(sb.id) for sb in made)
        assert set(spread) == {0, 1, 2} and min(spread.values()) >= 5, spread
        for index, node in enumerate(cluster.nodes):  # the node holds it, no other does
            sb = next(s for s in made if cluster.node_of(s.id) == index)
            for other_node in cluster.nodes:
                with other_node.client(NODE_KEY) as http:
                    found = http.get(f"/v1/sandboxes/{sb.id}").status_code
                assert found == (200 if other_node is node else 404)
        workspace = tmp_path / "ws"
        workspace.mkdir()
        workspace.chmod(0o777)
        with Sandbox(url=one, api_key=USER_KEY, workspace=str(workspace)) as sb, \
                Sandbox.connect(sb.id, url=other, api_key=USER_KEY) as again:
            assert again.run_code("import socket; socket.gethostname()").text == repr(sb.id)
            again.run_code("value = 'parent'")
            kids = again.fork(2)
            assert {cluster.node_of(k.id) for k in kids} == {cluster.node_of(sb.id)}
            assert kids[0].run_code("value").text == "'parent'"
            kids[1].run_code("value = 'winner'")
            kids[1].files.write(f"{workspace}/made.txt", "from a branch")
            kids[1].files.write("/root/branch.txt", "only here")
            assert kids[0].diff(kids[1], paths=["/root"])["added"] == ["/root/branch.txt"]
            again.merge_into(kids[1])
            assert again.run_code("value").text == "'winner'"
            assert again.files.read(f"{workspace}/made.txt") == b"from a branch"
            again.commit()
            assert (workspace / "made.txt").read_text() == "from a branch"
            kids[0].close()
    finally:
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda sb: sb.close(), made))


def test_keys_the_gateway_takes_and_the_nodes_take(cluster: Cluster) -> None:
    """Clients show the gateway their key; nodes take only the internal node key."""
    gateway, node = cluster.gateways[0].url, cluster.nodes[0].url
    assert httpx.get(f"{gateway}/v1/sandboxes").status_code == 401
    refused = httpx.get(f"{gateway}/v1/sandboxes",
                        headers={"Authorization": f"Bearer {NODE_KEY}"})
    assert refused.status_code == 401 and refused.json()["type"] == "AuthError"
    assert httpx.get(f"{node}/v1/sandboxes", headers=USER).status_code == 401
    assert httpx.get(f"{gateway}/v1/sandboxes", headers=USER).status_code == 200
    # A browser's cookie need not be ASCII: passed on as bytes, not a 500.
    assert httpx.get(f"{gateway}/v1/sandboxes", headers={
        **USER, "Cookie": "name=caf\u00e9".encode()}).status_code == 200
    with pytest.raises(Exception, match="403|1008"), connect(
            gateway.replace("http", "ws") + "/v1/calls",
            additional_headers={"Authorization": "Bearer wrong"}) as ws:
        ws.recv(timeout=10)
    made = httpx.post(f"{gateway}/v2/sandboxes", json={"templateID": "base"},
                      headers={"X-API-Key": USER_KEY}, timeout=120)
    assert made.status_code == 201, made.text
    sandbox_id, token = made.json()["sandboxID"], made.json()["envdAccessToken"]
    try:  # E2B's sandbox plane: the sandbox's token, checked before anything is passed on
        host = {"Host": f"49983-{sandbox_id}.sandboxes.example"}
        assert httpx.get(f"{gateway}/health", headers={**host, "X-Access-Token": token}
                         ).status_code == 204
        for refused in (httpx.get(f"{gateway}/health", headers=host),
                        httpx.get(f"{gateway}/health",
                                  headers={**host, "X-Access-Token": "0" * 64}),
                        httpx.get(f"{gateway}/v1/sandboxes/{sandbox_id}")):
            assert refused.status_code == 401 and refused.json() == {
                "error": "invalid api key", "type": "AuthError"}  # no node named to strangers
        odd_port = httpx.get(f"{gateway}/health", headers={  # a port of "²" (latin-1)
            "E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": b"\xb2", "X-Access-Token": token})
        assert odd_port.status_code == 204  # not a port: the sandbox's own envd answers
        mixed = httpx.get(f"{gateway}/v1/sandboxes/{sandbox_id}",
                          headers={**USER, "E2b-Sandbox-Id": "sbx_" + "ab" * 16})
        assert mixed.status_code == 400 and "headers" in mixed.json()["error"]
        # Sent as is (httpx would resolve the dots): routed by its first id, the node
        # would serve the second.
        dotted = raw_get(gateway, f"/v1/sandboxes/sbx_{'ab' * 16}/../{sandbox_id}")
        assert dotted.startswith(b"HTTP/1.1 400"), dotted
    finally:
        assert httpx.delete(f"{gateway}/sandboxes/{sandbox_id}",
                            headers={"X-API-Key": USER_KEY}).status_code == 204


def test_one_calls_connection_serves_sandboxes_on_every_node(cluster: Cluster) -> None:
    """The SDK's calls WebSocket carries runs for sandboxes on three nodes at once; an id
    no node has, or a bad message, is answered as a daemon answers them."""
    gateway = cluster.gateways[1].url
    per_node: dict[int, Sandbox] = {}
    made = []
    try:
        while len(per_node) < 3:
            sb = Sandbox(url=gateway, api_key=USER_KEY)
            made.append(sb)
            per_node.setdefault(cluster.node_of(sb.id), sb)
        with connect(gateway.replace("http", "ws") + "/v1/calls",
                     additional_headers=USER) as ws:
            for run, sb in enumerate(per_node.values()):
                ws.send(json.dumps({"id": run, "op": "run_code", "sandbox": sb.id,
                                    "body": {"code": "import time; time.sleep(0.3); 6 * 7"}}))
            ws.send(json.dumps({"id": 7, "op": "run_code", "sandbox": "sbx_" + "ab" * 16,
                                "body": {"code": "1"}}))
            finals: dict[int, dict] = {}
            while len(finals) < 4:
                message = json.loads(ws.recv(timeout=60))
                if message["line"]["type"] in ("result", "error"):
                    finals[message["id"]] = message["line"]
            assert finals[7]["status"] == 404 and finals[7]["kind"] == "SandboxNotFound"
            for run in range(3):
                assert finals[run]["type"] == "result", finals[run]
        sb = per_node[0]  # E2B's key header on the connection; a run id still going
        with connect(gateway.replace("http", "ws") + "/v1/calls",
                     additional_headers={"X-API-Key": USER_KEY}) as ws:
            slow = {"code": "import time; time.sleep(1); 'slow'"}
            for _ in range(2):
                ws.send(json.dumps({"id": 1, "op": "run_code", "sandbox": sb.id, "body": slow}))
            first = json.loads(ws.recv(timeout=30))
            assert first["id"] == 1 and first["line"]["status"] == 400, first
            while (line := json.loads(ws.recv(timeout=30))["line"])["type"] != "result":
                pass
            assert line["text"] == "'slow'"
        with connect(gateway.replace("http", "ws") + "/v1/calls",
                     additional_headers=USER) as ws:
            ws.send("not json")
            with pytest.raises(Exception, match="1007"):
                ws.recv(timeout=10)
    finally:
        for sb in made:
            sb.close()


def test_listings_and_events_are_every_nodes(cluster: Cluster) -> None:
    gateway = cluster.gateways[0].url
    seen: list[dict] = []
    streaming = threading.Event()

    def listen() -> None:
        with httpx.stream("GET", f"{gateway}/v1/events", headers=USER,
                          timeout=httpx.Timeout(60, read=60)) as reply:
            streaming.set()
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    if len({e.get("node") for e in seen if e.get("type") == "create"}) == 3:
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    assert streaming.wait(30)
    made = []
    try:
        while len({cluster.node_of(sb.id) for sb in made}) < 3:
            made.append(Sandbox(url=gateway, api_key=USER_KEY))
        listed = httpx.get(f"{gateway}/v1/sandboxes", headers=USER).json()["sandboxes"]
        assert {sb.id for sb in made} <= {s["id"] for s in listed}
        e2b = httpx.get(f"{gateway}/v2/sandboxes", params={"limit": 2},
                        headers={"X-API-Key": USER_KEY})
        assert e2b.status_code == 200 and len(e2b.json()) == 2
        rest = httpx.get(f"{gateway}/v2/sandboxes", headers={"X-API-Key": USER_KEY},
                         params={"limit": 1000, "nextToken": e2b.headers["X-Next-Token"]})
        ids = [s["sandboxID"] for s in e2b.json() + rest.json()]
        assert len(ids) == len(set(ids)) and {sb.id for sb in made} <= set(ids)
        listener.join(30)
        created = {e["node"] for e in seen if e.get("type") == "create"}
        assert created == {"node-0", "node-1", "node-2"}, seen
        assert not any("id" in e for e in seen)  # node-local ids are left out
    finally:
        for sb in made:
            sb.close()


def test_podflare_and_e2b_clients_through_the_gateway(cluster: Cluster) -> None:
    gateway = cluster.gateways[1].url
    try:
        with podflare.Sandbox(host=gateway, api_key=USER_KEY) as sb:
            sb.run_code("value = 'parent'")
            children = sb.fork(n=2)
            children[1].run_code("value = 'child'")
            sb.merge_into(children[1])
            assert sb.run_code("print(value)").stdout == "child"
            children[0].close()
    finally:
        podflare.close_default_client()
    script = """
        import json
        from e2b_code_interpreter import Sandbox
        with Sandbox.create() as sbx:
            sbx.run_code("x = 20")
            text = sbx.run_code("x + 1").text
            sbx.files.write("/home/user/a.txt", "through the gateway")
            read = sbx.files.read("/home/user/a.txt")
            out = sbx.commands.run("echo $((6 * 7))").stdout
            print(json.dumps({"id": sbx.sandbox_id, "text": text, "read": read, "out": out}))
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_URL=gateway, E2B_SANDBOX_URL=gateway, E2B_API_KEY=USER_KEY)
    done = subprocess.run([str(sdk_python()), "-c", __import__("textwrap").dedent(script)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["text"] == "21" and out["read"] == "through the gateway"
    assert out["out"] == "42\n" and out["id"][4:12] in cluster.tags


def test_a_node_down_and_back(cluster: Cluster) -> None:
    """A node killed: its sandboxes are unavailable, the others serve on, creates go to
    the nodes that are up; restarted on its data directory, its sandboxes come back."""
    gateway = cluster.gateways[0].url
    made = []
    while {cluster.node_of(sb.id) for sb in made} != {0, 1, 2}:
        made.append(Sandbox(url=gateway, api_key=USER_KEY))
    victim = next(sb for sb in made if cluster.node_of(sb.id) == 2)
    victim.run_code("kept = 'state'")
    survivors = [sb for sb in made if cluster.node_of(sb.id) != 2]
    node = cluster.nodes[2]
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(victim.run_code, "print('go', flush=True); import time; "
                              "time.sleep(5)", on_stdout=lambda _: started.set())
        assert started.wait(30)
        node.proc.kill()  # as a crash: its sandboxes run on, the restart re-attaches them
        node.proc.wait()
        with pytest.raises(NodeUnavailable, match="lost"):  # a run in flight ends at once
            running.result(timeout=30)
    try:
        with pytest.raises(NodeUnavailable, match="node-2"):
            victim.run_code("kept")
        for sb in survivors:
            assert sb.run_code("1 + 1").text == "2"
        listed = httpx.get(f"{gateway}/v1/sandboxes", headers=USER)
        assert listed.headers["X-Branchbox-Unavailable"] == "node-2"
        fresh = [Sandbox(url=gateway, api_key=USER_KEY) for _ in range(4)]
        assert {cluster.node_of(sb.id) for sb in fresh} <= {0, 1}
        for sb in fresh:
            sb.close()
        with pytest.raises(SandboxNotFound):
            Sandbox.connect("sbx_" + "0" * 32, url=gateway, api_key=USER_KEY)
    finally:
        cluster.nodes[2] = ServedDaemon("gw-n2", env_with_key(NODE_KEY), "--node", "node-2",
                                        data_dir=node.data_dir, port=node.port)
    assert eventually(lambda: len(cluster.up(0)) == 3, within=30)
    assert victim.run_code("kept").text == "'state'"
    for sb in made:
        sb.close()


def test_one_daemon_at_two_addresses_and_a_copied_store(cluster: Cluster) -> None:
    """A node listed twice (a dual-stack Service) is one node. A daemon started on a copy
    of a node's data directory carries that node's tag: which of the two holds a
    sandbox with that tag cannot be told, so the gateway refuses both, saying why."""
    node = cluster.nodes[0]
    copy = Path(tempfile.mkdtemp(prefix="branchbox-test-gw-copy-"))
    shutil.copy(node.data_dir / TAG_FILE, copy / TAG_FILE)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    twice = node.url.replace("127.0.0.1", "localhost")
    made: list[Sandbox] = []
    with Gateway([node.url, twice, f"http://127.0.0.1:{port}"], USER_KEY, NODE_KEY) as gateway:

        def table() -> list[dict]:
            return httpx.get(f"{gateway.url}/v1/nodes", headers=USER).json()["nodes"]

        assert eventually(lambda: any(n["up"] and n["name"] == "node-0" for n in table()))
        twin = ServedDaemon("gw-copy", env_with_key(NODE_KEY), "--node", "copied",
                            data_dir=copy, port=port)
        try:
            assert eventually(lambda: any(n["name"] == "copied" for n in table()), within=15)
            listed = sorted(table(), key=lambda n: n["name"] != "node-0")
            assert [(n["name"], n["up"]) for n in listed] == [("node-0", False),
                                                              ("copied", False)]
            assert all("node-tag" in n["error"] for n in listed)
            assert listed[0]["tag"] == listed[1]["tag"]
            while not any(cluster.node_of(sb.id) == 0 for sb in made):
                made.append(Sandbox(url=cluster.gateways[0].url, api_key=USER_KEY))
            held = next(sb for sb in made if cluster.node_of(sb.id) == 0)
            with pytest.raises(NodeUnavailable, match="copy"):  # which one holds it? neither
                Sandbox.connect(held.id, url=gateway.url, api_key=USER_KEY)
            assert held.run_code("6 * 7").text == "42"  # the cluster's gateways: no copy
        finally:
            twin.stop()
            for sb in made:
                sb.close()


def test_snapshots_through_the_gateway(cluster: Cluster) -> None:
    """A snapshot lives on its sandbox's node: a create from it goes there (once the
    gateway has that node's report), listings are every node's, a delete finds it."""
    gateway = cluster.gateways[0].url
    source = Sandbox(url=gateway, api_key=USER_KEY)
    node = cluster.node_of(source.id)
    started: list[Sandbox] = []

    def start() -> bool:
        try:
            started.append(Sandbox(snapshot="gw-snap", url=gateway, api_key=USER_KEY))
        except SandboxNotFound:  # sent to another node: the report is up to 2 s old
            return False
        return True

    try:
        source.run_code("v = 'from the snapshot'")
        source.snapshot("gw-snap")
        source.close()
        listed = Sandbox.list_snapshots(url=gateway, api_key=USER_KEY)
        assert [(s["name"], s["sandbox_id"]) for s in listed] == [("gw-snap", source.id)]
        assert eventually(start, within=10)
        assert cluster.node_of(started[0].id) == node
        assert started[0].run_code("v").text == "'from the snapshot'"
        e2b = httpx.get(f"{gateway}/snapshots", headers={"X-API-Key": USER_KEY})
        assert [s["snapshotID"] for s in e2b.json()] == ["gw-snap"]
    finally:
        for sb in started:
            sb.close()
        Sandbox.delete_snapshot("gw-snap", url=gateway, api_key=USER_KEY)
    with pytest.raises(SandboxNotFound):
        Sandbox.delete_snapshot("gw-snap", url=gateway, api_key=USER_KEY)
