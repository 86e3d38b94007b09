"""The daemon's netlink helper: one single-threaded process that may change its netns.

Addresses and routes can only be set through a netlink socket that lives in the
sandbox's network namespace, and a socket lives in the namespace of the thread
that made it. The daemon is threaded and must never change namespace, and a
throwaway child per request (pyroute2's ``NetNS``) costs milliseconds. So the
daemon starts this process once: it takes one request at a time from a
SOCK_SEQPACKET socket (a JSON header, and a netns fd over SCM_RIGHTS), does
``setns`` into the sandbox's namespace, sends a few netlink messages there and
goes back to the host's namespace.

Messages are built with pyroute2's marshalling classes (``runtime.netlink_msgs``)
and sent on a plain netlink socket: pyroute2's ``IPRoute`` runs an asyncio core
per call, ~1 ms a message here, where the kernel needs ~0.1 ms. A plug's
messages come encoded by the daemon when it prepared the port, and the three
messages inside the namespace go in one datagram.

Why a veth is *created* into the child's namespace (the peer made there with
``IFLA_NET_NS_FD``) instead of prepared ahead and moved: moving a device
between namespaces waits for RCU grace periods (16-40 ms a move on this
2-vCPU host), creating one across namespaces does not (~1 ms).

Namespaces made ahead (``op_plug_each``): a fork child joins a namespace that
is already plugged and addressed instead of making its own, so its network
costs the fork nothing. A fork child may join only a namespace owned by its
family's user namespace, so the family's launcher makes them
(``family_init``) and this helper plugs them like any other.
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

from branchbox.runtime import netlink_msgs as msgs

CLONE_NEWNET = 0x40000000
FDS_MAX = 64  # namespaces one request may carry (op_plug_each)
_libc = ctypes.CDLL(None, use_errno=True)


class Netlink:
    """A route netlink socket of the namespace current at creation; one batch at a time."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        self.sock.bind((0, 0))
        self.seq = 0

    def send(self, batch: msgs.Batch) -> None:
        """Send ``batch`` in one datagram and wait for every message's ack; the first
        errno not in that message's ``ok`` is raised (the kernel still handles the rest)."""
        data, seqs = batch.stamp(self.seq + 1)
        self.seq = seqs[-1]
        self.sock.send(data)
        waiting = dict(zip(seqs, batch.ok, strict=True))
        failed = 0
        while waiting:
            data = self.sock.recv(65536)
            offset = 0
            while offset + 16 <= len(data):
                length, kind, _, seq, _ = struct.unpack_from("=IHHII", data, offset)
                if kind == 2 and seq in waiting:  # NLMSG_ERROR carries the ack
                    err = -struct.unpack_from("=i", data, offset + 16)[0]
                    if err and err not in waiting[seq] and not failed:
                        failed = err
                    del waiting[seq]
                offset += (max(length, 16) + 3) & ~3
        if failed:
            raise OSError(failed, os.strerror(failed))

    def close(self) -> None:
        self.sock.close()


