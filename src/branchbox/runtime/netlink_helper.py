"""The daemon's netlink helper: one single-threaded process that may change its netns.

Addresses and routes can only be set through a netlink socket that lives in the
sandbox's network namespace, and a socket lives in the namespace of the thread
that made it. The daemon is threaded and must never change namespace, and a
throwaway child per request (pyroute2's ``NetNS``) costs milliseconds. So the
daemon starts this process once: it takes one request at a time from a
SOCK_SEQPACKET socket (a JSON header, and a netns fd over SCM_RIGHTS), does
``setns`` into the sandbox's namespace, sends a few netlink messages there and
goes back to the host's namespace.

Messages are built with pyroute2's marshalling classes and sent on a plain
netlink socket: pyroute2's ``IPRoute`` runs an asyncio core per call, ~1 ms a
message here, where the kernel needs ~0.1 ms.

Why a veth is *created* into the child's namespace (the peer made there with
``IFLA_NET_NS_FD``) instead of prepared ahead and moved: moving a device
between namespaces waits for RCU grace periods (16-40 ms a move on this
2-vCPU host), creating one across namespaces does not (~1 ms).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import struct
import sys
import time

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

CLONE_NEWNET = 0x40000000
IFF_UP = 1
PEER_INDEX = 2  # eth0's ifindex inside a fresh namespace (ifindexes are per namespace)
_NEW = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
_libc = ctypes.CDLL(None, use_errno=True)


class Netlink:
    """A route netlink socket of the namespace current at creation; one request at a time."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        self.sock.bind((0, 0))
        self.seq = 0

    def request(self, msg, msg_type: int, flags: int = NLM_F_REQUEST | NLM_F_ACK,
                ok: tuple[int, ...] = ()) -> None:
        """Send ``msg`` and wait for its ack; an errno in ``ok`` counts as success."""
        self.seq += 1
        msg["header"]["type"] = msg_type
        msg["header"]["flags"] = flags
        msg["header"]["sequence_number"] = self.seq
        msg.encode()
        self.sock.send(msg.data)
        while True:
            data = self.sock.recv(65536)
            _, kind, _, seq, _ = struct.unpack_from("=IHHII", data)
            if seq == self.seq and kind == 2:  # NLMSG_ERROR carries the ack
                err = -struct.unpack_from("=i", data, 16)[0]
                if err and err not in ok:
                    raise OSError(err, os.strerror(err))
                return

    def close(self) -> None:
        self.sock.close()


def _link(index: int = 0, **fields) -> ifinfmsg:
    msg = ifinfmsg()
    msg["index"] = index
    for key, value in fields.items():
        msg[key] = value
    return msg


def _addr(index: int, address: str, prefix: int) -> ifaddrmsg:
    msg = ifaddrmsg()
    msg["family"], msg["prefixlen"], msg["index"] = socket.AF_INET, prefix, index
    msg["attrs"] = [("IFA_LOCAL", address), ("IFA_ADDRESS", address)]
    return msg


