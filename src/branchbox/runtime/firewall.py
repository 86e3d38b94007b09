"""The sandboxes' firewall: two nftables tables per daemon, changed one transaction at a time.

``bridge bb-<tag>`` (on the bridge, before the bridge learns or forwards):
  * a frame from a sandbox port passes only if (port, source MAC, source IPv4)
    is that port's lease: no spoofing of another address or MAC, ARP included,
    and nothing but IPv4 and ARP (no IPv6, no raw ethertypes);
  * port to port is dropped: two sandboxes never talk over the bridge;
  * from a trunk (the link between the hub and a leaf bridge) into a port, only
    the hub's own frames pass (the gateway's): a sandbox on one bridge never
    reaches one on another either.

``inet bb-<tag>``:
  * input from the bridge: only replies to connections the host opened (the
    port proxy); a sandbox reaches no host service, whatever its policy;
    anything else is answered (TCP reset, ICMP admin-prohibited) so it fails fast;
  * forward into the bridge: only replies; nothing new reaches a sandbox from
    another sandbox (routed through the host), another daemon's bridge or the LAN;
  * forward out of the bridge: ``ip saddr vmap @egress`` — a sandbox's address
    maps to ``accept`` (internet on), a policy chain (allow/deny lists) or
    nothing (rejected: refused or unreachable at once). Every packet is looked
    up, so a policy change also cuts connections already open;
  * masquerade of the subnet on the way out;
  * no connection tracking of frames bridged across a leaf (see ``install``), and
    nothing into the host through a leaf's own device: the host's IPv4 is on the hub.

A policy chain is shared by every sandbox with the same policy (fork children
inherit theirs), so a fork only adds map elements.
"""

from __future__ import annotations

import contextlib
import hashlib
import json

from branchbox.runtime.nft import Nft, NftError

