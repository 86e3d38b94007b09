"""``GET /v1/events``: the lifecycle stream of a real daemon, in order, resumable, bounded.

The stream is read by a thread over a real socket (an in-process transport would wait
for the end of a response that never ends).
"""

from __future__ import annotations

import asyncio
import json
import queue
import signal
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from served import ServedDaemon, served_with_key

from branchbox import Sandbox
from branchbox.engine.events import EventBus
from branchbox.engine.records import SandboxRecord

KEY = "events-test-key"


@pytest.fixture(scope="module")
def daemon() -> Iterator[ServedDaemon]:
    with served_with_key("events", KEY) as served:
        yield served


class Listener:
    """A thread reading one ``/v1/events`` stream into a queue of parsed messages."""

    def __init__(self, daemon: ServedDaemon, path: str = "/v1/events",
                 headers: dict[str, str] | None = None) -> None:
        self.messages: queue.Queue[dict] = queue.Queue()
        self._client = daemon.client(KEY)
        self._opened = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(path, headers or {}),
                                        daemon=True)
        self._thread.start()
        assert self._opened.wait(30), "the event stream did not open"

    def _read(self, path: str, headers: dict[str, str]) -> None:
        try:
            with self._client.stream("GET", path, headers=headers,
                                     timeout=httpx.Timeout(60, read=None)) as reply:
                assert reply.status_code == 200, reply.read()
                assert reply.headers["content-type"].startswith("text/event-stream")
                self._opened.set()
                for line in reply.iter_lines():
                    if line.startswith("data: "):
                        self.messages.put(json.loads(line[len("data: "):]))
        except (httpx.HTTPError, RuntimeError):
            pass  # closed by the test

    def until(self, done, within: float = 60) -> list[dict]:
        """Messages up to and including the first for which ``done`` holds."""
        got = []
        while True:
            try:
                msg = self.messages.get(timeout=within)
            except queue.Empty:
                pytest.fail(f"no matching event within {within} s; got {got}")
            got.append(msg)
            if done(msg):
                return got

    def family(self, root: str) -> list[dict]:
        """The events of ``root``'s family, up to the close of ``root``."""
        return [e for e in self.until(_is("close", root)) if e["family"] == root]

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *_: object) -> None:
        self._client.close()
        self._thread.join(10)


def _is(kind: str, sandbox: str):
    return lambda msg: msg["type"] == kind and msg["sandbox"] == sandbox


def test_fork_merge_round_arrives_in_order(daemon: ServedDaemon) -> None:
    with Listener(daemon) as listener:
        with Sandbox(url=daemon.url, api_key=KEY) as parent:
            parent.run_code("print('before the fork')")
            children = parent.fork(n=3)
            children[0].run_code("open('/root/won.txt', 'w').write('x')")
            parent.merge_into(children[0])
            for child in children[1:]:
                child.close()
        ours = listener.family(parent.id)
    assert [e["type"] for e in ours] == [
        "create", "exec", "fork", "exec", "merge", "close", "close", "close"]
    ids = [e["id"] for e in ours]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    create, run, fork, child_run, merge, *closes = ours
    assert create["sandbox"] == parent.id and create["parent"] is None
    assert run["op"] == "run_code" and run["stdout"] == "before the fork\n"
    assert run["error"] is None and run["code"] == "print('before the fork')"
    assert fork["sandbox"] == parent.id and fork["children"] == [c.id for c in children]
    assert child_run["sandbox"] == children[0].id and child_run["parent"] == parent.id
    assert merge["sandbox"] == parent.id and merge["winner"] == children[0].id
    assert [c["sandbox"] for c in closes] == [children[1].id, children[2].id, parent.id]
    assert all(e["ts"] <= f["ts"] for e, f in zip(ours, ours[1:], strict=False))


