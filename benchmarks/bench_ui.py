"""The ``/ui`` page with 1,000 live sandboxes, in Debian's headless Chromium (Selenium).

A private daemon (TCP, one random key, copy storage) and a page opened on it first;
then one sandbox is forked into a tree of ``--nodes`` (a fan-out of up to 32 per
fork) while the page watches. Reported, never asserted:

- live: from the last fork's answer until the page shows every node, and the page's
  long tasks (main thread busy > 50 ms, Chromium's ``longtask`` entries) meanwhile;
- reload: ``GET /ui`` on the server (median of 5) and its size, then the browser's
  navigation timing of a reload (first byte, DOMContentLoaded, load);
- ``GET /ui/stats`` (the one request per 5 s the page makes), median of 5;
- a click on a node until its details are in the page (synchronous, median of 20);
- a merge of a child that has children of its own, 32 closes, and a fork of 32 more,
  each until the page shows it.

    python benchmarks/bench_ui.py [--nodes N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table
from selenium import webdriver

COUNT_NODES = "return document.querySelectorAll('li.node').length"
LONG_TASKS = """
window.bbLong = [];
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) window.bbLong.push(e.duration);
}).observe({type: "longtask"});
"""


def _serve(data_dir: Path, key: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "BRANCHBOX_API_KEY": key}
    log = (data_dir / "daemon.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "branchbox", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--data-dir", str(data_dir), "--storage", "copy"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/v1/healthz", timeout=2).text == "ok":
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the daemon did not start; see {data_dir / 'daemon.log'}")


def _browser(profile: Path) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,900", f"--user-data-dir={profile}"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(
        executable_path="/usr/bin/chromedriver"))


def _until(check: Callable[[], bool], within: float = 300) -> float:
    """Seconds until ``check()`` holds (polled every 20 ms)."""
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > within:
            raise SystemExit("the page did not catch up within 300 s")
        time.sleep(0.02)
    return time.perf_counter() - start


def _median_ms(call: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _check(reply: httpx.Response) -> httpx.Response:
    if reply.is_error:
        raise SystemExit(f"{reply.request.method} {reply.request.url.path}: {reply.status_code} "
                         f"{reply.text}")
    return reply


def _grow(http: httpx.Client, root: str, nodes: int) -> dict[str, list[str]]:
    """Fork ``root`` into a tree of ``nodes`` sandboxes, breadth first, 32 per fork at most;
    returns each forked sandbox's children."""
    kids: dict[str, list[str]] = {}
    frontier, total = [root], 1
    while total < nodes:
        parent = frontier.pop(0)
        n = min(32, nodes - total)
        reply = _check(http.post(f"/v1/sandboxes/{parent}/fork", json={"n": n}))
        kids[parent] = reply.json()["children"]
        frontier += kids[parent]
        total += n
    return kids


def run(nodes: int) -> dict:
    key = secrets.token_hex(16)
    data_dir = Path(tempfile.mkdtemp(prefix="branchbox-bench-ui-"))
    data_dir.chmod(0o755)
    proc, url = _serve(data_dir, key)
    driver = None
    results: dict = {"nodes": nodes}
    try:
        http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"},
                            timeout=300)
        driver = _browser(data_dir / "profile")
        driver.get(f"{url}/ui?key={key}")
        _until(lambda: driver.find_element("id", "status").text == "live", 60)
        driver.execute_script(LONG_TASKS)

        root = http.post("/v1/sandboxes", json={}).json()["id"]
        started = time.perf_counter()
        kids = _grow(http, root, nodes)
        forked = time.perf_counter()
        results["fork_all_s"] = forked - started
        results["live_catch_up_ms"] = _until(
            lambda: driver.execute_script(COUNT_NODES) >= nodes) * 1000
        long_tasks = driver.execute_script("return window.bbLong")
        results["live_long_tasks"] = len(long_tasks)
        results["live_long_task_max_ms"] = max(long_tasks, default=0.0)
        results["live_long_task_total_ms"] = sum(long_tasks)

        page = http.get("/ui")
        results["ui_html_bytes"] = len(page.content)
        results["ui_server_ms"] = _median_ms(lambda: http.get("/ui"), 5)
        results["stats_server_ms"] = _median_ms(lambda: http.get("/ui/stats"), 5)
        driver.refresh()
        _until(lambda: driver.execute_script(COUNT_NODES) >= nodes, 60)
        nav = driver.execute_script(
            "const n = performance.getEntriesByType('navigation')[0];"
            "return [n.responseStart - n.requestStart, n.domContentLoadedEventEnd, "
            "n.loadEventEnd];")
        results["reload_first_byte_ms"], results["reload_dcl_ms"], results["reload_load_ms"] = nav
        _until(lambda: driver.find_element("id", "status").text == "live", 60)

        results["click_details_ms"] = statistics.median(driver.execute_script("""
            const cards = document.querySelectorAll('li.node > .card');
            const times = [];
            for (let i = 0; i < 20; i++) {
              const t = performance.now();
              cards[(i * 37) % cards.length].click();
              document.getElementById('details').offsetHeight;  // force layout
              times.push(performance.now() - t);
            }
            return times;"""))

        # A merge of a child with children of its own, then 32 more nodes.
        winner = next(c for c in kids[root] if c in kids)
        _check(http.post(f"/v1/sandboxes/{root}/merge_into/{winner}"))
        results["merge_shown_ms"] = _until(lambda: driver.execute_script(
            f"return document.querySelector('li.node[data-id=\"{winner}\"]')"
            ".classList.contains('retired')")) * 1000
        # 32 leaves closed, then 32 new children (the daemon's subnet holds ~1,000).
        leaves = [c for c in kids[winner] if c not in kids][:32]
        for leaf in leaves:
            _check(http.delete(f"/v1/sandboxes/{leaf}"))
        results["close32_shown_ms"] = _until(lambda: driver.execute_script(
            f"return document.querySelector('li.node[data-id=\"{leaves[-1]}\"]')"
            ".classList.contains('retired')")) * 1000
        _check(http.post(f"/v1/sandboxes/{root}/fork", json={"n": 32}))
        results["fork32_shown_ms"] = _until(
            lambda: driver.execute_script(COUNT_NODES) >= nodes + 32) * 1000
        http.close()
    finally:
        if driver is not None:
            driver.quit()
        proc.send_signal(signal.SIGTERM)  # closes every sandbox
        proc.wait(600)
        shutil.rmtree(data_dir, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = run(args.nodes)
    table = Table(title=f"/ui with {args.nodes} live sandboxes (headless Chromium)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, value in results.items():
        table.add_row(name, f"{value:.1f}" if isinstance(value, float) else str(value))
    Console().print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
