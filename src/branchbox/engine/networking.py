"""Sandbox addresses and egress policies: leases in the daemon's SQLite, ports, policies.

Every body (the processes serving a sandbox) gets a port: a veth name, a MAC
and an address leased from the bridge's subnet. A lease is taken, and the
firewall told which (port, MAC, address) may speak, *before* the body exists —
a small pool of them is kept ready — so a fork only creates each child's veth
into its namespace and sets the address (runtime.netlink_helper). The address
belongs to the sandbox id: a merge gives the winner's body the parent's address.

Fork children go further: a family keeps network namespaces made ahead
(``Made``: made by the family's launcher so that the family's user namespace
owns them, plugged and addressed off the fork path by a netlink helper of its
own), and a child joins one with ``setns`` instead of making its own, so its
network costs the fork nothing. A new family gets as many as the largest of
the daemon's last ``RECENT_FORKS`` forks had children, from ``MADE_FIRST`` to
``MADE_NEW_MAX`` (best-of-N forks once, soon after create: that first fork is
the one that counts); after a fork of n children the family keeps n ready
(its largest fork so far); never more than ``MADE_MAX``. A child that finds none
is plugged after its hello, as above. They go with the family. A family
re-attached after a daemon restart has no launcher to ask (it talks to the
daemon that started it): its children are plugged after their hello.

A policy is ``{"internet": bool, "allow_out": [CIDR], "deny_out": [CIDR]}``
(host names in the lists are resolved when the policy is applied); fork
children inherit their parent's (it is in the record's meta).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import ipaddress
import itertools
import logging
import os
import socket
import sqlite3
import time
from dataclasses import dataclass

from branchbox.engine import errors
from branchbox.runtime.family import Family
from branchbox.runtime.netlink_msgs import PlugMessages
from branchbox.runtime.network import Network, NetworkError

log = logging.getLogger("branchbox.engine")
POOL = 40  # prepared ports kept ready: a fork(32) takes all its children's from here
CHUNK = 8  # ports prepared at a time (~1.5 ms each, on the event loop)
REFILL_DELAY = 0.05  # s after a fork: its answer is on its way before the pool is refilled
MADE_FIRST = 4  # namespaces made ahead for a new family at least (~200 KiB of kernel memory each)
MADE_NEW_MAX = 8  # namespaces made ahead for a new family at most
RECENT_FORKS = 16  # forks a new family's namespaces are sized by (the largest of them)
MADE_MAX = 32  # namespaces a family keeps made ahead (its largest fork so far, up to this)
LINK_GRACE = 5.0  # s a closed body's link may take to go with its namespace, then deleted
_SCHEMA = """
CREATE TABLE IF NOT EXISTS net_leases (
    address TEXT PRIMARY KEY, port TEXT NOT NULL, mac TEXT NOT NULL, body TEXT
);
CREATE TABLE IF NOT EXISTS net_subnet (subnet TEXT NOT NULL);
"""


@dataclass(eq=False)
class Port:
    name: str
    mac: str
    address: str
    wire: PlugMessages  # its plug's netlink messages, encoded when it is prepared
    plugged: bool = False


@dataclass(eq=False)
class Made:
    """A network namespace made ahead for a family's next fork child, with its port."""

    port: Port
    netns: int  # fd; handed to a child's fork slot, closed here if the family goes first


def _mac(address: str) -> str:
    return "02:bb:" + ":".join(f"{b:02x}" for b in ipaddress.IPv4Address(address).packed)