def _setns(fd: int, nstype: int = CLONE_NEWNET) -> None:
    if _libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Helper:
    def __init__(self) -> None:
        self.host_ns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self.host = Netlink()
        # Reserved: a request's netns fd is dup2'ed here, where the pre-encoded
        # messages name it (netlink_msgs.NETNS_SLOT).
        os.dup2(self.host_ns, msgs.NETNS_SLOT, inheritable=False)

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
        self.host.send(msgs.bridge(req["name"], req["mac"]))
        index = socket.if_nametoindex(req["name"])
        self.host.send(msgs.link_up(index) + msgs.address(
            index, req["address"], req["prefix"], ok=(17,)))  # EEXIST: a restarted daemon's
        return {"index": index}

    def op_leaf(self, req: dict, fds: list[int]) -> dict:
        """A leaf bridge (no address) joined to the hub by a veth pair, both ends up."""
        self.host.send(msgs.bridge(req["name"], req["mac"]))
        index = socket.if_nametoindex(req["name"])
        self.host.send(msgs.trunk(req["hub_end"], req["hub"], req["leaf_end"]))
        self.host.send(msgs.enslave(socket.if_nametoindex(req["leaf_end"]), index))
        return {"index": index}

    @contextlib.contextmanager
    def _in_slot(self, netns_fd: int):
        """``netns_fd`` at the slot the pre-encoded messages name, for the ``with`` block;
        then the host's again: the slot must not keep a child's namespace alive."""
        os.dup2(netns_fd, msgs.NETNS_SLOT, inheritable=False)
        try:
            yield
        finally:
            os.dup2(self.host_ns, msgs.NETNS_SLOT, inheritable=False)

    def op_plug(self, req: dict, fds: list[int]) -> dict:
        """A veth pair: ``port`` on the bridge, up; its peer ``eth0`` made directly in the
        namespace ``fds[0]``, then (inside) up, its address and the default route.

        The messages come encoded (``req["veth"]``, ``req["inside"]``: netlink_msgs);
        ``steps`` in the reply is each step's time in ns, for the bench."""
        t0 = time.perf_counter_ns()
        with self._in_slot(fds[0]):
            t = [t0, *self._plug(req, fds[0])]
        return {"steps": {step: t[i + 1] - t[i] for i, step in enumerate(
            ("decode", "veth", "setns_in", "socket", "configure", "setns_out"))}}

    def _plug(self, req: dict, netns_fd: int) -> list[int]:
        """op_plug's steps; the clock after each."""
        veth = msgs.Batch(bytes.fromhex(req["veth"]), ((),))
        inside = msgs.Batch(bytes.fromhex(req["inside"]), tuple(map(tuple, req["ok"])))
        t1 = time.perf_counter_ns()
        try:
            self.host.send(veth)
        except OSError as exc:
            if exc.errno not in (16, 17):  # EBUSY/EEXIST: ifindex 2 is taken there
                raise
            self.host.send(msgs.veth(req["port"], req["bridge"], req["mac"], peer_index=0))
        t2 = time.perf_counter_ns()
        _setns(netns_fd)
        try:
            t3 = time.perf_counter_ns()
            nl = Netlink()
            t4 = time.perf_counter_ns()
            try:
                # The prepared messages name ifindex 2; some kernels give the peer another
                # one without an error when 2 is taken (never in a fresh namespace).
                index = socket.if_nametoindex("eth0")
                if index != msgs.PEER_INDEX:
                    inside = msgs.configure(index, req["address"], req["prefix"],
                                            req["gateway"])
                nl.send(inside)
            finally:
                nl.close()
            t5 = time.perf_counter_ns()
        finally:
            _setns(self.host_ns)
        return [t1, t2, t3, t4, t5, time.perf_counter_ns()]

    def op_plug_each(self, req: dict, fds: list[int]) -> dict:
        """op_plug for each namespace of ``fds`` with the port of ``req["ports"]`` at the
        same place: namespaces a family's launcher made ahead (engine.networking)."""
        for netns, port in zip(fds, req["ports"], strict=True):
            with self._in_slot(netns):
                self._plug(port, netns)
        return {}

    def op_readdr(self, req: dict, fds: list[int]) -> dict:
        """Inside ``fds[0]``: ``eth0`` drops ``old`` and takes ``new`` (a merged winner
        takes its parent's address); the default route goes with the address. Then the
        host forgets which MAC held ``new`` on the bridge (it moved): one round trip.
        With ``forget`` false the daemon forgets later (``Network.forget``), once the
        firewall lets the new holder speak (a restore readdresses ahead)."""
        with self.inside(fds[0]) as nl:
            index = socket.if_nametoindex("eth0")
            nl.send(msgs.address(index, req["old"], req["prefix"], delete=True, ok=(99,))
                    + msgs.address(index, req["new"], req["prefix"], ok=(17,))
                    + msgs.default_route(index, req["gateway"], ok=(17,)))
        if req.get("forget", True):
            self.host.send(msgs.forget_neighbour(req["bridge"], req["new"]))
        return {}

    def op_unplug(self, req: dict, fds: list[int]) -> dict:
        """Delete host-side links by name (the peer goes with each); gone ones are fine."""
        for name in req["names"]:
            self.host.send(msgs.delete_link(name))
        return {}

    def op_links(self, req: dict, fds: list[int]) -> dict:
        """Names of the host's links (for sweeping what an earlier daemon left)."""
        return {"names": [name for _, name in socket.if_nameindex()]}


def main() -> None:
    """Serve requests on fd ``argv[1]`` until it closes."""
    fd = int(sys.argv[1])
    if fd == msgs.NETNS_SLOT:  # the daemon's number for it, kept by pass_fds: the
        fd = os.dup(fd)  # slot is reserved below (a socket there would be overwritten)
    sock = socket.socket(fileno=fd)
    helper = Helper()
    idle_since = 0  # perf_counter_ns (CLOCK_MONOTONIC, the daemon's clock too)
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 65536, FDS_MAX)
        except OSError:
            return
        if not data:
            return
        received = time.perf_counter_ns()
        req = json.loads(data)
        try:
            reply = {"ok": True, **getattr(helper, "op_" + req["op"])(req, fds)}
        except OSError as exc:
            reply = {"ok": False, "errno": exc.errno, "error": f"{req['op']}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - reported to the daemon, never fatal here
            reply = {"ok": False, "errno": 0, "error": f"{req['op']}: {exc!r}"}
        finally:
            for fd in fds:
                os.close(fd)
        # For the bench: how long the request took to get here, not counting the time
        # it queued behind others, and when the answer left.
        reply["arrival"] = received - max(req.get("sent", received), idle_since)
        reply["replied"] = time.perf_counter_ns()
        sock.send(json.dumps({"id": req.get("id"), **reply}).encode())
        idle_since = time.perf_counter_ns()


if __name__ == "__main__":
    main()
