"""The daemon's sandbox network: a bridge, a veth per sandbox, a firewall, a helper.

Layout (per daemon; names carry a tag of its data directory, so a test daemon
and ``make run`` never touch each other's):

* a bridge ``bbr<tag>`` (the hub) holding the gateway address, the first of a /16
  that no host route or address overlaps (``10.89.0.0/16`` and up), or
  ``BRANCHBOX_SUBNET``;
* per sandbox a veth pair: ``bv<tag><n>`` on a bridge, ``eth0`` inside the
  sandbox's own network namespace with its leased address and a default route;
* leaf bridges ``bbr<tag>x<k>``, made as the bridges there fill up (the kernel
  takes at most 1023 ports per bridge), each joined to the hub by a veth pair
  ``bt<tag>h<k>`` / ``bt<tag>l<k>`` (a trunk): one Ethernet segment, so the
  subnet, the gateway and every rule on the hub hold for a leaf's sandboxes too;
* the firewall of ``runtime.firewall``;
* ``runtime.netlink_helper``, the only process that changes namespace.

Every netlink message goes through the helper (but one the host must see at once:
a neighbour forgotten at a restore's hand-over); the daemon's threads never
``setns``. The kernel forwards between the bridge and the host's uplink for NAT,
so the daemon turns ``net.ipv4.ip_forward`` on (as Docker and libvirt do); the
firewall decides what is forwarded from and to the bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Mapping
from pathlib import Path

from branchbox.runtime import netlink_msgs as msgs
from branchbox.runtime.firewall import Firewall
from branchbox.runtime.netlink_helper import Netlink

DEFAULT_FIRST_SUBNET = ipaddress.ip_network("10.89.0.0/16")
LOCK_PATH = Path("/run/branchbox/network.lock")
PORTS_MAX = 900
"""Sandbox ports a bridge takes (``BRANCHBOX_BRIDGE_PORTS``, at most this) before the
next is used. The kernel's limit is 1023 ports: the hub keeps room for its trunks, and
ports prepared for a bridge may still land on it after it reached the count."""
GROW_AT = 0.8  # of a bridge's ports: the next bridge is made then, off any fork's path


def bridge_ports() -> int:
    """Sandbox ports per bridge: ``BRANCHBOX_BRIDGE_PORTS`` (1..PORTS_MAX), else the most."""
    raw = os.environ.get("BRANCHBOX_BRIDGE_PORTS", str(PORTS_MAX))
    if not raw.isdigit() or not 1 <= int(raw) <= PORTS_MAX:
        raise ValueError(f"BRANCHBOX_BRIDGE_PORTS must be between 1 and {PORTS_MAX}, "
                         f"not {raw!r}")
    return int(raw)


class NetworkError(RuntimeError):
    """The network could not be set up or changed; the message says why (``errno``: the
    kernel's, 0 if none)."""

    def __init__(self, message: str, errno: int = 0) -> None:
        super().__init__(message)
        self.errno = errno


def host_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 prefix the host routes or holds (``/proc/net/route`` and
    ``/proc/net/fib_trie`` would do; the routing table is enough to avoid clashes)."""
    nets = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            fields = line.split()
            dest, mask = int(fields[1], 16), int(fields[7], 16)
            if mask == 0:
                continue
            addr = ipaddress.IPv4Address(dest.to_bytes(4, "little"))
            length = bin(mask).count("1")
            nets.append(ipaddress.ip_network(f"{addr}/{length}", strict=False))
    return nets


def pick_subnet(taken: list[ipaddress.IPv4Network],
                first: ipaddress.IPv4Network = DEFAULT_FIRST_SUBNET) -> ipaddress.IPv4Network:
    """The first /16 from ``first`` up (within 10.0.0.0/8) overlapping nothing in ``taken``."""
    candidate = first
    top = ipaddress.ip_network("10.0.0.0/8")
    while candidate.subnet_of(top):
        if not any(candidate.overlaps(net) for net in taken):
            return candidate
        candidate = ipaddress.ip_network(
            (int(candidate.network_address) + candidate.num_addresses, candidate.prefixlen))
    raise NetworkError("no free /16 in 10.0.0.0/8 for the sandbox bridge; "
                       "set BRANCHBOX_SUBNET")


def host_resolvers(path: Path = Path("/etc/resolv.conf")) -> list[str]:
    """The host's IPv4 name servers a sandbox can reach through NAT (loopback ones, such
    as a local stub resolver, are the host's own service and never reachable)."""
    found = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    addr = ipaddress.ip_address(parts[1])
                    if addr.version == 4 and not addr.is_loopback:
                        found.append(str(addr))
    return found


HELPER_TIMEOUT = 60.0
"""Seconds a netlink request may take (most take milliseconds; a sweep of a thousand
links, seconds) before the helper is taken for hung and replaced."""


class Helper:
    """The client side of ``runtime.netlink_helper``: one request in flight per call,
    answers matched by id, on the daemon's event loop.

    The helper keeps no state between requests, so one that died (killed, crashed) is
    replaced by the next call: the requests it had are failed with NetworkError, the
    daemon's networking goes on."""

    def __init__(self) -> None:
        self.ids = 0
        self.waiting: dict[int, asyncio.Future] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._spawn()

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        src = str(Path(__file__).resolve().parents[2])
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c",
                 f"import sys; sys.path.insert(0, {src!r}); "
                 "from branchbox.runtime.netlink_helper import main; main()",
                 str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True)
        self.sock = ours
        self.sock.setblocking(False)
        if self.loop is not None:
            self.loop.add_reader(self.sock.fileno(), self._readable)

    def _respawn(self) -> None:
        self.close()
        self._spawn()

    def _readable(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the helper died: fail everything waiting
                self.loop.remove_reader(self.sock.fileno())
                self._fail_waiting()
                return
            reply = json.loads(data)
            reply["received"] = time.perf_counter_ns()
            fut = self.waiting.pop(reply.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def call(self, op: str, fds: list[int] = (), **args) -> dict:
        """The helper's reply to ``op``; ``arrival`` and ``replied`` in it, and the
        ``received`` added here, time the round trip (perf_counter_ns)."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
            self.loop.add_reader(self.sock.fileno(), self._readable)
        if self.proc.poll() is not None:
            self._respawn()
        self.ids += 1
        data = json.dumps({"op": op, "id": self.ids, "sent": time.perf_counter_ns(),
                           **args}).encode()
        respawned = False
        while True:
            try:
                socket.send_fds(self.sock, [data], list(fds))
                break
            except BlockingIOError:
                await asyncio.sleep(0.001)
            except OSError as exc:  # died since the poll: the request never got there
                if respawned:
                    raise NetworkError(f"the netlink helper cannot be reached: {exc}"
                                       ) from None
                respawned = True
                self._respawn()
        fut = self.loop.create_future()  # no await since the send: the reply is not in yet
        self.waiting[self.ids] = fut
        try:
            reply = await asyncio.wait_for(fut, HELPER_TIMEOUT)
        except TimeoutError:  # hung (stopped, stuck in the kernel): replaced now
            self._respawn()
            raise NetworkError(f"the netlink helper did not answer {op} within "
                               f"{HELPER_TIMEOUT:g} s") from None
        if not reply.get("ok"):
            raise NetworkError(reply.get("error") or f"{op} failed", reply.get("errno") or 0)
        return reply

    def _fail_waiting(self) -> None:
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(NetworkError("the netlink helper died"))
        self.waiting.clear()

    def close(self) -> None:
        self._fail_waiting()
        if self.loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()


class Network:
    """The bridges, firewall and helper of one daemon."""

    def __init__(self, tag: str, subnet: str | None = None) -> None:
        self.tag = tag
        self.bridge = f"bbr{tag}"  # the hub
        self.port_prefix = f"bv{tag}"
        self.trunk_prefix = f"bt{tag}"
        self.subnet_arg = subnet
        self.subnet: ipaddress.IPv4Network | None = None
        self.gateway = ""
        self.bridge_index = 0  # the hub's
        self.bridges: list[tuple[str, int]] = []  # (name, index): the hub, then the leaves
        self.ports_per_bridge = bridge_ports()
        self._growing = asyncio.Lock()
        self.helper: Helper | None = None
        self.maker: Helper | None = None  # plugs namespaces made ahead: never in a fork's way
        self.firewall: Firewall | None = None
        self._host_netlink: Netlink | None = None  # host-side messages that cannot wait
        self.resolvers = host_resolvers()

    async def start(self, keep: set[str] = frozenset(), subnet: str | None = None) -> None:
        """Sweep what an earlier daemon of this tag left, then build everything afresh.

        ``keep``: ports of sandboxes a restarted daemon re-attaches to (an earlier
        daemon's, on ``subnet``): they stay plugged, and so does the bridge; the
        firewall is built afresh and the caller admits them again."""
        self.helper = Helper()
        self.maker = Helper()
        LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK_PATH, "w") as lock:  # two daemons starting must not pick one subnet
            fcntl.flock(lock, fcntl.LOCK_EX)
            names = await self.sweep(bridge_too=not keep, keep=keep)
            if keep and subnet:
                self.subnet = ipaddress.ip_network(subnet)
            elif self.subnet_arg:
                self.subnet = ipaddress.ip_network(self.subnet_arg)
            else:
                self.subnet = pick_subnet(host_networks())
            self.gateway = str(self.subnet.network_address + 1)
            reply = await self.helper.call("bridge", name=self.bridge, address=self.gateway,
                                           prefix=self.subnet.prefixlen, mac=self.bridge_mac())
        self.bridge_index = reply["index"]
        self.bridges = [(self.bridge, self.bridge_index)]
        # A restarted daemon that keeps its sandboxes keeps their leaves too (a sweep
        # removed them otherwise), in the order they were made.
        numbered = ((n.removeprefix(self._leaf("")), n) for n in names
                    if n.startswith(self._leaf("")))
        for _, name in sorted((int(k), n) for k, n in numbered if k.isdigit()) if keep else ():
            _layer2_only(name)
            self.bridges.append((name, socket.if_nametoindex(name)))
        _without_ipv6(self.bridge)
        with contextlib.suppress(OSError):
            Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        self.firewall = Firewall(self.tag, self.bridge, str(self.subnet), self.port_prefix,
                                 self.trunk_prefix, self.bridge_mac())
        self.firewall.install()

    def _leaf(self, k: int | str) -> str:
        return f"{self.bridge}x{k}"

    def bridge_mac(self, leaf: int = 0) -> str:
        """A fixed, locally administered MAC for the hub (sandboxes' ports are
        ``02:bb:<address>``; the hub's ``02:bc:<tag>``, a leaf's ``02:bd:…``, never the
        same). Without one a bridge takes its ports' lowest, which changes as
        sandboxes come and go."""
        seed = self.tag + (f"x{leaf}" if leaf else "")
        digits = f"{zlib.crc32(seed.encode()):08x}"
        prefix = "02:bd:" if leaf else "02:bc:"
        return prefix + ":".join(digits[i:i + 2] for i in range(0, 8, 2))

    async def sweep(self, *, bridge_too: bool, keep: set[str] = frozenset()) -> list[str]:
        """Delete this daemon's ports (and bridges, trunks) left on the host, but those in
        ``keep``. Returns the host's link names before."""
        names = (await self.helper.call("links"))["names"]
        mine = [n for n in names if n.startswith(self.port_prefix) and n not in keep]
        if bridge_too:
            mine += [n for n in names if n.startswith(self.trunk_prefix)]
            mine += [n for n in names if n.startswith(self._leaf(""))]
            mine += [n for n in names if n == self.bridge]
        if mine:
            await self.helper.call("unplug", names=mine)
        return names

    def loads(self, taken: Mapping[int, int]) -> dict[int, int]:
        """Ports per bridge (index -> count, hub first): the kernel's count or ``taken``
        (ports leased for it), whichever is more. Read once per decision: each count is a
        listing of up to a thousand sysfs entries."""
        return {index: max(_ports_on(name), taken.get(index, 0)) for name, index in self.bridges}

    def bridge_with_room(self, loads: Mapping[int, int]) -> int | None:
        """The index of the first bridge with fewer ports than it takes (by :meth:`loads`);
        None if every bridge is full."""
        return next((index for index, load in loads.items() if load < self.ports_per_bridge),
                    None)

    def room(self, loads: Mapping[int, int]) -> int:
        """How many more ports the bridges take."""
        return sum(max(0, self.ports_per_bridge - load) for load in loads.values())

    def wants_bridge(self, loads: Mapping[int, int]) -> bool:
        """Whether the newest bridge is full enough that the next should be made now."""
        return loads[self.bridges[-1][1]] >= GROW_AT * self.ports_per_bridge

    async def grow(self, seen: int) -> None:
        """Make the next leaf bridge, unless one was made since the caller saw ``seen``
        bridges (another caller was first)."""
        async with self._growing:
            if len(self.bridges) != seen:
                return
            k = len(self.bridges)
            hub_end, leaf_end = f"{self.trunk_prefix}h{k}", f"{self.trunk_prefix}l{k}"
            reply = await self.helper.call("leaf", name=self._leaf(k), mac=self.bridge_mac(k),
                                           hub=self.bridge_index, hub_end=hub_end,
                                           leaf_end=leaf_end)
            for name in (hub_end, leaf_end):
                _without_ipv6(name)
            _layer2_only(self._leaf(k))
            self.bridges.append((self._leaf(k), reply["index"]))

    def bridge_of(self, port: str) -> int:
        """The index of the bridge ``port`` is on (a kept sandbox's), the hub's if unknown."""
        with contextlib.suppress(OSError):
            return socket.if_nametoindex(os.path.basename(
                os.readlink(f"/sys/class/net/{port}/master")))
        return self.bridge_index

    def plug_messages(self, port: str, mac: str, address: str,
                      bridge: int | None = None) -> msgs.PlugMessages:
        """A port's plug, encoded now (when it is prepared) instead of at the fork; on the
        bridge of index ``bridge`` (the hub's by default)."""
        return msgs.plug_messages(port, mac, address, self.subnet.prefixlen, self.gateway,
                                  self.bridge_index if bridge is None else bridge)

    async def plug(self, port: str, mac: str, address: str, wire: msgs.PlugMessages,
                   netns_fd: int) -> dict:
        """``port`` on its bridge, its peer ``eth0`` with ``address`` in ``netns_fd``
        (consumed); ``wire`` is the port's :meth:`plug_messages`. If its bridge has no
        port left (EXFULL: more went there than its share), the port goes on the first
        bridge with room, or on the next, made then (the reply's ``wire`` says so)."""
        try:
            try:
                return await self.helper.call("plug", [netns_fd],
                                              **self._plug_request(port, mac, address, wire))
            except NetworkError as exc:
                if exc.errno != errno.EXFULL:
                    raise
            seen, bridge = len(self.bridges), self.bridge_with_room(self.loads({}))
            if bridge is None:
                await self.grow(seen)
                bridge = self.bridges[-1][1]
            wire = self.plug_messages(port, mac, address, bridge)
            reply = await self.helper.call("plug", [netns_fd],
                                           **self._plug_request(port, mac, address, wire))
            return {**reply, "wire": wire}  # where it went, for the caller's books
        finally:
            os.close(netns_fd)

    async def plug_each(self, netns_fds: list[int],
                        ports: list[tuple[str, str, str, msgs.PlugMessages]]) -> None:
        """Plug each port (name, MAC, address, its plug_messages) into the namespace at the
        same place of ``netns_fds`` (not consumed), through the maker helper."""
        await self.maker.call("plug_each", netns_fds, ports=[
            self._plug_request(*port) for port in ports])

    def _plug_request(self, port: str, mac: str, address: str,
                      wire: msgs.PlugMessages) -> dict:
        """What the helper's ``_plug`` takes for one port."""
        return {"port": port, "mac": mac, "address": address, "prefix": self.subnet.prefixlen,
                "gateway": self.gateway, "bridge": wire.bridge,
                "veth": wire.veth.data.hex(), "inside": wire.inside.data.hex(),
                "ok": wire.inside.ok}

    async def readdress(self, netns_fd: int, old: str, new: str, *,
                        forget: bool = True) -> None:
        """Inside the namespace ``netns_fd`` (consumed), ``eth0`` drops ``old`` for ``new``;
        the host then forgets which MAC held ``new`` unless ``forget`` is false (the
        caller calls :meth:`forget` once the port that holds it changed)."""
        try:
            await self.helper.call("readdr", [netns_fd], old=old, new=new,
                                   prefix=self.subnet.prefixlen, gateway=self.gateway,
                                   bridge=self.bridge_index, forget=forget)
        finally:
            os.close(netns_fd)

    def forget(self, address: str) -> None:
        """The host forgets which MAC held ``address`` on the bridge (it moved). Sent here,
        not through the helper: the kernel handles a host-side neighbour message within
        the send (~30 µs), where a helper round trip takes 0.6-1.4 ms."""
        if self._host_netlink is None:
            self._host_netlink = Netlink()
            # The ack is queued within the send; a missing one must not hang the loop.
            self._host_netlink.sock.settimeout(1.0)
        self._host_netlink.send(msgs.forget_neighbour(self.bridge_index, address))

    async def unplug(self, ports: list[str]) -> None:
        if ports:
            await self.helper.call("unplug", names=ports)

    def _close_helpers(self) -> None:
        for helper in (self.helper, self.maker):
            if helper is not None:
                helper.close()
        self.helper = self.maker = None
        if self._host_netlink is not None:
            self._host_netlink.close()
            self._host_netlink = None

    def detach(self) -> None:
        """Let go of the helpers and the firewall's library, leaving everything in place."""
        if self.firewall is not None:
            self.firewall.nft.close()
        self._close_helpers()

    async def stop(self) -> None:
        """Remove the bridges, every port, trunk and the firewall."""
        if self.helper is None:
            return
        try:
            await self.sweep(bridge_too=True)
        finally:
            if self.firewall is not None:
                self.firewall.remove()
                self.firewall.nft.close()
            self._close_helpers()


def _ports_on(bridge: str) -> int:
    """How many ports the kernel has on ``bridge`` now."""
    try:
        return len(os.listdir(f"/sys/class/net/{bridge}/brif"))
    except OSError:
        return 0


def _without_ipv6(link: str) -> None:
    """No IPv6 on a link of ours: sandboxes are IPv4 only, and a link-local address
    would talk on their segment."""
    with contextlib.suppress(OSError):
        Path(f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6").write_text("1")


# A leaf bridge carries frames and nothing else: the host's IPv4 is on the hub. Without
# these the leaf's own device is an IPv4 interface no rule of ours names: it answers
# ARP for the gateway (any local address, by default) with its own MAC, so a sandbox's
# traffic would enter the host through it, past the egress policy and the rules that
# keep host services out (the firewall also drops what arrives on a leaf).
_LEAF_IPV4 = {"arp_ignore": "8", "rp_filter": "1", "forwarding": "0"}


def _layer2_only(leaf: str) -> None:
    _without_ipv6(leaf)
    for name, value in _LEAF_IPV4.items():
        Path(f"/proc/sys/net/ipv4/conf/{leaf}/{name}").write_text(value)
