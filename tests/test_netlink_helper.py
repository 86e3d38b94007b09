"""The netlink helper's plug with messages encoded ahead (runtime.netlink_msgs), against
real namespaces: a process that sits in a fresh network namespace stands for a fork child.

What must hold: the child's ``eth0`` gets its address and default route from the
prepared messages, also when ifindex 2 is already taken there (the fallback re-encodes
them), and the helper keeps no fd of the child's namespace once the plug is done (its
reserved slot would otherwise keep the namespace alive after the child dies)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import ipaddress
import operator
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from pyroute2.netlink.rtnl import RTM_DELLINK, RTM_NEWLINK

from branchbox.runtime import netlink_msgs
from branchbox.runtime.netlink_helper import Netlink
from branchbox.runtime.network import Helper, Network, NetworkError

SUBNET = ipaddress.ip_network("10.251.0.0/24")  # routed nowhere else: the bridge is ours


@contextlib.contextmanager
def _holder(make_dummy: bool) -> Iterator[subprocess.Popen]:
    """A process in a fresh network namespace; with a bridge link first if asked (it
    takes ifindex 2, the one the prepared veth message asks for)."""
    code = ("import sys, time\n"
            "if sys.argv[1] == '1':\n"
            "    from pyroute2 import IPRoute\n"
            "    IPRoute().link('add', ifname='d0', kind='bridge')\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen(["unshare", "-n", sys.executable, "-c", code,
                             "1" if make_dummy else "0"], stdout=subprocess.PIPE, text=True)
    with proc:
        try:
            assert proc.stdout.readline().strip() == "ready", "the namespace holder failed"
            yield proc
        finally:
            proc.kill()


@contextlib.asynccontextmanager
async def _network() -> AsyncIterator[Network]:
    """A helper and a bridge of this test's own (no firewall: nothing is sent); on the
    running loop, which the helper's client binds to."""
    net = Network(uuid.uuid4().hex[:4])
    net.helper = net.maker = Helper()
    net.subnet = SUBNET
    net.gateway = str(SUBNET.network_address + 1)
    try:
        net.bridge_index = (await net.helper.call(
            "bridge", name=net.bridge, address=net.gateway, prefix=SUBNET.prefixlen,
            mac=net.bridge_mac()))["index"]
        net.bridges = [(net.bridge, net.bridge_index)]
        yield net
    finally:
        await net.sweep(bridge_too=True)
        net.helper.close()


async def _plug(net: Network, pid: int, n: int) -> dict:
    port, address = f"{net.port_prefix}{n}", str(SUBNET.network_address + n)
    mac = "02:bb:" + ":".join(f"{b:02x}" for b in ipaddress.IPv4Address(address).packed)
    wire = net.plug_messages(port, mac, address)
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    return await net.plug(port, mac, address, wire, fd)


def _inside(pid: int) -> tuple[set[str], list[tuple[str, str]]]:
    """The namespace of ``pid`` as its /proc/net shows it: local IPv4 addresses, and
    (interface, gateway) of its default routes."""
    trie = Path(f"/proc/{pid}/net/fib_trie").read_text().splitlines()
    local = {trie[i - 1].split()[-1] for i, line in enumerate(trie) if "/32 host LOCAL" in line}
    defaults = []
    for line in Path(f"/proc/{pid}/net/route").read_text().splitlines()[1:]:
        iface, dest, gateway = line.split()[:3]
        if dest == "00000000":
            defaults.append((iface, socket.inet_ntoa(int(gateway, 16).to_bytes(4, "little"))))
    return local, defaults


