"""The netlink messages of the sandbox network, encoded with pyroute2 ahead of use.

pyroute2's marshalling is pure Python: encoding the veth message of a plug
costs ~0.5 ms on this host, the link/address/route messages ~0.1-0.25 ms each,
about as much as the kernel's own work for them. None of it depends on the
fork instant except two numbers, so the daemon encodes a port's messages when
it prepares the port (off the fork path) and the netlink helper only patches:

* the sequence numbers (``Batch.stamp``);
* the child's namespace: ``IFLA_NET_NS_FD`` is always :data:`NETNS_SLOT`, a fd
  number the helper keeps reserved and ``dup2``\\ s each request's netns fd onto.

A batch is several messages in one datagram: the kernel handles them in turn
in one ``send`` and acks each.
"""

from __future__ import annotations

import functools
import socket
import struct
from dataclasses import dataclass

from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST
from pyroute2.netlink.rtnl import (
    RTM_DELADDR,
    RTM_DELLINK,
    RTM_DELNEIGH,
    RTM_NEWADDR,
    RTM_NEWLINK,
    RTM_NEWROUTE,
)
from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.ndmsg import ndmsg
from pyroute2.netlink.rtnl.rtmsg import rtmsg

IFF_UP = 1
LOOPBACK_INDEX = 1
PEER_INDEX = 2  # eth0's ifindex inside a fresh namespace (ifindexes are per namespace)
NETNS_SLOT = 200  # the helper's fd number for "the namespace of this request"
ACK = NLM_F_REQUEST | NLM_F_ACK
NEW = ACK | NLM_F_CREATE | NLM_F_EXCL
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid


@dataclass(frozen=True)
class Batch:
    """Encoded messages (sequence numbers 0) and, per message, the errnos that count as
    success (EEXIST where a retry may find its own earlier work, for example)."""

    data: bytes
    ok: tuple[tuple[int, ...], ...]

    def __add__(self, other: Batch) -> Batch:
        return Batch(self.data + other.data, self.ok + other.ok)

    def stamp(self, first_seq: int) -> tuple[bytearray, list[int]]:
        """The datagram with sequence numbers ``first_seq``, ``first_seq + 1``, ... and
        those numbers."""
        out = bytearray(self.data)
        seqs, offset = [], 0
        while offset < len(out):
            length = _HEADER.unpack_from(out, offset)[0]
            struct.pack_into("=I", out, offset + 8, first_seq + len(seqs))
            seqs.append(first_seq + len(seqs))
            offset += length
        return out, seqs


def _encoded(msg, msg_type: int, flags: int, ok: tuple[int, ...] = ()) -> Batch:
    msg["header"]["type"] = msg_type
    msg["header"]["flags"] = flags
    msg.encode()
    return Batch(bytes(msg.data), (ok,))


def _link(index: int = 0, **fields) -> ifinfmsg:
    msg = ifinfmsg()
    msg["index"] = index
    for key, value in fields.items():
        msg[key] = value
    return msg


def link_up(index: int) -> Batch:
    return _encoded(_link(index, flags=IFF_UP, change=IFF_UP), RTM_NEWLINK, ACK)


def delete_link(name: str) -> Batch:
    """Delete a host link by name; a gone one (ENODEV) is fine."""
    msg = _link()
    msg["attrs"] = [("IFLA_IFNAME", name)]
    return _encoded(msg, RTM_DELLINK, ACK, ok=(19,))


def bridge(name: str, mac: str) -> Batch:
    """A bridge named ``name`` with MAC ``mac``, up (an existing one is kept)."""
    msg = _link(flags=IFF_UP, change=IFF_UP)
    msg["attrs"] = [("IFLA_IFNAME", name), ("IFLA_ADDRESS", mac),
                    ("IFLA_LINKINFO", {"attrs": [("IFLA_INFO_KIND", "bridge")]})]
    return _encoded(msg, RTM_NEWLINK, ACK | NLM_F_CREATE)


def _pair(name: str, bridge_index: int, peer: dict) -> ifinfmsg:
    """A veth pair's message: ``name`` up on the bridge, its ``peer`` as given."""
    msg = _link(flags=IFF_UP, change=IFF_UP)
    msg["attrs"] = [
        ("IFLA_IFNAME", name), ("IFLA_MASTER", bridge_index),
        ("IFLA_LINKINFO", {"attrs": [
            ("IFLA_INFO_KIND", "veth"),
            ("IFLA_INFO_DATA", {"attrs": [("VETH_INFO_PEER", peer)]})]})]
    return msg


def trunk(hub_end: str, hub_index: int, leaf_end: str) -> Batch:
    """A veth pair on the host: ``hub_end`` up on the hub bridge, ``leaf_end`` (down, no
    bridge yet: a new link's peer takes no master)."""
    return _encoded(_pair(hub_end, hub_index, {"attrs": [("IFLA_IFNAME", leaf_end)]}),
                    RTM_NEWLINK, NEW, ok=(17,))  # EEXIST: made by an earlier try


def enslave(index: int, bridge_index: int) -> Batch:
    """Link ``index`` up on the bridge ``bridge_index``."""
    msg = _link(index, flags=IFF_UP, change=IFF_UP)
    msg["attrs"] = [("IFLA_MASTER", bridge_index)]
    return _encoded(msg, RTM_NEWLINK, ACK)


