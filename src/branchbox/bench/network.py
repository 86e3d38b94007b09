"""Networking: what a fork child's address costs, and the port proxy against going direct.

Every sandbox is networked, so there is no fork "without network" to time on
its own; the daemon reports, per fork, the time of each step of the children's
networks (``last_fork["network_steps"]``: taking a prepared port, finding the
child's namespace, the helper's steps, the round trip to the helper, the
children's egress policy) and their sum (``last_fork["network"]``). The rows
show fork(n), that network part per child, each step per child, and fork(n)
minus the network part. The network part runs while the REPL forks the next
child, so the difference is an upper bound of what a network-less fork would
save.

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


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    with ctx.sandbox() as parent:
        for n in (1, 5, 32):
            rows += _fork(ctx, parent, n)
    rows += _proxy(ctx)
    return rows


def _fork(ctx: Context, parent: Sandbox, n: int) -> list[Row]:
    ctx.step(f"fork({n}) with every child networked")
    total, network, helper = [], [], []
    steps: dict[str, list[float]] = {}
    for _ in range(ctx.pick(2, 10 if n <= 5 else 5)):
        t0 = time.perf_counter()
        kids = parent.fork(n)
        total.append(1000 * (time.perf_counter() - t0))
        last = parent.info()["last_fork"]
        network.append(1000 * last.get("network", 0.0))
        per_step = last.get("network_steps", {})
        helper.append(1000 * sum(per_step.get(s, 0.0) for s in HELPER_STEPS) / n)
        for step, seconds in per_step.items():
            steps.setdefault(step, []).append(1000 * seconds / n)
        close_all(kids)
    per_child = [ms / n for ms in network]
    return [
        Row(f"fork({n}), children networked", total, params={"n": n, "kind": "fork"}),
        Row(f"fork({n}): network part per child", per_child,
            params={"n": n, "kind": "network"},
            note="daemon + helper, policy included; target ≤ 1 ms"),
        Row(f"fork({n}): netlink helper part per child", helper,
            params={"n": n, "kind": "network-helper"}, note="what the helper itself spends"),
        *(Row(f"fork({n}): network step {step} per child", samples,
              params={"n": n, "kind": f"network-{step}"})
          for step, samples in steps.items()),
        Row(f"fork({n}) minus its network part", [t - w for t, w in zip(total, network,
                                                                          strict=True)],
            params={"n": n, "kind": "fork-net"}, note="upper bound of a fork without network"),
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
