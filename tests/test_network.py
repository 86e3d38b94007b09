"""Sandbox networking (issue 10): addresses, egress policy, isolation, the port proxy.

Traffic goes only to addresses these tests create: sandbox addresses, the
daemon's bridge, loopback, and an "outside" host — a network namespace made
here, joined to the host by a veth, with addresses in 198.18.0.0/15 (the
benchmarking range) and an HTTP server of its own. Nothing leaves the machine.

The network does not depend on the storage backend, so one engine (btrfs) runs
these tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Harness
from pyroute2 import IPRoute, NetNS, netns
from ws_scripts import HANDSHAKE

from branchbox import Sandbox

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.parametrize("harness", ["btrfs"], indirect=True)]

# The outside host: the host's end of the veth and two addresses of the outside namespace
# (an allow list admits one and not the other).
HOST_SIDE = "198.18.0.1"
OUTSIDE = "198.18.0.2"
OUTSIDE_2 = "198.18.0.3"
HTTP_PORT = 8080


# ----------------------------------------------------------------- the outside host
class Outside:
    """A network namespace with a veth to the host, two addresses and an HTTP server."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = f"bbtest-out-{tag}"
        self.host_if = f"bbto{tag}"
        self.root = Path(tempfile.mkdtemp(prefix="bbtest-outside-"))
        netns.create(self.ns)
        try:
            with IPRoute() as ipr:
                ipr.link("add", ifname=self.host_if, kind="veth", peer="bbtoeth0")
                peer = ipr.link_lookup(ifname="bbtoeth0")[0]
                ipr.link("set", index=peer, net_ns_fd=self.ns)
                host = ipr.link_lookup(ifname=self.host_if)[0]
                ipr.addr("add", index=host, address=HOST_SIDE, prefixlen=29)
                ipr.link("set", index=host, state="up")
            with NetNS(self.ns) as ns:
                lo = ns.link_lookup(ifname="lo")[0]
                ns.link("set", index=lo, state="up")
                eth = ns.link_lookup(ifname="bbtoeth0")[0]
                for address in (OUTSIDE, OUTSIDE_2):
                    ns.addr("add", index=eth, address=address, prefixlen=29)
                ns.link("set", index=eth, state="up")
            self.server = self._serve()
        except BaseException:
            self.remove()
            raise

    def _serve(self) -> subprocess.Popen:
        """``python -m http.server`` inside the namespace (entered before it binds)."""
        (self.root / "index.html").write_text("outside-ok\n")
        _tiny_index(self.root)
        code = (f"from pyroute2 import netns; netns.setns({self.ns!r}); "
                "import runpy, sys; "
                f"sys.argv = ['http.server', '--bind', '0.0.0.0', '{HTTP_PORT}']; "
                "runpy.run_module('http.server', run_name='__main__')")
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=self.root,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(
                    (OUTSIDE, HTTP_PORT), timeout=1):
                return proc
            time.sleep(0.1)
        proc.kill()
        raise RuntimeError("the outside HTTP server did not come up")

    def remove(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.kill()
            server.wait()
        with contextlib.suppress(Exception), IPRoute() as ipr:
            for index in ipr.link_lookup(ifname=self.host_if):
                ipr.link("del", index=index)
        with contextlib.suppress(Exception):
            netns.remove(self.ns)
        shutil.rmtree(self.root, ignore_errors=True)


WHEEL_PKG = "bbtinypkg"


def _tiny_index(root: Path) -> None:
    """A package index of one wheel built here: ``/simple/bbtinypkg/`` links to it."""
    import base64
    import hashlib
    import zipfile

    name = f"{WHEEL_PKG}-0.1-py3-none-any.whl"
    files = {
        f"{WHEEL_PKG}/__init__.py": "ANSWER = 42\n",
        f"{WHEEL_PKG}-0.1.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: {WHEEL_PKG}\nVersion: 0.1\n",
        f"{WHEEL_PKG}-0.1.dist-info/WHEEL":
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{WHEEL_PKG}-0.1.dist-info/RECORD,,")
    files[f"{WHEEL_PKG}-0.1.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(root / name, "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
    page = root / "simple" / WHEEL_PKG
    page.mkdir(parents=True)
    (page / "index.html").write_text(f'<html><body><a href="/{name}">{name}</a></body></html>\n')


@pytest.fixture(scope="module")
def outside() -> Iterator[Outside]:
    o = Outside()
    yield o
    o.remove()


# ------------------------------------------------------------------- in the sandbox
PROBE = textwrap.dedent("""
    import json, socket, sys, time
    host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    t = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"GET / HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
            s.settimeout(timeout)
            data = s.recv(4096)
        out = "ok " + data.decode(errors="replace").split("\\r\\n", 1)[0] if data else "closed"
    except OSError as exc:
        out = type(exc).__name__
    print(json.dumps([out, time.monotonic() - t]))
""")


def probe(sb: Sandbox, host: str, port: int, timeout: float = 5.0) -> tuple[str, float]:
    """Connect from inside ``sb``; ``("ok <status line>", s)`` or the error's class name."""
    result = sb.exec(["python3", "-c", PROBE, host, str(port), str(timeout)], timeout=60)
    assert result.exit_code == 0, result.stderr
    out, took = json.loads(result.stdout.strip().splitlines()[-1])
    return out, took


def own_address(sb: Sandbox) -> str:
    """The address the sandbox's kernel uses on its way out (eth0's)."""
    code = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            f"s.connect(({OUTSIDE!r}, 9)); print(s.getsockname()[0])")
    return sb.exec(["python3", "-c", code]).stdout.strip()


class HostListener:
    """A TCP server on the host that counts the connections it accepts."""

    def __init__(self, address: str) -> None:
        self.sock = socket.create_server((address, 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.sock.settimeout(0.2)
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.sock.close()


def host_address() -> str:
    """The host's address on its default route (an interface other than ours)."""
    with IPRoute() as ipr:
        for route in ipr.get_default_routes(family=socket.AF_INET):
            oif = route.get_attr("RTA_OIF")
            for addr in ipr.get_addr(family=socket.AF_INET, index=oif):
                return addr.get_attr("IFA_ADDRESS")
    pytest.fail("the host has no IPv4 default route to take an address from")


# ------------------------------------------------------------------------- tests
def test_own_address_and_fork(harness: Harness, make: Callable[..., Sandbox]) -> None:
    sb = make()
    net = harness.engine.net.net
    assert sb.ip is not None and ipaddress.ip_address(sb.ip) in net.subnet
    assert own_address(sb) == sb.ip
    children = sb.fork(n=2)
    try:
        addresses = {sb.ip, *(c.ip for c in children)}
        assert len(addresses) == 3
        for child in children:
            assert own_address(child) == child.ip
            assert child.info()["address"] == child.ip
        assert sb.info()["address"] == sb.ip and own_address(sb) == sb.ip
    finally:
        for child in children:
            child.close()


def test_later_forks_join_namespaces_made_ahead(harness: Harness,
                                               make: Callable[..., Sandbox]) -> None:
    """After a family's first fork, its next children join network namespaces made ahead
    for it (nothing plugged on the fork's path): own addresses, reachable, the REPL's
    listening socket listening, under the family's policy; they go with the family."""
    net = harness.engine.net
    sb = make()
    sb.run_code("import socket; srv = socket.create_server(('0.0.0.0', 8000))")
    for child in sb.fork(n=3):
        child.close()
    family = harness.engine.get(sb.id).family.family.ident
    deadline = time.monotonic() + 10
    while len(net.made.get(family, ())) < 3:
        assert time.monotonic() < deadline, "no namespaces were made ahead after a fork"
        time.sleep(0.05)
    ready = {m.port.address for m in net.made[family]}
    children = sb.fork(n=3)
    try:
        steps = sb.info()["last_fork"]["network_steps"]
        assert set(steps) == {"take", "policy"}, steps  # no veth, no helper on the path
        assert {c.ip for c in children} <= ready
        for child in children:
            assert own_address(child) == child.ip
            with socket.create_connection((child.ip, 8000), timeout=10):
                pass
            assert child.ip in net.policies
        assert len({sb.ip, *(c.ip for c in children)}) == 4
        deadline = time.monotonic() + 10
        while len(net.made.get(family, ())) < 3:  # made again for the next fork
            assert time.monotonic() < deadline, "the namespaces were not made again"
            time.sleep(0.05)
        waiting = [m.port.name for m in net.made[family]]
    finally:
        for child in children:
            child.close()
    sb.close()  # the family ends: what it had made ahead goes with it
    assert family not in net.made
    for name in waiting:
        _wait_link_gone(name)


def test_merge_keeps_the_parents_address(make: Callable[..., Sandbox]) -> None:
    sb = make()
    before = sb.ip
    (child,) = sb.fork(n=1)
    sb.merge_into(child)
    assert sb.info()["address"] == before
    assert own_address(sb) == before


def test_restore_keeps_the_address_and_answers_at_once(harness: Harness,
                                                      make: Callable[..., Sandbox],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A restored body (in a namespace made ahead for the family) takes the sandbox's
    address inside while it sets up; once the restore returns, the host no longer holds
    the old body's MAC for that address, so a connection reaches the restored body at
    once (a stale neighbour entry would lose it until the entry times out)."""
    net = harness.engine.net
    ahead: list[str] = []
    real = net.address_ahead
    monkeypatch.setattr(net, "address_ahead",
                        lambda key, *args: (ahead.append(key), real(key, *args))[1])
    sb = make()
    ip = sb.ip
    sb.run_code("import socket; srv = socket.create_server(('0.0.0.0', 8000))")
    cp = sb.checkpoint()
    (child,) = sb.fork(n=1)  # from now on the family makes namespaces ahead
    child.close()
    family = harness.engine.get(sb.id).family.family.ident
    deadline = time.monotonic() + 10
    while not net.made.get(family):
        assert time.monotonic() < deadline, "no namespaces were made ahead after a fork"
        time.sleep(0.05)
    with socket.create_connection((ip, 8000), timeout=10):  # the host learns its MAC
        pass
    old_mac = net.ports[harness.engine.get(sb.id).body.key].mac
    assert _neighbour_macs(ip) == {old_mac}
    sb.restore(cp)
    body = harness.engine.get(sb.id).body
    assert ahead == [body.key] and net.ports[body.key].address == ip == sb.ip
    assert old_mac not in _neighbour_macs(ip)
    with socket.create_connection((ip, 8000), timeout=10) as conn:
        assert _accept_and_greet(sb, "restored") is not None
        assert conn.recv(100) == b"restored"
    assert own_address(sb) == ip
    assert not net._ahead  # noqa: SLF001 - nothing left behind


def test_an_address_a_merge_moved_is_forgotten_by_the_host_once_freed(
        harness: Harness, make: Callable[..., Sandbox]) -> None:
    """After a merge the parent's address is on the winner's port, whose MAC was made from
    the winner's own address; the host learns that MAC. Once the sandbox is closed and the
    address freed, the host holds no entry for it: its next holder (with the MAC made from
    the address) is reached at once, not after the stale entry fails (seconds)."""
    from branchbox.sdk._portal import portal

    net = harness.engine.net
    sb = make()
    (child,) = sb.fork(n=1)
    child.run_code("import socket; srv = socket.create_server(('0.0.0.0', 8000))")
    sb.merge_into(child)
    address, port = sb.ip, net.ports[harness.engine.get(sb.id).body.key]
    assert port.address == address and port.mac != _mac_of(address)
    with socket.create_connection((address, 8000), timeout=10):  # the host learns its MAC
        pass
    assert _neighbour_macs(address) == {port.mac}
    sb.close()
    _wait_link_gone(port.name)

    async def reap() -> None:
        net._reap()  # noqa: SLF001 - what the next lease does first

    portal.run(reap())
    assert port.mac not in _neighbour_macs(address)


def _mac_of(address: str) -> str:
    return "02:bb:" + ":".join(f"{b:02x}" for b in ipaddress.IPv4Address(address).packed)


def _neighbour_macs(address: str) -> set[str]:
    """The MACs the host's neighbour table holds for ``address`` (reachable or not)."""
    with IPRoute() as ipr:
        return {entry.get_attr("NDA_LLADDR") for entry in ipr.get_neighbours(dst=address)
                if entry.get_attr("NDA_LLADDR")}


def test_egress_on_reaches_the_outside(outside: Outside,
                                       make: Callable[..., Sandbox]) -> None:
    sb = make(internet=True)
    out, _ = probe(sb, OUTSIDE, HTTP_PORT)
    assert out.startswith("ok HTTP/1.0 200"), out
    fetched = sb.exec(["python3", "-c", "import urllib.request as u; "
                       f"print(u.urlopen('http://{OUTSIDE}:{HTTP_PORT}/', timeout=10)"
                       ".read().decode())"])
    assert fetched.stdout.strip() == "outside-ok", fetched.stderr


def test_egress_off_fails_fast(outside: Outside, make: Callable[..., Sandbox]) -> None:
    sb = make()  # the daemon's default: no internet
    for port in (HTTP_PORT, 9):
        out, took = probe(sb, OUTSIDE, port, timeout=10)
        assert out in ("ConnectionRefusedError", "OSError"), out
        assert took < 2, f"refused only after {took:.1f}s"
    udp = sb.exec(["python3", "-c", textwrap.dedent(f"""
        import socket
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5)
        s.connect(({OUTSIDE!r}, 53)); s.send(b"x")
        try:
            s.recv(10)
        except OSError as exc:
            print(type(exc).__name__, exc.errno)
    """)])
    assert "TimeoutError" not in udp.stdout and "113" in udp.stdout, udp.stdout  # EHOSTUNREACH


def test_allow_list_admits_that_address_only(outside: Outside,
                                             make: Callable[..., Sandbox]) -> None:
    sb = make(network={"allow_out": [f"{OUTSIDE}/32"]})
    assert probe(sb, OUTSIDE, HTTP_PORT)[0].startswith("ok HTTP/1.0 200")
    out, took = probe(sb, OUTSIDE_2, HTTP_PORT)
    assert out == "ConnectionRefusedError" and took < 2, (out, took)
    # Inherited by fork children.
    (child,) = sb.fork(n=1)
    try:
        assert probe(child, OUTSIDE, HTTP_PORT)[0].startswith("ok HTTP/1.0 200")
        assert probe(child, OUTSIDE_2, HTTP_PORT)[0] == "ConnectionRefusedError"
    finally:
        child.close()


def test_deny_list_and_runtime_change(outside: Outside,
                                      make: Callable[..., Sandbox]) -> None:
    sb = make(internet=True, network={"deny_out": [f"{OUTSIDE_2}/32"]})
    assert probe(sb, OUTSIDE, HTTP_PORT)[0].startswith("ok HTTP/1.0 200")
    assert probe(sb, OUTSIDE_2, HTTP_PORT)[0] == "ConnectionRefusedError"
    # allow wins over deny
    sb.update_network(allow_out=[f"{OUTSIDE_2}/32"], deny_out=["198.18.0.0/29"])
    assert probe(sb, OUTSIDE_2, HTTP_PORT)[0].startswith("ok HTTP/1.0 200")
    assert probe(sb, OUTSIDE, HTTP_PORT)[0] == "ConnectionRefusedError"
    # off at runtime
    sb.update_network(internet=False, allow_out=[], deny_out=[])
    out, took = probe(sb, OUTSIDE, HTTP_PORT)
    assert out == "ConnectionRefusedError" and took < 2, (out, took)


@pytest.mark.parametrize("policy", [{"internet": True}, {}], ids=["internet", "default"])
def test_no_host_service_is_reachable(harness: Harness, outside: Outside, policy: dict,
                                      make: Callable[..., Sandbox]) -> None:
    """Whatever the policy: not the host's loopback, not its addresses (the bridge's
    gateway, the uplink's, the outside veth's host end), not the daemon's port."""
    sb = make(**policy)
    gateway = harness.engine.net.net.gateway
    listeners = {addr: HostListener(addr) for addr in ("127.0.0.1", "0.0.0.0")}
    try:
        loop = listeners["127.0.0.1"]
        # 127.0.0.1 inside is the sandbox's own loopback; the host's is not routed to.
        assert probe(sb, "127.0.0.1", loop.port)[0] == "ConnectionRefusedError"
        wildcard = listeners["0.0.0.0"]
        for target in (gateway, host_address(), HOST_SIDE):
            out, took = probe(sb, target, wildcard.port)
            assert out in ("ConnectionRefusedError", "OSError"), (target, out)
            assert took < 2, (target, took)
        assert loop.accepted == 0 and wildcard.accepted == 0
    finally:
        for listener in listeners.values():
            listener.close()


def test_the_daemons_tcp_port_is_not_reachable(harness: Harness, outside: Outside,
                                               served: object) -> None:
    """A daemon serving TCP on every host address: its sandboxes cannot call its API."""
    port = int(served.url.rsplit(":", 1)[1])
    with Sandbox(url=served.url, api_key="net-test-key", internet=True) as sb:
        gateway = str(ipaddress.ip_network(f"{sb.ip}/16", strict=False).network_address + 1)
        for target in (gateway, host_address(), HOST_SIDE):
            out, took = probe(sb, target, port)
            assert out in ("ConnectionRefusedError", "OSError"), (target, out)
            assert took < 2, (target, took)
        # the host itself reaches it there, so it was really listening
        httpx.get(f"http://{host_address()}:{port}/v1/healthz", timeout=10).raise_for_status()


def test_sandboxes_cannot_reach_each_other(make: Callable[..., Sandbox]) -> None:
    server = make(internet=True)
    server.exec("python3 -m http.server --bind 0.0.0.0 8000 >/dev/null 2>&1",
                background=True)
    assert _wait_ok(server, "127.0.0.1", 8000)
    other = make(internet=True)  # another family
    (sibling,) = server.fork(n=1)  # the same family (a copy of the server: it listens too)
    try:
        for client in (other, sibling):
            out, _ = probe(client, server.ip, 8000, timeout=2)
            assert not out.startswith("ok"), out
        out, _ = probe(server, sibling.ip, 8000, timeout=2)
        assert not out.startswith("ok"), out
    finally:
        sibling.close()


def test_past_a_bridges_ports_sandboxes_go_on_leaf_bridges(
        harness: Harness, monkeypatch: pytest.MonkeyPatch, outside: Outside) -> None:
    """The kernel takes at most 1023 ports per bridge (a daemon of ~1,000 sandboxes hit
    EXFULL): past a bridge's share, ports go on leaf bridges joined to the hub by trunks.
    Here 4 ports per bridge: a family of 11 spreads over several leaves; every member is
    reached from the host, reaches the outside, and reaches no other member (on its own
    leaf, another leaf or the hub); at stop the leaves and trunks go. (A daemon of its
    own: the module's keeps the full share.)"""
    monkeypatch.setenv("BRANCHBOX_BRIDGE_PORTS", "4")
    own = Harness(harness.backend)
    net = own.engine.net.net
    try:
        with own.sandbox(internet=True) as sb:
            sb.run_code("import socket; srv = socket.create_server(('0.0.0.0', 8000))")
            kids = sb.fork(n=10)
            family = [sb, *kids]
            for member in family:  # the host reaches each (and its bridge learns its MAC)
                with socket.create_connection((member.ip, 8000), timeout=10):
                    pass
            on = {member.id: _bridge_of(member.ip) for member in family}
            leaves = {bridge for bridge in on.values() if bridge != net.bridge}
            assert len(leaves) >= 2, on
            for name, _ in net.bridges:  # each bridge's share of sandbox ports, give or
                # take a chunk (the hub's trunks, one per leaf, are not in it)
                ports = [p for p in os.listdir(f"/sys/class/net/{name}/brif")
                         if not p.startswith("bt")]
                assert len(ports) <= 4 + 8 + 1, (name, ports)
            a = next(k for k in kids if on[k.id] != net.bridge)
            b = next(k for k in kids if on[k.id] not in (net.bridge, on[a.id]))
            same = [k for k in kids if k is not a and on[k.id] == on[a.id]]
            assert probe(a, OUTSIDE, HTTP_PORT)[0].startswith("ok HTTP/1.0 200")
            # A frame built by hand reaches the outside through the gateway (the hub) and
            # not through the leaf's own device, a way past every rule of the hub.
            assert _reaches_outside(a, net.bridge_mac(), outside)
            leaf = int(on[a.id].rsplit("x", 1)[1])
            assert not _reaches_outside(a, net.bridge_mac(leaf), outside)
            assert _connects(a, a.ip, 8000)  # what is refused below is refused by the network
            for target in [sb, b, *same]:
                assert not _connects(a, target.ip, 8000), (on[a.id], on[target.id])
            assert not _connects(sb, a.ip, 8000)
            for kid in kids:
                kid.close()
    finally:
        names = [name for name, _ in net.bridges]
        own.stop()
    left = [name for name in os.listdir("/sys/class/net")
            if name in names or name.startswith(net.trunk_prefix)]
    assert not left, left


RAW_UDP = textwrap.dedent("""
    import socket, struct, sys
    mac, own, src, dst, port = sys.argv[1:5] + [int(sys.argv[5])]
    def checksum(b):
        total = sum(struct.unpack("!10H", b))
        total = (total >> 16) + (total & 0xFFFF)
        return ~(total + (total >> 16)) & 0xFFFF
    payload = b"through " + mac.encode()
    udp = struct.pack("!HHHH", 40000, port, 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    raw.bind(("eth0", 0))
    frame = bytes.fromhex((mac + own).replace(":", "")) + b"\\x08\\x00" + ip + udp
    for _ in range(3):
        raw.send(frame)
""")


def _reaches_outside(sb: Sandbox, mac: str, outside: Outside) -> bool:
    """Whether a UDP datagram to the outside host, sent from inside ``sb`` as a raw frame
    to the link-layer address ``mac``, arrives there."""
    code = (f"from pyroute2 import netns; netns.setns({outside.ns!r}); import socket; "
            f"s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            f"s.bind(({OUTSIDE!r}, 9999)); s.settimeout(3); print('ready', flush=True)\n"
            "try:\n    print(s.recv(100).decode())\nexcept TimeoutError:\n    print('none')")
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          text=True) as listener:
        assert listener.stdout.readline().strip() == "ready"
        own = "02:bb:" + ":".join(f"{b:02x}" for b in ipaddress.IPv4Address(sb.ip).packed)
        sent = sb.exec(["python3", "-c", RAW_UDP, mac, own, sb.ip, OUTSIDE, "9999"],
                       timeout=60)
        assert sent.exit_code == 0, sent.stderr
        return listener.stdout.read().strip() == f"through {mac}"


def _connects(sb: Sandbox, host: str, port: int) -> bool:
    """Whether a TCP connection from inside ``sb`` to ``host:port`` is accepted (a REPL's
    listening socket accepts in the kernel: nothing answers on it)."""
    code = ("import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), "
            "timeout=2).close()")
    return sb.exec(["python3", "-c", code, host, str(port)], timeout=60).exit_code == 0


def _bridge_of(address: str) -> str:
    """The bridge the port of the sandbox at ``address`` is on (its MAC is derived from
    the address; the host end's is the kernel's, so the port is found by its peer's
    neighbour entry on the hub)."""
    mac = "02:bb:" + ":".join(f"{b:02x}" for b in ipaddress.IPv4Address(address).packed)
    for line in subprocess.run(["bridge", "fdb", "show"], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        fields = line.split()
        if fields[0] == mac and fields[1:2] == ["dev"] and fields[2].startswith("bv") \
                and "master" in fields:
            return fields[fields.index("master") + 1]
    raise AssertionError(f"no port holds {mac}")


def _wait_ok(sb: Sandbox, host: str, port: int) -> bool:
    for _ in range(50):
        if probe(sb, host, port, timeout=2)[0].startswith("ok"):
            return True
        time.sleep(0.1)
    return False


def _wait_link_gone(name: str, within: float = 5.0) -> None:
    with IPRoute() as ipr:
        deadline = time.monotonic() + within
        while ipr.link_lookup(ifname=name):
            if time.monotonic() > deadline:
                pytest.fail(f"link {name} is still there {within:g} s after its sandbox closed")
            time.sleep(0.05)


def test_close_frees_the_link_and_rules(harness: Harness,
                                        make: Callable[..., Sandbox]) -> None:
    net = harness.engine.net
    sb = make(internet=True)
    port = net.ports[harness.engine.get(sb.id).body.key]
    with IPRoute() as ipr:
        assert ipr.link_lookup(ifname=port.name)
    sb.close()
    assert port.address not in net.policies  # out of the firewall at once
    _wait_link_gone(port.name)  # it goes with the sandbox's namespace, soon after
    rows = net.db.execute("SELECT address FROM net_leases WHERE body IS NOT NULL").fetchall()
    assert (port.address,) not in rows


def test_a_closed_sandboxs_link_kept_alive_is_deleted_and_its_address_waits(
        harness: Harness, make: Callable[..., Sandbox], monkeypatch) -> None:
    """A closed sandbox's link normally goes with its namespace; one that something keeps
    alive is deleted after the grace, and its address is not leased again before."""
    from branchbox.engine import networking

    monkeypatch.setattr(networking, "LINK_GRACE", 0.3)
    net = harness.engine.net
    sb = make()
    body = harness.engine.get(sb.id).body
    port = net.ports[body.key]
    held = os.open(f"/proc/{body.cgroup.leaf_pids('repl')[0]}/ns/net", os.O_RDONLY)
    try:
        sb.close()
        time.sleep(0.5)
        with IPRoute() as ipr:
            assert ipr.link_lookup(ifname=port.name)  # the namespace lives on, so does it
        assert port.address not in {p.address for p in net.ready}
        parent = make()
        parent.fork(1)[0].close()  # the pool refills: the grace is over, the link deleted
        _wait_link_gone(port.name)
    finally:
        os.close(held)


# ------------------------------------------------------------------- the port proxy
WS_ECHO = HANDSHAKE + textwrap.dedent("""
    def serve(conn):
        handshake(conn)
        f = conn.makefile("rb")
        while True:
            b1, b2 = f.read(2)
            opcode, length = b1 & 0x0F, b2 & 0x7F
            if length == 126:
                length = struct.unpack(">H", f.read(2))[0]
            elif length == 127:
                length = struct.unpack(">Q", f.read(8))[0]
            mask = f.read(4)
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(length)))
            if opcode == 8:
                conn.sendall(b"\\x88\\x00"); return
            reply = b"echo:" + payload
            head = bytes([0x80 | opcode])
            size = len(reply)
            head += bytes([size]) if size < 126 else b"\\x7e" + struct.pack(">H", size)
            conn.sendall(head + reply)

    srv = socket.create_server(("0.0.0.0", 8765))
    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
""")


def _start_servers(sb: Sandbox) -> None:
    sb.files.write("/srv/www/hello.txt", "hello from the sandbox\n")
    sb.files.write("/srv/ws_echo.py", WS_ECHO)
    sb.exec("head -c 5000000 /dev/urandom > /srv/www/blob")
    sb.exec("cd /srv/www && python3 -m http.server --bind 0.0.0.0 8000 >/dev/null 2>&1",
            background=True)
    sb.exec("python3 /srv/ws_echo.py >/dev/null 2>&1", background=True)
    assert _wait_ok(sb, "127.0.0.1", 8000)


def test_port_proxy_http_in_process(harness: Harness, make: Callable[..., Sandbox]) -> None:
    from branchbox.sdk._portal import portal

    sb = make()
    _start_servers(sb)
    # On the daemon's host the sandbox's address is reachable as it is (the host opens
    # the connection, the sandbox answers).
    url = sb.get_host(8000)
    assert url == f"http://{sb.ip}:8000"
    direct = httpx.get(f"{url}/hello.txt", timeout=30, trust_env=False)
    assert direct.text == "hello from the sandbox\n"

    async def fetch(path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=harness.transport(),
                                     base_url="http://branchbox") as client:
            return await client.get(f"/v1/sandboxes/{sb.id}/ports/8000{path}")

    reply = portal.run(fetch("/hello.txt?x=1"))
    assert reply.status_code == 200 and reply.text == "hello from the sandbox\n"
    assert portal.run(fetch("/missing")).status_code == 404  # the sandbox's server's 404
    sid = sb.id
    sb.close()

    async def after_close() -> httpx.Response:
        async with httpx.AsyncClient(transport=harness.transport(),
                                     base_url="http://branchbox") as client:
            return await client.get(f"/v1/sandboxes/{sid}/ports/8000/hello.txt")

    gone = portal.run(after_close())
    assert gone.status_code == 404 and gone.json()["type"] == "SandboxNotFound"


@pytest.fixture(scope="module")
def served() -> Iterator[object]:
    """A daemon on TCP, on every host address, with an API key."""
    from served import ServedDaemon

    daemon = ServedDaemon("net", {**os.environ, "BRANCHBOX_API_KEY": "net-test-key"},
                          "--host", "0.0.0.0")
    yield daemon
    daemon.stop()


def test_port_proxy_over_tcp_with_websocket(harness: Harness, served: object) -> None:
    import asyncio

    import websockets

    with Sandbox(url=served.url, api_key="net-test-key") as sb:
        _start_servers(sb)
        url = sb.get_host(8000)
        assert url == f"{served.url}/v1/sandboxes/{sb.id}/ports/8000"
        auth = {"Authorization": "Bearer net-test-key"}
        reply = httpx.get(f"{url}/hello.txt", headers=auth, timeout=30)
        assert reply.status_code == 200 and reply.text == "hello from the sandbox\n"
        assert reply.headers["content-type"].startswith("text/plain")  # the sandbox's
        assert len(reply.headers.get_list("date")) == 1
        assert httpx.get(f"{url}/hello.txt", timeout=30).status_code == 401
        # streamed whole (a GET goes on without a body: http.server would reset otherwise)
        blob = httpx.get(f"{url}/blob", headers=auth, timeout=60)
        direct = httpx.get(f"http://{sb.ip}:8000/blob", timeout=60, trust_env=False)
        assert len(blob.content) == 5_000_000 and blob.content == direct.content
        assert httpx.get(f"{served.url}/v1/sandboxes/{sb.id}/ports/8001/", headers=auth,
                         timeout=30).status_code == 502  # nothing listens there
        ws_url = served.url.replace("http://", "ws://") + f"/v1/sandboxes/{sb.id}/ports/8765/"

        async def echo(headers: dict[str, str]) -> list[str]:
            async with websockets.connect(ws_url, additional_headers=headers,
                                          proxy=None) as ws:
                got = []
                for text in ("one", "two" * 100):
                    await ws.send(text)
                    got.append(await ws.recv())
                return got

        for _ in range(50):  # the echo server starts in the background
            with contextlib.suppress(OSError, websockets.WebSocketException):
                assert asyncio.run(echo(auth)) == ["echo:one", "echo:" + "two" * 100]
                break
            time.sleep(0.1)
        else:
            pytest.fail("no WebSocket echo through the proxy")
        with pytest.raises(websockets.WebSocketException):
            asyncio.run(echo({}))  # no key: closed before it opens
        sid = sb.id
    assert httpx.get(f"{served.url}/v1/sandboxes/{sid}/ports/8000/hello.txt", headers=auth,
                     timeout=30).status_code == 404


# --------------------------------------------------------------- fork and sockets
def _accept_and_greet(sb: Sandbox, name: str) -> list[str]:
    """The REPL's listening socket ``srv`` takes one queued connection and answers;
    returns the run's warnings."""
    result = sb.run_code(f"c, _ = srv.accept(); c.sendall(b{name!r}); c.close()", timeout=30)
    assert result.error is None, result.error
    return result.warnings


def test_listening_socket_listens_in_each_child(make: Callable[..., Sandbox]) -> None:
    sb = make()
    sb.run_code("import socket; srv = socket.create_server(('0.0.0.0', 8000)); "
                "fd = srv.fileno()")
    children = sb.fork(n=2)
    try:
        warnings = {}
        for who, name in ((sb, "parent"), *zip(children, ("one", "two"), strict=True)):
            with socket.create_connection((who.ip, 8000), timeout=10) as conn:
                warnings[name] = _accept_and_greet(who, name)
                assert conn.recv(100) == name.encode()
        assert children[0].run_code("srv.fileno() == fd").text == "True"
        assert not warnings["parent"]
        for name in ("one", "two"):
            assert any("listening sockets re-created" in w and "tcp 0.0.0.0:8000" in w
                       for w in warnings[name]), warnings[name]
    finally:
        for child in children:
            child.close()


def test_established_connection_stays_with_the_parent(outside: Outside,
                                                      make: Callable[..., Sandbox]) -> None:
    sb = make(internet=True)
    sb.run_code(f"import socket; conn = socket.create_connection(({OUTSIDE!r}, {HTTP_PORT}))")
    (child,) = sb.fork(n=1)
    try:
        gone = child.run_code("conn.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n')")
        assert gone.error is not None and "OSError" in gone.error.name + gone.error.value
        alive = sb.run_code("conn.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); "
                            "print(conn.recv(100).split(b'\\r\\n')[0].decode())")
        assert alive.stdout.strip() == "HTTP/1.0 200 OK", alive
    finally:
        child.close()


def test_pip_install_from_an_index_outside(outside: Outside,
                                           make: Callable[..., Sandbox]) -> None:
    """``pip install`` with egress on reaches the outside index; with egress off it fails
    at once. (The default image's pip is its /opt/venv's, so PEP 668 does not apply.)"""
    pip = (f"pip install --isolated --no-cache-dir --disable-pip-version-check --retries 0 "
           f"--trusted-host {OUTSIDE} "
           f"--timeout 10 --index-url http://{OUTSIDE}:{HTTP_PORT}/simple/ {WHEEL_PKG}")
    sb = make(internet=True)
    done = sb.exec(pip, timeout=120)
    assert done.exit_code == 0, done.stdout + done.stderr
    assert sb.exec(["python3", "-c", f"import {WHEEL_PKG}; print({WHEEL_PKG}.ANSWER)"]
                   ).stdout.strip() == "42"
    off = make()
    t0 = time.monotonic()
    refused = off.exec(pip, timeout=120)
    assert refused.exit_code != 0
    assert time.monotonic() - t0 < 30, "pip should fail fast, not wait for timeouts"


SOURCED = textwrap.dedent("""
    import socket, sys
    source, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    try:
        with socket.create_connection((host, port), timeout=3, source_address=(source, 0)):
            print("connected")
    except OSError as exc:
        print(type(exc).__name__)
""")


def test_no_spoofing_of_another_address_or_mac(outside: Outside,
                                               make: Callable[..., Sandbox]) -> None:
    """Root in a sandbox owns its network namespace and may change eth0 at will; the
    bridge lets through only the (port, MAC, address) of its lease."""
    sb = make(internet=True)
    victim = make(internet=True)
    free = str(ipaddress.ip_address(sb.ip) + 200)  # leased to nobody in this test

    def from_(source: str) -> str:
        return sb.exec(["python3", "-c", SOURCED, source, OUTSIDE, str(HTTP_PORT)],
                       timeout=60).stdout.strip()

    assert from_(sb.ip) == "connected"
    for address in (victim.ip, free):
        assert sb.exec(f"ip addr add {address}/32 dev eth0").exit_code == 0
        assert from_(address) != "connected", address
    # the victim's address still works for the victim (no ARP hijack got through)
    assert probe(victim, OUTSIDE, HTTP_PORT)[0].startswith("ok HTTP/1.0 200")
    # another MAC: nothing passes, not even from the sandbox's own address
    assert sb.exec("ip link set eth0 address 02:bb:00:00:00:99").exit_code == 0
    assert from_(sb.ip) != "connected"


NEVER_ANSWERS = """
import socket, threading
server = socket.create_server(("0.0.0.0", 8100), backlog=512)
held = []
def hold():
    while True:
        held.append(server.accept()[0])  # reads nothing, answers nothing
threading.Thread(target=hold, daemon=True).start()
"""


def test_a_sandbox_that_never_answers_holds_up_no_other_sandboxs_ports(
        harness: Harness, make: Callable[..., Sandbox]) -> None:
    """The proxy's connections to sandboxes came from one pool of 100: a sandbox that
    accepts and never answers held them all, and a request to another sandbox's server
    waited for a free one until its pool timeout (a 502). Now each sandbox has a cap of
    its own: past it, requests to that sandbox are refused at once (429)."""
    from branchbox.sdk._portal import portal
    from branchbox.server.ports import PROXIED_PER_SANDBOX

    stalling, answering = make(), make()
    stalling.run_code(NEVER_ANSWERS)
    answering.files.write("/srv/www/hello.txt", "hello\n")
    answering.exec("cd /srv/www && python3 -m http.server --bind 0.0.0.0 8000 >/dev/null 2>&1",
                   background=True)
    assert _wait_ok(answering, "127.0.0.1", 8000)

    def held() -> int:
        return int(stalling.run_code("print(len(held))").stdout)

    async def scenario() -> tuple[list[int], httpx.Response]:
        async with httpx.AsyncClient(transport=harness.transport(), base_url="http://bb",
                                     timeout=60) as client:
            stuck = [asyncio.create_task(client.get(f"/v1/sandboxes/{stalling.id}/ports/8100/"))
                     for _ in range(PROXIED_PER_SANDBOX + 4)]
            try:
                deadline = time.monotonic() + 60
                while await asyncio.to_thread(held) < PROXIED_PER_SANDBOX:
                    assert time.monotonic() < deadline, "the proxy never opened its share"
                    await asyncio.sleep(0.2)
                refused = [task.result().status_code for task in stuck if task.done()]
                other = await client.get(f"/v1/sandboxes/{answering.id}/ports/8000/hello.txt")
                return refused, other
            finally:
                for task in stuck:
                    task.cancel()
                await asyncio.gather(*stuck, return_exceptions=True)

    refused, other = portal.run(scenario())
    assert refused == [429] * 4, refused
    assert other.status_code == 200 and other.text == "hello\n", other.text