# A refused packet is answered, so that a sandbox fails fast (connection refused for TCP,
# "host unreachable" otherwise) instead of hanging until its own timeout.
_TCP = {"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}}
_RESET = {"reject": {"type": "tcp reset"}}
_UNREACHABLE = {"reject": {"type": "icmpx", "expr": "admin-prohibited"}}
_REJECT_TEXT = ("meta l4proto tcp reject with tcp reset",
                "reject with icmpx type admin-prohibited")


def _table(family: str, name: str) -> dict:
    return {"table": {"family": family, "name": name}}


def _cidrs(entries: list[str]) -> dict:
    """An anonymous set of prefixes for a ``daddr`` match."""
    items = []
    for entry in entries:
        addr, _, length = entry.partition("/")
        items.append({"prefix": {"addr": addr, "len": int(length)}} if length else addr)
    return {"set": items}


class Firewall:
    def __init__(self, tag: str, bridge: str, subnet: str, port_prefix: str,
                 trunk_prefix: str, bridge_mac: str) -> None:
        self.nft = Nft()
        self.name = f"bb-{tag}"
        self.bridge = bridge
        self.bridge_mac = bridge_mac
        self.subnet = subnet
        self.port_glob = port_prefix + "*"
        self.trunk_glob = trunk_prefix + "*"
        self.chains: dict[str, set[str]] = {}  # policy chain -> addresses using it

    # ------------------------------------------------------------------ set-up
    def remove(self) -> None:
        """Delete this daemon's tables (at start, what an earlier one left; at stop)."""
        mine = {("inet", self.name), ("bridge", self.name)}
        gone = [{"delete": _table(f, n)} for f, n in self.nft.tables() if (f, n) in mine]
        if gone:
            self.nft.run(gone)
        self.chains.clear()

    def install(self) -> None:
        self.remove()
        t = self.name
        net, length = self.subnet.split("/")
        br = self.bridge
        rules = {
            ("bridge", "sb_pre"): [
                f"iifname != \"{self.port_glob}\" accept",
                "ether type ip iifname . ether saddr . ip saddr @ports accept",
                "ether type arp iifname . ether saddr . arp saddr ip @ports "
                "iifname . arp saddr ether . arp saddr ip @ports accept",
                "drop",
            ],
            ("bridge", "sb_fwd"): [f'iifname "{self.port_glob}" oifname "{self.port_glob}" '
                                   'drop',
                                   f'iifname "{self.trunk_glob}" oifname "{self.port_glob}" '
                                   f'ether saddr != {self.bridge_mac} drop'],
            # A packet conntrack calls invalid (out of its window, as a fast stream's
            # late segments can be) is dropped, never answered: a reset would kill a
            # healthy connection.
            # A leaf's own device takes nothing (see network._layer2_only); what is bridged
            # across a leaf (br_netfilter) goes out on the same leaf.
            ("inet", "sb_in"): [f'iifname "{br}x*" drop',
                                f'iifname "{br}" ct state established,related accept',
                                f'iifname "{br}" ct state invalid drop',
                                *(f'iifname "{br}" {r}' for r in _REJECT_TEXT)],
            ("inet", "sb_fwd"): [f'iifname "{br}x*" oifname != "{br}x*" drop',
                                 f'oifname "{br}" ct state established,related accept',
                                 f'oifname "{br}" drop',
                                 f'iifname "{br}" ct state invalid drop',
                                 f'iifname "{br}" ip saddr vmap @egress',
                                 *(f'iifname "{br}" {r}' for r in _REJECT_TEXT)],
            ("inet", "sb_nat"): [f'ip saddr {net}/{length} oifname != "{br}" masquerade'],
            # With br_netfilter loaded, a frame bridged across a leaf (a sandbox to or from
            # its trunk) passes these hooks too, the leaf its input and output. Tracked
            # there, a connection would be NATed there (not at all: masqueraded to the
            # leaf's no address, or not), never again at the hub where it is routed out.
            # Only the hub tracks (a trunk's veth forgets the leaf's entry anyway).
            ("inet", "sb_raw"): [f'iifname "{br}x*" notrack'],
        }
        # The base ruleset in nft's own syntax (libnftables parses it in the same
        # transaction machinery as JSON); per-sandbox changes below are JSON.
        text = f"""
table bridge {t} {{
  set ports {{ type ifname . ether_addr . ipv4_addr; }}
  chain sb_pre {{ type filter hook prerouting priority -200; policy accept;
    {'; '.join(rules['bridge', 'sb_pre'])}; }}
  chain sb_fwd {{ type filter hook forward priority 0; policy accept;
    {'; '.join(rules['bridge', 'sb_fwd'])}; }}
}}
table inet {t} {{
  map egress {{ type ipv4_addr : verdict; }}
  chain sb_in {{ type filter hook input priority 0; policy accept;
    {'; '.join(rules['inet', 'sb_in'])}; }}
  chain sb_fwd {{ type filter hook forward priority 0; policy accept;
    {'; '.join(rules['inet', 'sb_fwd'])}; }}
  chain sb_nat {{ type nat hook postrouting priority 100; policy accept;
    {'; '.join(rules['inet', 'sb_nat'])}; }}
  chain sb_raw {{ type filter hook prerouting priority raw; policy accept;
    {'; '.join(rules['inet', 'sb_raw'])}; }}
}}
"""
        self.nft.run_text(text)

    # ------------------------------------------------------------------- ports
    def _port(self, verb: str, ports: list[tuple[str, str, str]]) -> dict:
        return {verb: {"element": {"family": "bridge", "table": self.name, "name": "ports",
                                   "elem": [{"concat": list(p)} for p in ports]}}}

    def add_ports(self, ports: list[tuple[str, str, str]]) -> None:
        """Admit (port name, MAC, address) triples at the bridge."""
        if ports:
            self.nft.run([self._port("add", ports)])

    def remove_ports(self, ports: list[tuple[str, str, str]]) -> None:
        """Forget ports: in one transaction, or one by one if that is refused (an element
        already gone must not keep the others)."""
        if not ports:
            return
        try:
            self.nft.run([self._port("delete", ports)])
            return
        except NftError:
            if len(ports) == 1:
                return
        for port in ports:
            with contextlib.suppress(NftError):
                self.nft.run([self._port("delete", [port])])

    def replace_ports(self, gone: list[tuple[str, str, str]],
                      added: list[tuple[str, str, str]]) -> None:
        """Remove ``gone`` and admit ``added`` in one transaction (each is a round trip
        to the kernel); one by one if an element of ``gone`` is missing already."""
        try:
            self.nft.run([self._port("delete", gone), self._port("add", added)])
        except NftError:
            self.remove_ports(gone)
            self.add_ports(added)

    # ---------------------------------------------------------------- policies
    @staticmethod
    def verdict_of(policy: dict) -> str | None:
        """``accept``, a policy chain's name, or None (no egress at all)."""
        allow, deny = policy.get("allow_out") or [], policy.get("deny_out") or []
        internet = bool(policy.get("internet"))
        if not allow and not deny:
            return "accept" if internet else None
        if not allow and not internet:
            return None
        digest = hashlib.sha256(json.dumps([internet, sorted(allow), sorted(deny)]).encode())
        return "p-" + digest.hexdigest()[:16]

    def _chain_cmds(self, chain: str, policy: dict) -> list[dict]:
        rules = []
        base = {"family": "inet", "table": self.name, "chain": chain}
        # allow_out wins over deny_out (E2B's rule): an allowed prefix inside a denied one
        # stays reachable.
        def rule(*expr: dict) -> dict:
            return {"add": {"rule": {**base, "expr": list(expr)}}}

        for key, accept in (("allow_out", True), ("deny_out", False)):
            entries = policy.get(key)
            if entries:
                match = {"match": {"op": "==", "left": {"payload": {
                    "protocol": "ip", "field": "daddr"}}, "right": _cidrs(entries)}}
                if accept:
                    rules.append(rule(match, {"accept": None}))
                else:
                    rules += [rule(match, _TCP, _RESET), rule(match, _UNREACHABLE)]
        if policy.get("internet"):
            rules.append(rule({"accept": None}))
        else:
            rules += [rule(_TCP, _RESET), rule(_UNREACHABLE)]
        return [{"add": {"chain": {"family": "inet", "table": self.name, "name": chain}}},
                *rules]

    def _element(self, verb: str, address: str, verdict: str) -> dict:
        value = {"accept": None} if verdict == "accept" else {"jump": {"target": verdict}}
        return {verb: {"element": {"family": "inet", "table": self.name, "name": "egress",
                                   "elem": [[address, value]]}}}

    def set_policy(self, addresses: list[str], policy: dict,
                   old: dict[str, dict | None] | None = None) -> None:
        """Give ``addresses`` the egress ``policy`` in one transaction (``old``: each
        address's previous policy, whose element and unused chain go)."""
        cmds: list[dict] = []
        dropped: list[str] = []
        for address, previous in (old or {}).items():
            verdict = self.verdict_of(previous) if previous else None
            if verdict is not None:
                cmds.append(self._element("delete", address, verdict))
                if verdict != "accept":
                    users = self.chains.get(verdict, set())
                    users.discard(address)
                    if not users:
                        dropped.append(verdict)
        verdict = self.verdict_of(policy)
        if verdict is not None and verdict != "accept" and verdict not in self.chains:
            cmds += self._chain_cmds(verdict, policy)
            self.chains[verdict] = set()
        if verdict is not None:
            for address in addresses:
                cmds.append(self._element("add", address, verdict))
                if verdict != "accept":
                    self.chains[verdict].add(address)
        for chain in dropped:
            if chain != verdict and not self.chains.get(chain):
                self.chains.pop(chain, None)
                cmds.append({"delete": {"chain": {"family": "inet", "table": self.name,
                                                  "name": chain}}})
        if cmds:
            self.nft.run(cmds)

    def clear_policy(self, address: str, policy: dict | None) -> None:
        """``address`` leaves the egress map (its sandbox closed)."""
        if policy is None or self.verdict_of(policy) is None:
            return
        try:
            self.set_policy([], {"internet": False}, {address: policy})
        except NftError:
            self.chains.get(self.verdict_of(policy) or "", set()).discard(address)