def test_checkpoint_restore_and_forks_of_a_checkpoint(daemon: ServedDaemon) -> None:
    with Listener(daemon) as listener:
        with Sandbox(url=daemon.url, api_key=KEY) as sb:
            cp = sb.checkpoint("start")
            sb.run_code("x = 1")
            sb.restore(cp)
            (child,) = cp.fork(1)
            child.close()
        ours = listener.family(sb.id)
    assert [e["type"] for e in ours] == [
        "create", "checkpoint", "exec", "restore", "fork", "close", "close"]
    _, made, _, restored, fork, *_ = ours
    assert made["checkpoint"] == cp.id and made["name"] == "start"
    assert restored["sandbox"] == sb.id and restored["checkpoint"] == cp.id
    assert fork["sandbox"] == sb.id and fork["children"] == [child.id]
    assert fork["checkpoint"] == cp.id


def test_pause_and_resume(daemon: ServedDaemon) -> None:
    with Listener(daemon) as listener:
        with Sandbox(url=daemon.url, api_key=KEY) as sb:
            sb.pause()
            sb.resume()
        assert [e["type"] for e in listener.family(sb.id)] == [
            "create", "pause", "resume", "close"]


def test_resume_after_an_id_and_from_last_event_id(daemon: ServedDaemon) -> None:
    with Sandbox(url=daemon.url, api_key=KEY) as sb:
        sb.run_code("1 + 1")
        sb.exec("echo hi")
    with daemon.client(KEY) as http:
        assert http.get("/v1/events", params={"since": "x"}).status_code == 400
        for bad_id in (b"not-an-id", b"\xb2", b"1" * 19):  # "\xb2" is "²", a str.isdigit
            bad = http.get("/v1/events", headers={"Last-Event-ID": bad_id})
            assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["error"]
    # Everything held, then from the middle: the same events, in the same order.
    with Listener(daemon, "/v1/events?since=0") as everything:
        held = everything.until(_is("close", sb.id))
    mine = [e for e in held if e["sandbox"] == sb.id]
    assert [e["type"] for e in mine] == ["create", "exec", "exec", "close"]
    assert mine[2]["op"] == "exec" and mine[2]["stdout"] == "hi\n" and mine[2]["exit_code"] == 0
    middle = mine[1]["id"]
    # An EventSource reconnects with its URL's ``since`` and a newer Last-Event-ID.
    for path, headers in ((f"/v1/events?since={middle}", {}),
                          ("/v1/events?since=0", {"Last-Event-ID": str(middle)})):
        with Listener(daemon, path, headers) as resumed:
            again = resumed.until(_is("close", sb.id))
        assert again[0]["id"] == middle + 1
        assert again == [e for e in held if e["id"] > middle]


def test_events_need_the_key(daemon: ServedDaemon) -> None:
    with daemon.client(None) as http:
        reply = http.get("/v1/events")
        assert reply.status_code == 401 and reply.json()["error"] == "invalid api key"
    with daemon.client("wrong") as http:
        assert http.get("/v1/events").status_code == 401


def test_events_are_in_the_openapi_document(daemon: ServedDaemon) -> None:
    with daemon.client(KEY) as http:
        op = http.get("/openapi.json").json()["paths"]["/v1/events"]["get"]
    assert "text/event-stream" in op["responses"]["200"]["content"]
    assert {p["name"] for p in op["parameters"]} == {"since", "last-event-id"}


