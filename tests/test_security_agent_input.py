"""A hostile sandbox against the daemon: forged frames on its own control socket.

The REPL process is the sandbox's agent, so user code can find the control
socket (an AF_UNIX stream among its fds) and write frames of its own. Each
attack here runs as such user code against a real ``branchbox serve`` process
(so its RSS is the daemon's alone and a client disconnect is a real one), and
checks what must hold whatever a sandbox sends: the daemon's memory stays
bounded, ``/v1/healthz`` and other sandboxes answer, a malformed frame ends that
sandbox's channel only, and closing the sandbox leaves no process behind.
Liveness bounds are generous on purpose: these are not timings.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from served import ServedDaemon

from branchbox.runtime import procfs

API_KEY = "agent-input-test-key"
LIVE = 10.0  # seconds within which the daemon must answer under attack (liveness)

# Prepended to every attack: find the control socket and the rid of the running call.
HOSTILE = r'''
import gc, json, os, socket, stat, struct

def _ctrl():
    for fd in range(3, 4096):
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        if not stat.S_ISSOCK(mode):
            continue
        s = socket.socket(fileno=os.dup(fd))
        if s.family == socket.AF_UNIX and s.type == socket.SOCK_STREAM:
            s.setblocking(True)
            return s
        s.close()
    raise RuntimeError("no control socket found")

def _rid():
    for o in gc.get_objects():
        if type(o).__name__ == "_Call" and hasattr(o, "rid"):
            return o.rid
    raise RuntimeError("no call in progress")

def frame(header, payload=b""):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("!II", len(h), len(payload)) + h + payload
'''


class Daemon(ServedDaemon):
    """A ``branchbox serve`` process, and an HTTP client for it."""

    def __init__(self) -> None:
        env = {**os.environ, "BRANCHBOX_API_KEY": API_KEY}
        super().__init__("agent-input", env)
        self.http = self.client(API_KEY)

    def rss(self) -> int:
        """The daemon's resident memory, bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def healthz_latency(self) -> float:
        started = time.monotonic()
        assert self.http.get("/v1/healthz", timeout=60).text == "ok"
        return time.monotonic() - started

    def create(self, **body: object) -> str:
        reply = self.http.post("/v1/sandboxes", json=body)
        assert reply.status_code == 201, reply.text
        return reply.json()["id"]

    def run(self, sid: str, code: str, timeout: float = 120) -> httpx.Response:
        return self.http.post(f"/v1/sandboxes/{sid}/run_code", json={"code": code},
                              timeout=timeout)

    def processes(self, sid: str) -> list[int]:
        """Host pids of the sandbox's family: its processes, their family init and launcher
        (the chain of parents up to the daemon's zygote or the image's template, which fork
        every launcher)."""
        info = self.http.get(f"/v1/sandboxes/{sid}").json()
        found = set(info["resources"]["host_pids"])
        for pid in list(found):
            while (parent := _ppid(pid)) not in (None, self.proc.pid, 1, 0) and \
                    _comm(parent) not in ("bb-zygote", "bb-template"):
                found.add(parent)
                pid = parent
        assert found, info
        return sorted(found)

    def stop(self) -> None:
        self.http.close()
        super().stop()


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _ppid(pid: int) -> int | None:
    """``pid``'s parent, or None once it is gone."""
    try:
        return procfs.parent(pid)
    except OSError:
        return None


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = Daemon()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def make(daemon: Daemon) -> Iterator[Callable[..., str]]:
    made: list[str] = []

    def factory(**body: object) -> str:
        sid = daemon.create(**body)
        made.append(sid)
        return sid

    yield factory
    for sid in made:
        daemon.http.delete(f"/v1/sandboxes/{sid}")


class Watch:
    """While an attack runs: sample the daemon's RSS and probe healthz from a thread."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.baseline = daemon.rss()
        self.peak = self.baseline
        self.worst_healthz = 0.0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._sample),
                         threading.Thread(target=self._probe)]

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.daemon.rss())

    def _probe(self) -> None:
        with httpx.Client(base_url=self.daemon.url, timeout=120) as client:
            while not self._stop.wait(0.2):
                started = time.monotonic()
                assert client.get("/v1/healthz").text == "ok"
                self.worst_healthz = max(self.worst_healthz, time.monotonic() - started)

    def __enter__(self) -> Watch:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


def assert_closed_cleanly(daemon: Daemon, sid: str, pids: list[int]) -> None:
    """DELETE succeeds and nothing of the sandbox's family is left running."""
    reply = daemon.http.delete(f"/v1/sandboxes/{sid}")
    assert reply.status_code == 204, reply.text
    deadline = time.monotonic() + LIVE
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pids), f"left running after close: {_alive(pids)}"