class SandboxNetwork:
    """The engine's part for networking; the engine calls it at spawn, fork, merge, close."""

    def __init__(self, db: sqlite3.Connection, tag: str, subnet: str | None,
                 default_internet: bool) -> None:
        self.db = db
        self.db.executescript(_SCHEMA)
        self.net = Network(tag, subnet)
        self.default_internet = default_internet
        self.ports: dict[str, Port] = {}  # body key -> port
        self.policies: dict[str, dict] = {}  # address -> its applied policy
        self.ready: list[Port] = []
        self._names = itertools.count(1)
        self._used: set[int] = set()
        self._refill: asyncio.Handle | None = None
        self._growing: asyncio.Task | None = None  # the next bridge being made
        self._stopping = False  # no more bridges, refills or namespaces made ahead
        self._dying: dict[str, tuple[Port, float]] = {}  # released, link not yet gone
        self._unplugging: set[asyncio.Task] = set()
        self.made: dict[tuple[int, int], list[Made]] = {}  # family launcher -> ready
        self._made_want: dict[tuple[int, int], int] = {}
        self._making: dict[tuple[int, int], asyncio.Task] = {}
        self._recent_forks: collections.deque[int] = collections.deque(maxlen=RECENT_FORKS)
        # body key -> (the address its namespace took ahead, that readdressing): restores
        self._ahead: dict[str, tuple[str, asyncio.Task]] = {}

    async def start(self, keep: set[str] = frozenset()) -> None:
        """Build the bridge and firewall. ``keep``: bodies of an earlier daemon that this
        one re-attaches to (engine.reattach); their ports, addresses and links stay, on
        the earlier daemon's subnet. Every other lease is swept with its link."""
        rows = self.db.execute("SELECT address, port, mac, body FROM net_leases").fetchall()
        kept = [row for row in rows if row[3] in keep]
        subnet = self.db.execute("SELECT subnet FROM net_subnet").fetchone()
        await self.net.start({row[1] for row in kept}, subnet[0] if subnet else None)
        self.db.execute("DELETE FROM net_subnet")
        self.db.execute("INSERT INTO net_subnet VALUES (?)", (str(self.net.subnet),))
        self.db.execute("DELETE FROM net_leases")
        base = int(self.net.subnet.network_address)
        last = 0
        for address, name, mac, body in kept:
            if ipaddress.IPv4Address(address) not in self.net.subnet:
                continue
            port = Port(name, mac, address, self.net.plug_messages(
                name, mac, address, self.net.bridge_of(name)), plugged=True)
            self.ports[body] = port
            self._used.add(int(ipaddress.IPv4Address(address)) - base)
            self.db.execute("INSERT INTO net_leases VALUES (?, ?, ?, ?)",
                            (address, name, mac, body))
            with contextlib.suppress(ValueError):
                last = max(last, int(name.removeprefix(self.net.port_prefix), 16))
        self._names = itertools.count(last + 1)  # never the name of a kept port
        self.net.firewall.add_ports([(p.name, p.mac, p.address) for p in self.ports.values()])
        self.refill()

    async def stop(self) -> None:
        if self._refill is not None:
            self._refill.cancel()
        await self._stop_growing()
        await self._drop_all_made()
        await asyncio.gather(*self._unplugging, return_exceptions=True)
        self._dying.clear()
        await self.net.stop()  # every port of this daemon, dying ones too
        self.db.execute("DELETE FROM net_leases")

    async def detach(self) -> None:
        """A stop that leaves sandboxes running (``--keep``): the bridge, their links and
        the firewall stay for the next daemon; only this one's helper ends."""
        if self._refill is not None:
            self._refill.cancel()
        await self._stop_growing()
        await self._drop_all_made()  # their links go with them; the next daemon sweeps leases
        self.net.detach()

    async def _stop_growing(self) -> None:
        """A bridge being made is made (the helper serves one request at a time, and its
        reply frees nothing): wait for it instead of leaving a half-joined leaf; none is
        begun after (a sweep would miss it)."""
        self._stopping = True
        if self._growing is not None:
            await asyncio.gather(self._growing, return_exceptions=True)

    # ------------------------------------------------------------------ leases
    def _lease(self, bridge: int) -> Port:
        """A free address, its port (to go on the bridge of index ``bridge``), recorded."""
        subnet = self.net.subnet
        for n in range(2, subnet.num_addresses - 1):
            if n not in self._used:
                self._used.add(n)
                break
        else:
            raise errors.EngineError(f"no free address left in {subnet}")
        address = str(subnet.network_address + n)
        name, mac = f"{self.net.port_prefix}{next(self._names) & 0xFFFFFF:x}", _mac(address)
        port = Port(name, mac, address, self.net.plug_messages(name, mac, address, bridge))
        self.db.execute("INSERT OR REPLACE INTO net_leases VALUES (?, ?, ?, NULL)",
                        (address, port.name, port.mac))
        return port

    def _free(self, address: str) -> None:
        """The address may be leased again. The host forgets which MAC held it: after a
        merge it was the winner's port's (a MAC made from another address), and a next
        holder would be unreachable from the host until that entry failed (seconds)."""
        base = int(self.net.subnet.network_address)
        self._used.discard(int(ipaddress.IPv4Address(address)) - base)
        self.db.execute("DELETE FROM net_leases WHERE address = ?", (address,))
        with contextlib.suppress(OSError):  # (a bridge gone at a stop: nothing to forget)
            self.net.forget(address)

    def _prepare(self, n: int, *, within_room: bool = False) -> list[Port]:
        """Leases admitted by the firewall before anyone needs them (one transaction), each
        on the first bridge with room (the last one when none has: a fork's path does not
        wait for a bridge). ``within_room``: no more than the bridges have room for."""
        self._reap()
        loads = self.net.loads(self._on_bridges())
        fresh = []
        for _ in range(n):
            bridge = self.net.bridge_with_room(loads)
            if within_room and bridge is None:
                break
            bridge = self.net.bridges[-1][1] if bridge is None else bridge
            loads[bridge] += 1
            fresh.append(self._lease(bridge))
        try:
            self.net.firewall.add_ports([(p.name, p.mac, p.address) for p in fresh])
        except Exception:
            for p in fresh:
                self._free(p.address)
            raise
        return fresh

    def _on_bridges(self) -> collections.Counter[int]:
        """How many ports of this daemon each bridge has or will have (by index): those
        ready, bound, made ahead and dying (a port leaves its bridge with its link)."""
        ports = [*self.ready, *self.ports.values(),
                 *(m.port for made in self.made.values() for m in made),
                 *(port for port, _ in self._dying.values())]
        return collections.Counter(port.wire.bridge for port in ports)

    def _room(self) -> int:
        """How many more ports the bridges have room for. The next bridge is made in the
        background once the newest is mostly taken; refills and namespaces made ahead wait
        for it (a port whose bridge is full would go on the last one, past its share)."""
        if self._stopping:
            return 0
        loads = self.net.loads(self._on_bridges())
        if self._growing is None and self.net.wants_bridge(loads):
            self._growing = asyncio.get_running_loop().create_task(
                self.net.grow(len(self.net.bridges)))
            self._growing.add_done_callback(self._grown)
        return self.net.room(loads)

    def _grown(self, task: asyncio.Task) -> None:
        self._growing = None
        if task.cancelled():
            return
        if task.exception() is not None:
            log.warning("network: making the next bridge failed: %s", task.exception())
        elif not self._stopping:
            self.refill_soon()

    def take(self, body_key: str) -> Port:
        if not self.ready:  # a fork larger than the pool: the rest on its path
            self.ready += self._prepare(CHUNK)
        return self._bind(body_key, self.ready.pop())

    def _bind(self, body_key: str, port: Port) -> Port:
        self.ports[body_key] = port
        self.db.execute("UPDATE net_leases SET body = ? WHERE address = ?",
                        (body_key, port.address))
        return port

    def refill(self) -> None:
        """Fill the pool of prepared ports, a chunk per turn of the event loop (so other
        requests are not held up for the whole pool's encoding)."""
        self._refill = None
        if len(self.ready) >= POOL or not self._room():  # a new bridge calls again
            return
        try:
            self.ready += self._prepare(min(CHUNK, POOL - len(self.ready)), within_room=True)
        except Exception as exc:  # noqa: BLE001 - the next take prepares on its own
            log.warning("network: preparing ports failed: %s", exc)
            return
        self._refill = asyncio.get_running_loop().call_soon(self.refill)

    def refill_soon(self) -> None:
        """Refill the pool once the caller's answer is out (a fork's: its children took
        from the pool)."""
        if self._refill is None:
            self._refill = asyncio.get_running_loop().call_later(REFILL_DELAY, self.refill)

    # -------------------------------------------------------------- attaching
    def address(self, body_key: str) -> str | None:
        port = self.ports.get(body_key)
        return port.address if port else None

    async def attach(self, body_key: str, cgroup, host_pid: int | None) -> dict:
        """Give the body whose REPL is ``host_pid`` (found by the caller in the body's
        "repl" leaf; None: not found) its port. Returns the helper's reply with
        ``steps``: each step's time in ns, the helper's own and the daemon's (``lookup``:
        opening the REPL's namespace; ``ipc``: the way to the helper and back, without
        the time the request queued behind other children's: those are counted in
        theirs)."""
        t0 = time.perf_counter_ns()
        port = self.take(body_key)
        t1 = time.perf_counter_ns()
        if host_pid is None:
            raise errors.EngineError("the sandbox's REPL is gone: no network for it")
        fd = os.open(f"/proc/{host_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        if host_pid not in cgroup.leaf_pids("repl"):  # it died, the pid was reused meanwhile
            os.close(fd)
            raise errors.EngineError("the sandbox's REPL is gone: no network for it")
        t2 = time.perf_counter_ns()
        try:
            reply = await self.net.plug(port.name, port.mac, port.address, port.wire, fd)
        except NetworkError as exc:
            raise errors.EngineError(f"network set-up failed: {exc}") from None
        port.plugged = True
        port.wire = reply.pop("wire", port.wire)  # on another bridge than prepared for
        reply["steps"] = {"take": t1 - t0, "lookup": t2 - t1, **reply["steps"],
                          "ipc": reply["arrival"] + reply["received"] - reply["replied"]}
        return reply

    async def release(self, body_key: str) -> None:
        """Free a body's port: out of the firewall at once (it can no longer speak). Its
        link goes with the body's network namespace, which the kernel tears down by
        itself once the body's processes are dead, many at once and off our path (a
        delete through the helper waits ~20 ms for RCU grace periods, on every close,
        and holds up the forks queued behind it). The address is leased again only once
        the link is gone (``_reap``): the port's MAC is derived from it."""
        self._ahead.pop(body_key, None)
        port = self.ports.pop(body_key, None)
        if port is not None:
            self._let_go([port])

    def _let_go(self, ports: list[Port]) -> None:
        """Out of the firewall (the ports in one transaction), then dying or free."""
        for port in ports:
            self.net.firewall.clear_policy(port.address, self.policies.pop(port.address, None))
        self.net.firewall.remove_ports([(port.name, port.mac, port.address) for port in ports])
        for port in ports:
            self.db.execute("UPDATE net_leases SET body = NULL WHERE address = ?",
                            (port.address,))
            if port.plugged:
                self._dying[port.name] = (port, time.monotonic())
            else:
                self._free(port.address)

    def _reap(self) -> None:
        """Free the addresses of released ports whose links are gone; delete the links
        still there after ``LINK_GRACE`` (a namespace something kept alive)."""
        now = time.monotonic()
        stuck = []
        for name, (port, since) in list(self._dying.items()):
            if not os.path.exists(f"/sys/class/net/{name}"):
                del self._dying[name]
                self._free(port.address)
            elif now - since > LINK_GRACE:
                del self._dying[name]
                stuck.append(port)
        if stuck:
            task = asyncio.get_running_loop().create_task(self._unplug(stuck))
            self._unplugging.add(task)
            task.add_done_callback(self._unplugging.discard)

    async def _unplug(self, ports: list[Port]) -> None:
        try:
            with contextlib.suppress(NetworkError):
                await self.net.unplug([p.name for p in ports])
        finally:
            for port in ports:
                self._free(port.address)

    # ------------------------------------------------------ made ahead, per family
    def take_made(self, body_key: str, family: tuple[int, int]) -> int | None:
        """A namespace made ahead for ``family``, now the body's (its port too): the fd
        for the child's fork slot, or None if the family has none ready."""
        ready = self.made.get(family)
        if not ready:
            return None
        made = ready.pop()
        self._bind(body_key, made.port)
        return made.netns

    def address_ahead(self, body_key: str, netns: int, owner_key: str) -> None:
        """A restore: inside the namespace made ahead for ``body_key`` (``netns``, not
        consumed), ``eth0`` takes the address of ``owner_key``'s body now, while the
        child sets up, instead of after its hello; :meth:`hand_over` then moves only the
        firewall and the host's neighbour. Nothing leaves the namespace with that address
        meanwhile: the firewall holds each port to its own lease, ARP included."""
        old, new = self.ports.get(owner_key), self.ports.get(body_key)
        if old is None or new is None:
            return
        readdressing = asyncio.ensure_future(self.net.readdress(
            os.dup(netns), new.address, old.address, forget=False))
        # Seen here if nobody awaits it (the restore failed first): hand_over falls back.
        readdressing.add_done_callback(lambda task: task.cancelled() or task.exception())
        self._ahead[body_key] = (old.address, readdressing)

    def new_family(self, family: Family) -> None:
        """A family starts: namespaces for its first fork, as many as the daemon's recent
        forks had children, from MADE_FIRST to MADE_NEW_MAX (every idle sandbox holds
        them: a thousand of them hold a thousand times that)."""
        self._want(family, min(max([MADE_FIRST, *self._recent_forks]), MADE_NEW_MAX))

    def forked(self, family: Family, n: int) -> None:
        """After a fork of ``n``: the family keeps that many ready (agents that search fork
        again within a second), and new families learn what forks here look like.

        Measured under load (50 clients, each family forking once, then merging and
        closing): the namespaces that families then never use cost no more CPU than
        the run's noise (27-30 s busy, with or without them)."""
        self._recent_forks.append(n)
        self._want(family, n)

    def _want(self, family: Family, n: int) -> None:
        """Keep ``n`` namespaces ready for the family's next fork (its largest so far, at
        most MADE_MAX), made in the background once the caller's answer is out."""
        ident = family.ident
        want = max(self._made_want.get(ident, 0), min(n, MADE_MAX))
        self._made_want[ident] = want
        if ident not in self._making and len(self.made.get(ident, ())) < want:
            task = asyncio.get_running_loop().create_task(self._make(family))
            self._making[ident] = task
            task.add_done_callback(functools.partial(self._made_done, ident))

    def _made_done(self, ident: tuple[int, int], task: asyncio.Task) -> None:
        if self._making.get(ident) is task:  # not a newer one for the same family
            del self._making[ident]
        if not task.cancelled() and task.exception() is not None:
            log.warning("network: making namespaces ahead failed: %s", task.exception())

    async def _make(self, family: Family) -> None:
        """Namespaces from the family's launcher, plugged and addressed by the maker
        helper, a chunk at a time, until the family has as many as it wants."""
        await asyncio.sleep(REFILL_DELAY)  # the answer that asked for them goes out first
        ident = family.ident
        while ident in self._made_want and \
                len(self.made.setdefault(ident, [])) < self._made_want[ident]:
            while not (room := self._room()):
                growing = self._growing  # started by _room: no bridge has room
                if growing is None:  # the network stops
                    return
                await asyncio.wait({growing})
                if growing.cancelled() or growing.exception() is not None:
                    return  # (logged) the family's children are plugged after their hello
            try:
                fds = await family.make_namespaces(
                    min(CHUNK, self._made_want[ident] - len(self.made[ident]), room))
            except OSError:  # the family is gone (a fork's wish may come after drop_made)
                self._made_want.pop(ident, None)
                return
            if not fds:
                return
            try:
                ports = self._prepare(len(fds))
            except BaseException:  # no address left, say: the namespaces go unused
                for fd in fds:
                    os.close(fd)
                raise
            for port in ports:
                port.plugged = True  # or about to be: freed once no link has its name
            made = [Made(p, fd) for p, fd in zip(ports, fds, strict=True)]
            try:
                await self.net.plug_each(
                    fds, [(p.name, p.mac, p.address, p.wire) for p in ports])
            except BaseException as exc:
                self._drop(made)
                if isinstance(exc, NetworkError):
                    log.warning("network: plugging namespaces made ahead failed: %s", exc)
                    return
                raise
            if ident in self._made_want:
                self.made[ident] += made
            else:  # the family went while they were plugged
                self._drop(made)

    def drop_made(self, family: tuple[int, int]) -> None:
        """The family is gone: its namespaces made ahead go (their links with them)."""
        self._made_want.pop(family, None)
        task = self._making.pop(family, None)
        if task is not None:
            task.cancel()
        self._drop(self.made.pop(family, []))

    def _drop(self, made: list[Made]) -> None:
        for m in made:
            os.close(m.netns)
        if made:
            self._let_go([m.port for m in made])

    async def _drop_all_made(self) -> None:
        """Every family's namespaces go; what is being made is cancelled and waited for
        first (its own clean-up uses the firewall, which the caller closes next)."""
        making = list(self._making.values())
        for family in list(self.made) + list(self._making):
            self.drop_made(family)
        await asyncio.gather(*making, return_exceptions=True)

    async def hand_over(self, winner_key: str, parent_key: str, cgroup,
                        repl_host: int | None = None) -> None:
        """A merge: the winner's body takes the parent's address (the id keeps it); the
        parent's old body loses its port at once."""
        ahead = self._ahead.pop(winner_key, None)
        old, won = self.ports.pop(parent_key, None), self.ports.get(winner_key)
        if old is None or won is None:
            return
        policy = self.policies.pop(old.address, None)
        fw = self.net.firewall
        fw.clear_policy(won.address, self.policies.pop(won.address, None))
        # The old port is not deleted here: deleting a veth waits for RCU grace periods
        # (~20 ms, and the netlink helper is serial). It is out of the firewall already, so
        # nothing it sends gets through, and the kernel deletes the pair when the old body's
        # namespace dies (its processes are being killed now).
        previous, won.address = won.address, old.address
        fw.replace_ports([(old.name, old.mac, old.address), (won.name, won.mac, previous)],
                         [(won.name, won.mac, won.address)])
        self._free(previous)
        self.db.execute("UPDATE net_leases SET body = ?, port = ? WHERE address = ?",
                        (winner_key, won.name, won.address))
        if policy is not None:
            self.apply([winner_key], policy)
        if ahead is not None and ahead[0] == won.address:
            try:
                await ahead[1]
                self.net.forget(won.address)
                return
            except (NetworkError, OSError) as exc:
                log.warning("restore: readdressing ahead failed, again now: %s", exc)
        fd = None
        # The REPL's namespace (a process it started may have made one of its own).
        for pid in [repl_host] if repl_host else cgroup.leaf_pids("repl"):
            with contextlib.suppress(OSError):
                fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                break
        if fd is not None:
            try:
                await self.net.readdress(fd, previous, won.address)
            except NetworkError as exc:
                log.warning("merge: the winner kept its old address inside: %s", exc)

    # --------------------------------------------------------------- policies
    def policy_of(self, internet: bool | None, network: dict | None) -> dict:
        """A request's policy, checked (not yet resolved): 400 on a bad entry."""
        if network is not None and not isinstance(network, dict):
            raise errors.InvalidRequest("network must be an object with allow_out/deny_out")
        network = dict(network or {})
        unknown = set(network) - {"allow_out", "deny_out"}
        if unknown:
            raise errors.InvalidRequest(f"unknown network fields: {sorted(unknown)}")
        policy = {"internet": self.default_internet if internet is None else bool(internet)}
        for key in ("allow_out", "deny_out"):
            entries = network.get(key) or []
            if not isinstance(entries, list) or not all(
                    isinstance(e, str) and 0 < len(e) <= 253 and "\0" not in e
                    for e in entries) or len(entries) > 256:
                raise errors.InvalidRequest(f"{key} must be a list of CIDRs or host names")
            policy[key] = list(entries)
        return policy

    async def resolve(self, policy: dict) -> dict:
        """CIDRs as they are; host names as their IPv4 addresses now (a /32 each)."""
        out = {"internet": policy["internet"]}
        for key in ("allow_out", "deny_out"):
            cidrs: list[str] = []
            for entry in policy.get(key, []):
                try:
                    net = ipaddress.ip_network(entry, strict=False)
                except ValueError:
                    try:
                        infos = await asyncio.get_running_loop().getaddrinfo(
                            entry, None, family=socket.AF_INET)
                    except OSError:
                        raise errors.InvalidRequest(
                            f"{key}: {entry!r} is neither a CIDR nor a resolvable name"
                        ) from None
                    cidrs += sorted({f"{info[4][0]}/32" for info in infos})
                    continue
                if net.version != 4:
                    raise errors.InvalidRequest(f"{key}: IPv6 is not supported: {entry!r}")
                cidrs.append(str(net))
            out[key] = cidrs
        return out

    def apply(self, body_keys: list[str], resolved: dict) -> None:
        """Give these bodies' addresses ``resolved`` as their egress policy."""
        addresses = [self.ports[k].address for k in body_keys if k in self.ports]
        old = {a: self.policies.get(a) for a in addresses}
        self.net.firewall.set_policy(addresses, resolved, old)
        for a in addresses:
            self.policies[a] = resolved

    def resolv_conf(self) -> bytes | None:
        """``/etc/resolv.conf`` for a sandbox: the host's reachable name servers."""
        if not self.net.resolvers:
            return None
        return "".join(f"nameserver {r}\n" for r in self.net.resolvers).encode()