def test_a_stalled_subscriber_never_holds_the_engine(daemon: ServedDaemon) -> None:
    """A client that asks for everything and then reads nothing (its receive window a few
    KiB): runs with output go on while their events pile up behind it, and when it reads
    again it gets them all, in order."""
    host, port = daemon.url.removeprefix("http://").split(":")
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    stalled.connect((host, int(port)))
    stalled.sendall(f"GET /v1/events?since=0 HTTP/1.1\r\nHost: x\r\n"
                    f"Authorization: Bearer {KEY}\r\n\r\n".encode())
    try:
        with Sandbox(url=daemon.url, api_key=KEY) as sb:
            for _ in range(40):  # ~40 x 4 KiB of events the stalled client does not take
                sb.run_code("print('y' * 5000); import sys; print('z' * 5000, file=sys.stderr)")
            assert sb.run_code("21 * 2").text == "42"
        stalled.settimeout(60)
        received = b""
        while not any(map(_is("close", sb.id), _messages(received))):
            chunk = stalled.recv(1 << 16)
            assert chunk, "the stream ended"
            received += chunk
    finally:
        stalled.close()
    assert received.startswith(b"HTTP/1.1 200")
    events = _messages(received)
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    runs = [e for e in events if e["sandbox"] == sb.id and e["type"] == "exec"]
    assert len(runs) == 41 and runs[-1]["text"] == "42"
    assert runs[0]["stdout"] == "…" + "y" * 2047 + "\n"


def _messages(raw: bytes) -> list[dict]:
    """The SSE messages in a raw HTTP response read so far (each came in one chunk, so a
    whole data line is whole in it)."""
    return [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n")
            if line.startswith(b"data: ") and line.endswith(b"}")]


def test_a_client_behind_what_is_kept_is_told_what_it_lost() -> None:
    with served_with_key("events-kept", KEY, BRANCHBOX_EVENTS_KEPT="4") as served:
        with Sandbox(url=served.url, api_key=KEY) as sb:
            for _ in range(6):
                sb.run_code("0")  # events 1 (create) to 7: 4 to 7 are kept
            with Listener(served, "/v1/events?since=1") as behind:
                lost, *kept = behind.until(lambda msg: msg.get("id") == 7)
        assert lost == {"type": "lost", "count": 2, "resume": 4}
        assert [e["id"] for e in kept] == [4, 5, 6, 7]
        with Listener(served, "/v1/events?since=99") as unknown:
            (notice,) = unknown.until(lambda msg: msg["type"] == "lost")
        assert notice["count"] == -1  # an id this daemon never gave: from an earlier one


def test_streams_end_when_the_daemon_stops() -> None:
    """A daemon's graceful stop waits for open responses: an event stream that did not end
    by itself would hold it for the whole grace period, then be cancelled."""
    with served_with_key("events-stop", KEY) as served, Listener(served):
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(60) == 0
        log = served.log.read_text()
    assert "graceful shutdown exceeded" not in log, log


def _record(sid: str) -> SandboxRecord:
    return SandboxRecord(id=sid, family=sid, instance="k", image="default")


def test_the_bus_is_bounded_and_says_what_a_slow_subscriber_lost() -> None:
    async def scenario() -> None:
        bus = EventBus(max_events=100, max_bytes=1 << 20)
        slow = bus.subscribe(since=0)
        first = await _next_with_deadline(bus, slow, _record("sbx_first"))
        assert first["sandbox"] == "sbx_first"
        for i in range(1000):  # publish never waits for the subscriber
            bus.publish("exec", _record(f"sbx_{i}"), stdout="x" * 100)
        assert len(bus.recent()) == 100
        lost = await anext(slow)
        assert lost == {"type": "lost", "count": 900, "resume": 902}
        rest = [await anext(slow) for _ in range(100)]
        assert [e["id"] for e in rest] == list(range(902, 1002))
        # Bytes bound the ring too: big events push out old ones sooner.
        small = EventBus(max_events=1000, max_bytes=64 << 10)
        for i in range(100):
            small.publish("exec", _record(f"sbx_{i}"), stdout="y" * 4096)
        assert 10 <= len(small.recent()) <= 16
        # An id from an earlier daemon: a loss of unknown size, then what is held.
        lost, held = small.after(10**9)
        assert lost == -1 and held == small.recent()

    asyncio.run(scenario())


async def _next_with_deadline(bus: EventBus, sub, record: SandboxRecord) -> dict:
    waiting = asyncio.ensure_future(anext(sub))
    await asyncio.sleep(0)
    bus.publish("create", record)
    return await asyncio.wait_for(waiting, 5)