def veth(port: str, bridge_index: int, mac: str, peer_index: int = PEER_INDEX) -> Batch:
    """A veth pair: ``port`` up on the bridge, its peer ``eth0`` (MAC ``mac``, ifindex
    ``peer_index``, 0: the kernel picks) created in the namespace at :data:`NETNS_SLOT`."""
    peer = {"index": peer_index, "attrs": [("IFLA_IFNAME", "eth0"), ("IFLA_ADDRESS", mac),
                                           ("IFLA_NET_NS_FD", NETNS_SLOT)]}
    return _encoded(_pair(port, bridge_index, peer), RTM_NEWLINK, NEW)


def address(index: int, addr: str, prefix: int, *, delete: bool = False,
            ok: tuple[int, ...] = ()) -> Batch:
    msg = ifaddrmsg()
    msg["family"], msg["prefixlen"], msg["index"] = socket.AF_INET, prefix, index
    msg["attrs"] = [("IFA_LOCAL", addr), ("IFA_ADDRESS", addr)]
    return _encoded(msg, RTM_DELADDR if delete else RTM_NEWADDR, ACK if delete else NEW, ok)


def default_route(index: int, gateway: str, ok: tuple[int, ...] = ()) -> Batch:
    msg = rtmsg()
    msg["family"], msg["table"], msg["proto"], msg["scope"], msg["type"] = (
        socket.AF_INET, 254, 4, 0, 1)  # main table, static, universe, unicast
    msg["attrs"] = [("RTA_GATEWAY", gateway), ("RTA_OIF", index)]
    return _encoded(msg, RTM_NEWROUTE, NEW, ok)


def forget_neighbour(bridge_index: int, addr: str) -> Batch:
    """The host's neighbour entry for ``addr`` on the bridge goes (ENOENT is fine)."""
    msg = ndmsg()
    msg["family"], msg["ifindex"] = socket.AF_INET, bridge_index
    msg["attrs"] = [("NDA_DST", addr)]
    return _encoded(msg, RTM_DELNEIGH, ACK, ok=(2,))


def configure(index: int, addr: str, prefix: int, gateway: str) -> Batch:
    """Inside a sandbox's namespace: ``lo`` up (a namespace made ahead has nobody else to
    do it), ``eth0`` (``index``) up, ``addr``, default route."""
    return (link_up(LOOPBACK_INDEX) + link_up(index) + address(index, addr, prefix)
            + default_route(index, gateway))


@dataclass(frozen=True)
class PlugMessages:
    """Everything a plug sends, encoded when the port is prepared."""

    veth: Batch
    inside: Batch
    bridge: int  # the index of the bridge the port goes on


def plug_messages(port: str, mac: str, addr: str, prefix: int, gateway: str,
                  bridge_index: int) -> PlugMessages:
    """A port's plug. Encoded once per shape (name length, bridge; prefix, gateway) by
    pyroute2 with marker values, then copied with this port's name, MAC and address in
    the markers' places: a daemon prepares a few ports per create, and pyroute2's ~1 ms
    a port was a tenth of its event loop's time under load. A shape whose markers are
    not found exactly where expected is encoded whole."""
    veth_shape = _veth_shape(len(port), bridge_index)
    inside_shape = _inside_shape(prefix, gateway)
    if veth_shape is None or inside_shape is None:
        return PlugMessages(veth(port, bridge_index, mac),
                            configure(PEER_INDEX, addr, prefix, gateway), bridge_index)
    return PlugMessages(veth_shape.filled((port.encode(), _mac_bytes(mac))),
                        inside_shape.filled((socket.inet_aton(addr),)), bridge_index)


_NAME_MARK = b"~"  # never in a port's name
_MAC_MARK = "02:7e:7e:7e:7e:7e"
_ADDR_MARK = "192.0.2.254"  # TEST-NET-1: never a sandbox's


def _mac_bytes(mac: str) -> bytes:
    return bytes.fromhex(mac.replace(":", ""))


@dataclass(frozen=True)
class _Shape:
    """An encoded batch and where its variable values go: (offset, length) per value,
    each value in one or more places."""

    batch: Batch
    places: tuple[tuple[tuple[int, int], ...], ...]

    def filled(self, values: tuple[bytes, ...]) -> Batch:
        data = bytearray(self.batch.data)
        for value, places in zip(values, self.places, strict=True):
            for offset, length in places:
                if len(value) != length:
                    raise ValueError(f"{value!r} is not {length} bytes")
                data[offset:offset + length] = value
        return Batch(bytes(data), self.batch.ok)

    @classmethod
    def of(cls, batch: Batch, marks: list[tuple[bytes, int]]) -> _Shape | None:
        """``batch`` with each of ``marks`` (bytes, how often it must occur) located; None
        if one occurs another number of times."""
        places = []
        for mark, times in marks:
            found, at = [], batch.data.find(mark)
            while at >= 0:
                found.append((at, len(mark)))
                at = batch.data.find(mark, at + 1)
            if len(found) != times:
                return None
            places.append(tuple(found))
        return cls(batch, tuple(places))


@functools.lru_cache(maxsize=256)
def _veth_shape(name_length: int, bridge_index: int) -> _Shape | None:
    name = _NAME_MARK * name_length
    return _Shape.of(veth(name.decode(), bridge_index, _MAC_MARK),
                     [(name, 1), (_mac_bytes(_MAC_MARK), 1)])


@functools.lru_cache(maxsize=16)
def _inside_shape(prefix: int, gateway: str) -> _Shape | None:
    return _Shape.of(configure(PEER_INDEX, _ADDR_MARK, prefix, gateway),
                     [(socket.inet_aton(_ADDR_MARK), 2)])
