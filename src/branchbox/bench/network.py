"""Networking: what a fork child's address costs, and the port proxy against going direct.

Every sandbox is networked, so there is no fork "without network" to time on
its own; the daemon reports, per fork, the time of each step of the children's
networks (``last_fork["network_steps"]``) and their sum (``last_fork["network"]``).

A family's first fork plugs each child after its hello: taking a prepared
port, finding the child's namespace, the netlink helper's steps (a veth
created into the namespace, its address and route), the round trip to the
helper. A family has namespaces made ahead for it (engine.networking): four
from its start, then as many as its largest fork; a child joins one, and what
is left on the fork's path is taking it and the egress policy. The rows show,
per n: the first fork of a fresh sandbox and later forks, each after a short
pause (an agent runs code between create and fork, and between forks; the
namespaces are made meanwhile), the network part per child and each step,
and fork(n) minus the network part (an upper bound of what a fork without a
network would save: the network part of a first fork runs while the REPL forks
the next child).

The proxy rows fetch from a server in the sandbox (``python3 -m http.server``)
through ``/v1/sandboxes/{id}/ports/{port}`` on the daemon's socket, and
directly at the sandbox's address from the host.
"""

from __future__ import annotations

import time

import httpx

from branchbox.bench.measure import Context, Ratio, Row, close_all
from branchbox.sdk import Sandbox

TITLE = "networking: fork children's addresses, port proxy"
BIG_MB = 100
# The netlink helper's own steps of a plug (runtime.netlink_helper.Helper.op_plug).
HELPER_STEPS = ("decode", "veth", "setns_in", "socket", "configure", "setns_out")
PAUSE = 0.3  # s before a family's forks: its namespaces for them are made meanwhile


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    for n in (1, 5, 32):
        rows += _first_forks(ctx, n)
        with ctx.sandbox() as parent:
            close_all(parent.fork(n))  # the family's first: the next ones find namespaces
            rows += _later_forks(ctx, parent, n)
    rows += _proxy(ctx)
    return rows


def _first_forks(ctx: Context, n: int) -> list[Row]:
    ctx.step(f"fork({n}) of a fresh sandbox: its first fork")
    samples = _Samples()
    for _ in range(ctx.pick(2, 5)):
        with ctx.sandbox() as parent:
            time.sleep(PAUSE)
            samples.fork(parent, n)
    return samples.rows(n, "first fork of a family", "first")


def _later_forks(ctx: Context, parent: Sandbox, n: int) -> list[Row]:
    ctx.step(f"fork({n}), later forks: children join namespaces made ahead")
    samples = _Samples()
    for _ in range(ctx.pick(3, 10 if n <= 5 else 5)):
        time.sleep(PAUSE)
        samples.fork(parent, n)
    return samples.rows(n, "later forks", "later")


class _Samples:
    """Forks of one kind: total, network part per child, helper part, each step."""

    def __init__(self) -> None:
        self.total: list[float] = []
        self.network: list[float] = []
        self.helper: list[float] = []
        self.steps: dict[str, list[float]] = {}

    def fork(self, parent: Sandbox, n: int) -> None:
        t0 = time.perf_counter()
        kids = parent.fork(n)
        self.total.append(1000 * (time.perf_counter() - t0))
        last = parent.info()["last_fork"]
        self.network.append(1000 * last.get("network", 0.0) / n)
        per_step = last.get("network_steps", {})
        self.helper.append(1000 * sum(per_step.get(s, 0.0) for s in HELPER_STEPS) / n)
        for step, seconds in per_step.items():
            self.steps.setdefault(step, []).append(1000 * seconds / n)
        close_all(kids)

    def rows(self, n: int, label: str, kind: str) -> list[Row]:
        name = f"fork({n}), {label}"
        return [
            Row(name, self.total, params={"n": n, "kind": f"fork-{kind}"}),
            Row(f"{name}: network part per child", self.network,
                params={"n": n, "kind": f"network-{kind}"},
                note="daemon + helper, policy included; target ≤ 1 ms"),
            Row(f"{name}: netlink helper part per child", self.helper,
                params={"n": n, "kind": f"network-helper-{kind}"},
                note="what the helper itself spends on the fork's path"),
            *(Row(f"{name}: network step {step} per child", samples,
                  params={"n": n, "kind": f"network-{step}-{kind}"})
              for step, samples in self.steps.items()),
            Row(f"{name} minus its network part",
                [t - w * n for t, w in zip(self.total, self.network, strict=True)],
                params={"n": n, "kind": f"fork-net-{kind}"},
                note="upper bound of a fork without network"),
        ]


def _proxy(ctx: Context) -> list[Row]:
    ctx.step("port proxy: first byte and a 100 MB download")
    reps = ctx.pick(5, 30)
    with ctx.sandbox() as sb:
        sb.exec(f"mkdir -p /srv && cd /srv && echo ok > small && "
                f"head -c {BIG_MB << 20} /dev/zero > big")
        sb.exec("cd /srv && python3 -m http.server --bind 0.0.0.0 8000 >/dev/null 2>&1",
                background=True)
        direct = httpx.Client(base_url=f"http://{sb.ip}:8000", trust_env=False, timeout=120)
        socket_path = ctx.url.removeprefix("unix://")
        proxied = httpx.Client(transport=httpx.HTTPTransport(uds=socket_path),
                               base_url=f"http://branchbox/v1/sandboxes/{sb.id}/ports/8000",
                               timeout=120)
        with direct, proxied:
            for _ in range(100):  # the server starts in the background
                try:
                    direct.get("/small").raise_for_status()
                    break
                except httpx.HTTPError:
                    time.sleep(0.05)
            rows = []
            for name, client in (("direct", direct), ("proxy", proxied)):
                rows.append(Row(f"first byte, {name}", _ttfb(client, reps),
                                params={"kind": f"ttfb-{name}"},
                                ratios=[Ratio("first byte, direct")] if name == "proxy"
                                else []))
            for name, client in (("direct", direct), ("proxy", proxied)):
                rows.append(Row(f"{BIG_MB} MB download, {name}",
                                _throughput(client, ctx.pick(2, 5)), unit="MB/s",
                                params={"kind": f"download-{name}"}))
    return rows


def _ttfb(client: httpx.Client, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        with client.stream("GET", "/small") as reply:
            next(reply.iter_raw())
            samples.append(1000 * (time.perf_counter() - t0))
    return samples


def _throughput(client: httpx.Client, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        size = 0
        with client.stream("GET", "/big") as reply:
            for chunk in reply.iter_raw(1 << 20):
                size += len(chunk)
        samples.append(size / (1 << 20) / (time.perf_counter() - t0))
    return samples