def _netns_fds(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("net:"):
            found.add(target)
    return found


@pytest.mark.parametrize("index_taken", [False, True], ids=["fresh", "ifindex-2-taken"])
def test_plug_with_prepared_messages(index_taken: bool) -> None:
    async def scenario(pid: int) -> None:
        async with _network() as net:
            reply = await _plug(net, pid, 7)
            local, defaults = _inside(pid)
            assert str(SUBNET.network_address + 7) in local, local
            assert defaults == [("eth0", net.gateway)], defaults
            assert set(reply["steps"]) == {"decode", "veth", "setns_in", "socket",
                                           "configure", "setns_out"}
            child_ns = f"net:[{os.stat(f'/proc/{pid}/ns/net').st_ino}]"
            assert child_ns not in _netns_fds(net.helper.proc.pid), \
                "the helper still holds the child's namespace after the plug"
    with _holder(index_taken) as holder:
        asyncio.run(scenario(holder.pid))


def test_sequence_numbers_are_stamped_per_message() -> None:
    batch = netlink_msgs.configure(2, "10.251.0.9", 24, "10.251.0.1")
    data, seqs = batch.stamp(41)
    assert seqs == [41, 42, 43, 44]  # lo up, eth0 up, its address, the default route
    offset, seen = 0, []
    while offset < len(data):
        length = int.from_bytes(data[offset:offset + 4], "little")
        seen.append(int.from_bytes(data[offset + 8:offset + 12], "little"))
        offset += length
    assert seen == seqs and offset == len(data)
    assert int.from_bytes(batch.data[8:12], "little") == 0  # the prepared bytes stay as they are


def test_a_failed_message_of_a_batch_is_reported() -> None:
    """An address on a link that does not exist: the batch's error comes back as such."""
    async def scenario(pid: int) -> None:
        async with _network() as net:
            port, mac = f"{net.port_prefix}9", "02:bb:0a:fb:00:09"
            wire = netlink_msgs.PlugMessages(
                netlink_msgs.veth(port, net.bridge_index, mac),
                netlink_msgs.configure(99, "10.251.0.9", 24, net.gateway), net.bridge_index)
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            with pytest.raises(NetworkError, match="No such device"):
                await net.plug(port, mac, "10.251.0.9", wire, fd)
    with _holder(False) as holder:
        asyncio.run(scenario(holder.pid))


def test_a_bridge_that_is_full_has_the_next_made_and_the_port_goes_there() -> None:
    """The kernel takes 1023 ports per bridge. A plug it refuses (EXFULL: more ports went
    on a leaf than its share) goes on the first bridge with room, or, when none has, on
    the next leaf, made then and joined to the hub by a trunk; addressed as ever."""
    async def scenario(pid: int) -> None:
        async with _network() as net:
            await net.grow(1)
            _, leaf = net.bridges[1]
            with _full(net, leaf):
                for n, share, bridge in ((7, 900, net.bridge), (8, 1, f"{net.bridge}x2")):
                    net.ports_per_bridge = share  # 1: the hub (its trunk) has no room
                    port, mac = f"{net.port_prefix}{n}", f"02:bb:0a:fb:00:{n:02x}"
                    address = str(SUBNET.network_address + n)
                    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                    await net.plug(port, mac, address,
                                   net.plug_messages(port, mac, address, leaf), fd)
                    assert _master(port) == bridge
                    assert address in _inside(pid)[0]
                    await net.unplug([port])  # one eth0 per namespace
            assert [name for name, _ in net.bridges] == [
                net.bridge, f"{net.bridge}x1", f"{net.bridge}x2"]
            assert _master(f"{net.trunk_prefix}l2") == f"{net.bridge}x2"
            assert _master(f"{net.trunk_prefix}h2") == net.bridge
    with _holder(False) as holder:
        asyncio.run(scenario(holder.pid))


def _master(link: str) -> str:
    return os.path.basename(os.readlink(f"/sys/class/net/{link}/master"))


FILL_GROUP = 0xBB5  # the filler links' group: deleted together (one by one, each waits
                    # ~17 ms for RCU: 17 s for a bridge's worth)


@contextlib.contextmanager
def _full(net: Network, bridge: int) -> Iterator[None]:
    """The bridge ``bridge`` full (its trunk and 1022 veth pairs' ends), for the block."""
    nl = Netlink()
    try:
        pairs = [netlink_msgs.trunk(f"{net.port_prefix}d{i}", bridge, f"{net.port_prefix}e{i}")
                 for i in range(1022)]
        grouped = [_in_group(f"{net.port_prefix}d{i}") for i in range(1022)]
        for first in range(0, len(pairs), 64):
            nl.send(functools.reduce(operator.add, pairs[first:first + 64]))
            nl.send(functools.reduce(operator.add, grouped[first:first + 64]))
        with pytest.raises(OSError) as refused:
            nl.send(netlink_msgs.trunk(f"{net.port_prefix}d1022", bridge,
                                       f"{net.port_prefix}e1022"))
        assert refused.value.errno == errno.EXFULL
        yield
    finally:
        message = netlink_msgs._link()
        message["attrs"] = [("IFLA_GROUP", FILL_GROUP)]
        nl.send(netlink_msgs._encoded(message, RTM_DELLINK, netlink_msgs.ACK))
        nl.close()


def _in_group(name: str) -> netlink_msgs.Batch:
    message = netlink_msgs._link()
    message["attrs"] = [("IFLA_IFNAME", name), ("IFLA_GROUP", FILL_GROUP)]
    return netlink_msgs._encoded(message, RTM_NEWLINK, netlink_msgs.ACK)


def test_plug_each_plugs_every_namespace_given() -> None:
    """op_plug_each (namespaces made ahead): each namespace gets its port's address, the
    default route and loopback up; the helper keeps none of them."""
    async def scenario(pids: list[int]) -> None:
        async with _network() as net:
            ports, fds = [], []
            for n, pid in zip((11, 12), pids, strict=True):
                port, address = f"{net.port_prefix}{n}", str(SUBNET.network_address + n)
                mac = "02:bb:" + ":".join(f"{b:02x}" for b in ipaddress.IPv4Address(
                    address).packed)
                ports.append((port, mac, address, net.plug_messages(port, mac, address)))
                fds.append(os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC))
            try:
                await net.plug_each(fds, ports)
            finally:
                for fd in fds:
                    os.close(fd)
            for pid, (_, _, address, _) in zip(pids, ports, strict=True):
                local, defaults = _inside(pid)
                assert local == {address, "127.0.0.1"}, local  # lo is up too
                assert defaults == [("eth0", net.gateway)], defaults
                child_ns = f"net:[{os.stat(f'/proc/{pid}/ns/net').st_ino}]"
                assert child_ns not in _netns_fds(net.maker.proc.pid)
    with _holder(False) as one, _holder(False) as two:
        asyncio.run(scenario([one.pid, two.pid]))


AT_THE_SLOT = """
import asyncio, os
from pathlib import Path
from branchbox.runtime.netlink_msgs import NETNS_SLOT
from branchbox.runtime.network import Helper
while (fd := os.open(os.devnull, os.O_RDONLY)) < NETNS_SLOT - 1:
    pass  # a fresh process: every fd below the slot is taken now
os.close(fd)  # the socket pair takes the slot's number and the one below it
helper = Helper()
given = Path(f"/proc/{helper.proc.pid}/cmdline").read_bytes().split(b"\\0")[-2]
print(int(given), "lo" in asyncio.run(helper.call("links"))["names"])
helper.close()
"""


def test_a_helper_given_its_socket_at_the_reserved_slot_still_answers() -> None:
    """The helper's socket keeps the daemon's fd number (pass_fds), and a daemon holding
    ~200 fds hands it fd 200, the slot the helper reserves for a request's namespace:
    the helper overwrote its own socket there and exited at its first request, silently
    ("the netlink helper died" at an engine's start). A process of its own, whose fds
    this test controls."""
    run = subprocess.run([sys.executable, "-c", AT_THE_SLOT], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [str(netlink_msgs.NETNS_SLOT), "True"], run.stdout