def assert_others_fine(daemon: Daemon, other: str) -> None:
    assert daemon.healthz_latency() < LIVE
    started = time.monotonic()
    reply = daemon.run(other, "print(6 * 7)", timeout=60)
    assert reply.status_code == 200, reply.text
    assert '"data":"42\\n"' in reply.text
    assert time.monotonic() - started < LIVE


# --------------------------------------------------------------------------- the attacks

def test_frames_past_the_output_budget_are_not_queued_without_bound(
        daemon: Daemon, make: Callable[..., str]) -> None:
    """400 MiB of forged stdout for the running call from a 128 MiB sandbox, read by a
    client that does not read: the daemon holds at most a bounded queue of it."""
    victim, other = make(memory_mb=128), make()
    pids = daemon.processes(victim)
    code = HOSTILE + (
        "s = _ctrl()\n"
        "blob = frame({'rid': _rid(), 'ev': 'stdout', 'data': 'x' * (1 << 19)})\n"
        "for _ in range(800):\n"
        "    s.sendall(blob)\n"
    )
    with Watch(daemon) as watch:
        # A client that sends the request and then does not read the response.
        port = int(daemon.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as raw:
            body = httpx.Request("POST", f"{daemon.url}/v1/sandboxes/{victim}/run_code",
                                 json={"code": code}).read()
            raw.sendall(
                f"POST /v1/sandboxes/{victim}/run_code HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(15)  # the sandbox floods meanwhile
            assert watch.worst_healthz < LIVE
    print(f"flood: daemon RSS +{watch.growth >> 20} MiB, healthz worst "
          f"{watch.worst_healthz:.3f} s")
    assert watch.growth < 150 << 20, f"the daemon grew by {watch.growth >> 20} MiB"
    assert_others_fine(daemon, other)
    assert_closed_cleanly(daemon, victim, pids)


MALFORMED = {
    "header-is-a-list": "s.sendall(frame(b'[1, 2, 3]'))",
    "header-is-a-number": "s.sendall(frame(b'7'))",
    "header-not-json": "s.sendall(frame(b'\\xff{not json'))",
    "header-length-2**31": "s.sendall(struct.pack('!II', 2**31, 0))",
    "rid-is-a-string": "s.sendall(frame({'rid': str(_rid()), 'ev': 'done', 'result': {}}))",
    "data-is-a-number": "s.sendall(frame({'rid': _rid(), 'ev': 'stdout', 'data': 5}))",
    "result-is-a-list": "s.sendall(frame({'rid': _rid(), 'ev': 'done', 'result': [1]}))",
    "unknown-rid": "s.sendall(frame({'rid': 10**9, 'ev': 'done', 'result': {}}))",
    "unknown-event": "s.sendall(frame({'rid': _rid(), 'ev': 'zzz'}))",
    "chunk-for-a-run": "s.sendall(frame({'rid': _rid(), 'ev': 'chunk'}, b'abc'))",
    # A header past 1 MiB, or of more than 100,000 values, is refused before json.loads
    # pays for it: at 64 MiB of [[],...] one frame stopped every sandbox for seconds.
    "header-past-1-MiB": "s.sendall(frame({'rid': _rid(), 'ev': 'stdout', "
                         "'data': 'x' * (1 << 20)}))",
    "too-many-values": "s.sendall(frame({'rid': _rid(), 'ev': 'done', "
                       "'result': {'x': [[]] * 200_000}}))",
    # Blobs (long strings sent ahead of their header) must be exactly what it names.
    "blob-for-no-header": "r = _rid(); s.sendall(frame({'rid': r, 'ev': 'blob'}, b'abc') "
                          "+ frame({'rid': r, 'ev': 'done', 'result': {}}))",
    "blob-not-utf8": "r = _rid(); s.sendall(frame({'rid': r, 'ev': 'blob'}, b'\\xff\\xfe') "
                     "+ frame({'rid': r, 'ev': 'done', 'result': {'t': None}, "
                     "'blobs': [[['result', 't'], 2]]}))",
    "blob-onto-a-value": "r = _rid(); s.sendall(frame({'rid': r, 'ev': 'blob'}, b'abc') "
                         "+ frame({'rid': r, 'ev': 'done', 'result': {'t': 'x'}, "
                         "'blobs': [[['result', 't'], 3]]}))",
    "blob-past-its-bytes": "r = _rid(); s.sendall(frame({'rid': r, 'ev': 'blob'}, b'abc') "
                           "+ frame({'rid': r, 'ev': 'done', 'result': {'t': None}, "
                           "'blobs': [[['result', 't'], 4]]}))",
}


@pytest.mark.parametrize("attack", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_frame_ends_only_that_sandbox(daemon: Daemon, make: Callable[..., str],
                                                  attack: str) -> None:
    victim, other = make(), make()
    pids = daemon.processes(victim)
    code = HOSTILE + "s = _ctrl()\n" + attack + "\nimport time\ntime.sleep(20)\n"
    started = time.monotonic()
    reply = daemon.run(victim, code, timeout=60)
    elapsed = time.monotonic() - started
    # The channel is cut at once: the call ends with the REPL gone, not after user code.
    assert reply.status_code == 410, reply.text
    assert elapsed < LIVE, f"the bad frame was not noticed ({elapsed:.1f} s)"
    assert daemon.run(victim, "1").status_code == 410  # that sandbox's channel is closed
    assert_others_fine(daemon, other)
    assert_closed_cleanly(daemon, victim, pids)


def test_stdout_without_newlines_is_not_joined_quadratically(
        daemon: Daemon, make: Callable[..., str]) -> None:
    """Podflare's /exec turns output into lines: endless output without a newline must
    cost linear work, yield the loop, and stop at the sandbox's output budget."""
    victim, other = make(), make()
    pids = daemon.processes(victim)
    code = HOSTILE + (
        "s = _ctrl()\n"
        "blob = frame({'rid': _rid(), 'ev': 'stdout', 'data': 'y' * (1 << 16)})\n"
        "for _ in range(4096):\n"
        "    s.sendall(blob)\n"
    )
    with Watch(daemon) as watch:
        started = time.monotonic()
        with daemon.http.stream("POST", f"/v1/sandboxes/{victim}/exec",
                                json={"code": code, "language": "python"}, timeout=300) as reply:
            size = sum(len(chunk) for chunk in reply.iter_bytes())
        elapsed = time.monotonic() - started
    print(f"no newlines: {size >> 20} MiB streamed in {elapsed:.1f} s, healthz worst "
          f"{watch.worst_healthz:.3f} s, RSS +{watch.growth >> 20} MiB")
    assert watch.worst_healthz < LIVE
    assert elapsed < 60, f"the stream took {elapsed:.0f} s"
    assert size < 64 << 20  # cut at the budget, not all 256 MiB
    assert_others_fine(daemon, other)
    assert_closed_cleanly(daemon, victim, pids)


def test_a_disconnected_client_stops_the_run(daemon: Daemon, make: Callable[..., str]) -> None:
    """A client that goes away mid-run: the stream stops and the run is interrupted in
    the sandbox, whose REPL then answers the next call."""
    victim = make()
    code = "import itertools\nfor i in itertools.count():\n    print('z' * 1000, i)\n"
    with Watch(daemon) as watch:
        with httpx.Client(base_url=daemon.url, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as client, \
                client.stream("POST", f"/v1/sandboxes/{victim}/run_code",
                              json={"code": code}) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            for _ in range(100):
                next(lines)
        # The client is gone now.
        started = time.monotonic()
        after = daemon.run(victim, "x = 'still here'\nx", timeout=60)
        elapsed = time.monotonic() - started
    assert after.status_code == 200, after.text
    assert "still here" in after.text
    assert elapsed < LIVE, f"the abandoned run held the REPL for {elapsed:.0f} s"
    assert watch.worst_healthz < LIVE


def test_an_unread_download_is_paced_by_its_reader(daemon: Daemon,
                                                   make: Callable[..., str]) -> None:
    """A file read whose client stops reading: the daemon stops reading the sandbox's
    socket (backpressure) instead of queueing the file."""
    victim = make()
    made = daemon.run(victim, "with open('/tmp/big', 'wb') as f:\n    f.truncate(600 << 20)")
    assert made.status_code == 200 and "error\":null" in made.text, made.text
    with Watch(daemon) as watch, httpx.Client(
            base_url=daemon.url, timeout=60,
            headers={"Authorization": f"Bearer {API_KEY}"}) as client, client.stream(
            "GET", f"/v1/sandboxes/{victim}/files", params={"path": "/tmp/big"}) as reply:
        assert reply.status_code == 200, reply.read()
        next(reply.iter_raw(1 << 16))
        time.sleep(8)  # a reader that does not read
    print(f"unread download: daemon RSS +{watch.growth >> 20} MiB")
    assert watch.growth < 150 << 20, f"the daemon grew by {watch.growth >> 20} MiB"
    # The abandoned read is drained and the sandbox serves again.
    started = time.monotonic()
    assert daemon.run(victim, "1 + 1", timeout=60).status_code == 200
    assert time.monotonic() - started < LIVE


def test_a_disconnected_client_stops_its_command(daemon: Daemon,
                                                 make: Callable[..., str]) -> None:
    """A foreground command whose client went away is killed, not left running (and
    holding the sandbox) until its own timeout."""
    victim = make()
    cmd = "sleep 1000 & echo started; wait"

    def processes() -> str:  # a command sees the sandbox's command namespace
        reply = daemon.http.post(f"/v1/sandboxes/{victim}/commands",
                                 json={"cmd": "ps -e -o comm"}, timeout=60)
        assert reply.status_code == 200 and "ps" in reply.text, reply.text
        return reply.text

    with httpx.Client(base_url=daemon.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client, \
            client.stream("POST", f"/v1/sandboxes/{victim}/commands",
                          json={"cmd": cmd}) as reply:
        assert reply.status_code == 200
        assert "started" in next(reply.iter_lines())
    # The client is gone now: the command's whole process group is killed.
    deadline = time.monotonic() + LIVE
    while True:
        ps = processes()
        if "sleep" not in ps:
            break
        assert time.monotonic() < deadline, f"the abandoned command still runs: {ps}"
        time.sleep(0.2)


FORGED_ENTRIES = {
    "time-is-nan": "{**real(p, st), 'mtime': math.nan}",  # would break the answer's JSON
    "name-is-a-number": "{**real(p, st), 'name': 7}",
    "extra-field": "{**real(p, st), 'secret': 'x' * 100}",
    "negative-size": "{**real(p, st), 'size': -1}",
    "unknown-type": "{**real(p, st), 'type': 'socket'}",
}


@pytest.mark.parametrize("forged", FORGED_ENTRIES.values(), ids=FORGED_ENTRIES.keys())
def test_a_forged_listing_is_refused_and_the_sandbox_goes_on(
        daemon: Daemon, make: Callable[..., str], forged: str) -> None:
    """A listing comes from the sandbox in batches, each checked before it is passed on:
    an entry without an entry's fields and types is refused with a 500 that says so
    (never a body of what the sandbox made up), and the sandbox answers the next call."""
    victim = make()
    assert daemon.run(victim, "import bbagent.files as f, math, os\n"
                              "os.makedirs('/root/d/sub')\n"
                              "real = f._entry\n"
                              f"f._entry = lambda p, st: {forged}").status_code == 200
    reply = daemon.http.get(f"/v1/sandboxes/{victim}/files/list", params={"path": "/root/d"})
    assert reply.status_code == 500, reply.text
    assert "malformed listing" in reply.json()["error"]
    assert daemon.run(victim, "f._entry = real").status_code == 200
    reply = daemon.http.get(f"/v1/sandboxes/{victim}/files/list", params={"path": "/root/d"})
    assert [e["name"] for e in reply.json()["entries"]] == ["sub"]


def test_output_events_for_a_listing_end_only_that_sandbox(daemon: Daemon,
                                                           make: Callable[..., str]) -> None:
    """A listing has no output budget (it is paced by its reader), so its agent may
    send it data and a final event, nothing else: a sandbox whose agent floods a
    listing with stdout events (which nobody reads: the caller waits for entries for
    ever) has its channel closed, and the call ends."""
    victim, other = make(), make()
    pids = daemon.processes(victim)
    assert daemon.run(victim, "import bbagent.files as f, os, sys\n"
                              "os.makedirs('/root/d/sub')\n"
                              "def flood(path, st):\n"
                              "    caller = sys._getframe(1).f_locals\n"
                              "    while True:\n"
                              "        caller['agent'].event(caller['req']['rid'], 'stdout',"
                              " data='x' * 1000)\n"
                              "f._entry = flood").status_code == 200
    started = time.monotonic()
    reply = daemon.http.get(f"/v1/sandboxes/{victim}/files/list", params={"path": "/root/d"},
                            timeout=60)
    assert reply.status_code in (410, 500), reply.text
    assert time.monotonic() - started < LIVE
    assert daemon.run(victim, "1").status_code == 410  # that sandbox's channel is closed
    assert_others_fine(daemon, other)
    assert_closed_cleanly(daemon, victim, pids)


@pytest.mark.parametrize("what", ["download", "listing"])
def test_a_download_or_listing_its_client_left_stops_and_the_repl_lives(
        daemon: Daemon, make: Callable[..., str], what: str) -> None:
    """A client that leaves a download of a 3 GiB file (or a listing of 200,000 entries)
    after its first bytes: the agent read on for nobody, the daemon drained past 1 GiB
    and then cut the sandbox's channel, its REPL and state lost. Now the REPL is
    interrupted (SIGINT: the read stops at its next chunk) and serves the next call
    with its state."""
    victim = make()
    made = daemon.run(victim, "import os\nkept = 'state'\n" + (
        "with open('/tmp/big', 'wb') as f:\n    f.truncate(3 << 30)" if what == "download"
        else "os.makedirs('/tmp/wide')\nfor i in range(200_000):\n"
             "    open(f'/tmp/wide/{i}', 'w').close()"), timeout=300)
    assert made.status_code == 200 and "error\":null" in made.text, made.text
    path, target = ("/files", "/tmp/big") if what == "download" else ("/files/list", "/tmp/wide")
    with httpx.Client(base_url=daemon.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client, \
            client.stream("GET", f"/v1/sandboxes/{victim}{path}",
                          params={"path": target}) as reply:
        assert reply.status_code == 200, reply.read()
        next(reply.iter_raw(1 << 12))
    started = time.monotonic()
    reply = daemon.run(victim, "kept", timeout=60)
    assert reply.status_code == 200 and "'state'" in reply.text, reply.text
    assert time.monotonic() - started < LIVE


# Prepended to a forged answer: the agent's request handlers, from the REPL's own stack.
FORGE = r'''
import gc, math, os, sys
def _find_agent():
    frame = sys._getframe()
    while frame is not None:
        for value in frame.f_locals.values():
            if type(value).__name__ == "Agent":
                return value
        frame = frame.f_back
    return next(o for o in gc.get_objects() if type(o).__name__ == "Agent")
_agent = _find_agent()
_real = dict(_agent._handlers)
def forge(op, answer):
    """The next ``op`` request is answered ``answer`` (once), in the agent's place."""
    def handler(agent, req, payload, fds):
        for fd in fds:
            os.close(fd)
        _agent._handlers[op] = _real[op]
        agent.done(req["rid"], answer)
    _agent._handlers[op] = handler
'''

FORGED_ANSWERS = {
    # The SDK put the pid into the paths of wait and kill: kill() paused another sandbox.
    "exec-pid-is-a-path": ("exec", "{'pid': '../../sbx_other/pause?x='}", "POST", "commands",
                           {"cmd": "true", "background": True}),
    "run-error-is-text": ("run_code", "{'text': None, 'results': {}, 'figures': [], "
                          "'error': 'boom', 'truncated': False, 'timed_out': False, "
                          "'duration': 0.1, 'warnings': []}", "POST", "run_code",
                          {"code": "1"}),
    "exists-says-nothing": ("exists", "{}", "GET", "files/exists", None),
    "stat-size-is-infinite": ("stat", "{'name': 'x', 'path': '/x', 'type': 'file', "
                              "'size': math.inf, 'mode': 420, 'mtime': 0}", "GET", "files/stat",
                              None),
}


@pytest.mark.parametrize("forged", FORGED_ANSWERS.values(), ids=FORGED_ANSWERS.keys())
def test_an_answer_out_of_its_ops_shape_is_refused(daemon: Daemon, make: Callable[..., str],
                                                   forged: tuple) -> None:
    """Whatever answers a request in the agent's place, its result is held to its op's
    shape before anything reads it: a 500 that says so, never a path, a traceback, a
    KeyError in the SDK or a value the client cannot decode; the sandbox goes on."""
    op, answer, method, path, body = forged
    victim = make()
    assert daemon.run(victim, FORGE + f"forge({op!r}, {answer})").status_code == 200
    params = {"path": "/root"} if method == "GET" and path.startswith("files") else None
    reply = daemon.http.request(method, f"/v1/sandboxes/{victim}/{path}", json=body,
                                params=params, timeout=60)
    assert reply.status_code == 500, reply.text
    assert reply.json()["type"] == "MalformedAnswer", reply.text
    assert "../" not in reply.text
    assert daemon.run(victim, "6 * 7").json()["text"] == "42"


def test_a_merge_whose_winner_never_answers_ends_and_unlocks(
        daemon: Daemon, make: Callable[..., str]) -> None:
    """The merge named the winner with a request of its own, without a bound, while it
    held both sandboxes' locks: a winner that never answered held the parent for ever
    (every later call a 409 "busy")."""
    parent = make()
    (child,) = daemon.http.post(f"/v1/sandboxes/{parent}/fork", json={"n": 1},
                                timeout=120).json()["children"]
    assert daemon.run(child, FORGE + "_agent._handlers['sethostname'] = "
                                     "lambda agent, req, payload, fds: None").status_code == 200
    reply = daemon.http.post(f"/v1/sandboxes/{parent}/merge_into/{child}", timeout=60)
    assert reply.status_code == 204, reply.text
    assert daemon.run(parent, "6 * 7").json()["text"] == "42"


def test_output_with_a_lone_surrogate_reaches_clients_encodable(
        daemon: Daemon, make: Callable[..., str]) -> None:
    """A header's ``\\ud800`` escape decodes to a lone surrogate, which no client can
    encode: E2B's process stream ended in an internal error, our SDK handed out a string
    that failed on print(). Output text comes through with U+FFFD in its place."""
    victim = make()
    code = HOSTILE + r'''
s = _ctrl()
s.sendall(frame(b'{"rid": %d, "ev": "stdout", "data": "x\\ud800y"}' % _rid()))
'''
    reply = daemon.run(victim, code)
    assert reply.status_code == 200, reply.text
    lines = [json.loads(line) for line in reply.text.splitlines()]
    assert [line["data"] for line in lines if line["type"] == "stdout"] == ["x\ufffdy"]


def test_a_listing_nested_past_json_depth_is_refused(daemon: Daemon,
                                                     make: Callable[..., str]) -> None:
    """A chunk of 60,000 "[" made json.loads raise RecursionError, which the listing's
    check did not catch: a 500 with a traceback instead of a refusal."""
    victim = make()
    assert daemon.run(victim, FORGE + "_agent._handlers['list'] = lambda agent, req, payload, "
                      "fds: (agent.event(req['rid'], 'chunk', b'[' * 60000), "
                      "agent.done(req['rid'], {'count': 0}))").status_code == 200
    reply = daemon.http.get(f"/v1/sandboxes/{victim}/files/list", params={"path": "/root"})
    assert reply.status_code == 500, reply.text
    assert "malformed listing" in reply.json()["error"]
    assert daemon.run(victim, "6 * 7").json()["text"] == "42"


def test_a_deep_json_result_is_not_taken_for_a_forged_one(daemon: Daemon,
                                                          make: Callable[..., str]) -> None:
    """The check of a run's answer stopped at 64 levels of JSON and called a result one
    level deeper (an honest `_repr_json_`) malformed: the whole run failed."""
    victim = make()
    code = ("class Deep:\n"
            "    def _repr_json_(self):\n"
            "        v = 1\n"
            "        for _ in range(500):\n"
            "            v = [v]\n"
            "        return v\n"
            "Deep()")
    reply = daemon.run(victim, code)
    assert reply.status_code == 200, reply.text
    result = json.loads(reply.text.splitlines()[-1])
    deep = result["results"]["application/json"]
    for _ in range(500):
        deep = deep[0]
    assert deep == 1