def _default_route(index: int, gateway: str) -> rtmsg:
    msg = rtmsg()
    msg["family"], msg["table"], msg["proto"], msg["scope"], msg["type"] = (
        socket.AF_INET, 254, 4, 0, 1)  # main table, static, universe, unicast
    msg["attrs"] = [("RTA_GATEWAY", gateway), ("RTA_OIF", index)]
    return msg


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Helper:
    def __init__(self) -> None:
        self.host_ns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self.host = Netlink()

    @contextlib.contextmanager
    def inside(self, netns_fd: int):
        """A netlink socket of the namespace ``netns_fd``; back to the host's afterwards."""
        _setns(netns_fd)
        try:
            nl = Netlink()
            try:
                yield nl
            finally:
                nl.close()
        finally:
            _setns(self.host_ns)

    def op_bridge(self, req: dict, fds: list[int]) -> dict:
        """Create the bridge (if missing) with a MAC of its own, give it the gateway
        address, bring it up. A bridge without a set MAC takes its ports' lowest, which
        changes as sandboxes come and go: their ARP caches would point at a MAC the
        bridge no longer answers to, and their traffic would stall."""
        msg = _link(flags=IFF_UP, change=IFF_UP)
        msg["attrs"] = [("IFLA_IFNAME", req["name"]), ("IFLA_ADDRESS", req["mac"]),
                        ("IFLA_LINKINFO", {"attrs": [("IFLA_INFO_KIND", "bridge")]})]
        self.host.request(msg, RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE)
        index = socket.if_nametoindex(req["name"])
        self.host.request(_link(index, flags=IFF_UP, change=IFF_UP), RTM_NEWLINK)
        self.host.request(_addr(index, req["address"], req["prefix"]), RTM_NEWADDR, _NEW,
                          ok=(17,))  # EEXIST: a restarted daemon's bridge
        return {"index": index}

    def op_plug(self, req: dict, fds: list[int]) -> dict:
        """A veth pair: ``port`` on the bridge, up; its peer ``eth0`` made directly in the
        namespace ``fds[0]`` with ``mac``, then (inside) up, ``address`` and the default
        route through ``gateway``."""
        peer = {"index": PEER_INDEX, "attrs": [("IFLA_IFNAME", "eth0"),
                                                ("IFLA_ADDRESS", req["mac"]),
                                                ("IFLA_NET_NS_FD", fds[0])]}
        msg = _link(flags=IFF_UP, change=IFF_UP)
        msg["attrs"] = [
            ("IFLA_IFNAME", req["port"]), ("IFLA_MASTER", req["bridge"]),
            ("IFLA_LINKINFO", {"attrs": [
                ("IFLA_INFO_KIND", "veth"),
                ("IFLA_INFO_DATA", {"attrs": [("VETH_INFO_PEER", peer)]})]})]
        index = PEER_INDEX
        try:
            self.host.request(msg, RTM_NEWLINK, _NEW)
        except OSError as exc:
            if exc.errno != 17:  # index 2 taken in that namespace: let the kernel pick
                raise
            peer["index"] = 0
            self.host.request(msg, RTM_NEWLINK, _NEW)
            index = 0
        with self.inside(fds[0]) as nl:
            if index == 0:
                index = socket.if_nametoindex("eth0")
            nl.request(_link(index, flags=IFF_UP, change=IFF_UP), RTM_NEWLINK)
            nl.request(_addr(index, req["address"], req["prefix"]), RTM_NEWADDR, _NEW)
            nl.request(_default_route(index, req["gateway"]), RTM_NEWROUTE, _NEW)
        return {}

    def op_readdr(self, req: dict, fds: list[int]) -> dict:
        """Inside ``fds[0]``: ``eth0`` drops ``old`` and takes ``new`` (a merged winner
        takes its parent's address); the default route goes with the address."""
        with self.inside(fds[0]) as nl:
            index = socket.if_nametoindex("eth0")
            nl.request(_addr(index, req["old"], req["prefix"]), RTM_DELADDR, ok=(99,))
            nl.request(_addr(index, req["new"], req["prefix"]), RTM_NEWADDR, _NEW, ok=(17,))
            nl.request(_default_route(index, req["gateway"]), RTM_NEWROUTE, _NEW, ok=(17,))
        return {}

    def op_forget_neighbour(self, req: dict, fds: list[int]) -> dict:
        """The host forgets which MAC held ``address`` on the bridge (it moved)."""
        msg = ndmsg()
        msg["family"], msg["ifindex"] = socket.AF_INET, req["bridge"]
        msg["attrs"] = [("NDA_DST", req["address"])]
        self.host.request(msg, RTM_DELNEIGH, ok=(2,))
        return {}

    def op_unplug(self, req: dict, fds: list[int]) -> dict:
        """Delete host-side links by name (the peer goes with each); gone ones are fine."""
        for name in req["names"]:
            msg = _link()
            msg["attrs"] = [("IFLA_IFNAME", name)]
            self.host.request(msg, RTM_DELLINK, ok=(19,))  # ENODEV
        return {}

    def op_links(self, req: dict, fds: list[int]) -> dict:
        """Names of the host's links (for sweeping what an earlier daemon left)."""
        return {"names": [name for _, name in socket.if_nameindex()]}


def main() -> None:
    """Serve requests on fd ``argv[1]`` until it closes."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    helper = Helper()
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 65536, 4)
        except OSError:
            return
        if not data:
            return
        req = json.loads(data)
        started = time.perf_counter()
        try:
            reply = {"ok": True, **getattr(helper, "op_" + req["op"])(req, fds)}
        except OSError as exc:
            reply = {"ok": False, "errno": exc.errno, "error": f"{req['op']}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - reported to the daemon, never fatal here
            reply = {"ok": False, "errno": 0, "error": f"{req['op']}: {exc!r}"}
        finally:
            for fd in fds:
                os.close(fd)
        reply["took"] = time.perf_counter() - started  # for the bench's network rows
        sock.send(json.dumps({"id": req.get("id"), **reply}).encode())


if __name__ == "__main__":
    main()
