"""The port proxy against a hostile server in a sandbox: what it may make the daemon hold,
how long, and what its answers may make a client do.

Each test runs a server of its own in a sandbox of a real ``branchbox serve`` (its memory,
its sockets: only the daemon opens TCP connections from the host to a sandbox, so those in
the host's ``/proc/net/tcp`` are the proxy's).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from served import ServedDaemon, env_with_key
from waiting import eventually
from ws_scripts import HANDSHAKE

from branchbox import Sandbox
from branchbox.server.ports import PROXIED_PER_SANDBOX

pytestmark = pytest.mark.timeout(300)

KEY = "ports-sec-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MiB = 1 << 20


@pytest.fixture(scope="module")
def served() -> Iterator[ServedDaemon]:
    daemon = ServedDaemon("portsec", env_with_key(KEY))
    yield daemon
    daemon.stop()


@pytest.fixture
def sandbox(served: ServedDaemon) -> Iterator[Sandbox]:
    with Sandbox(url=served.url, api_key=KEY) as sb:
        yield sb


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) << 10


def _established(ip: str, port: int | None = None) -> int:
    """Established TCP connections from the host to ``ip`` (``:port``)."""
    want = socket.inet_aton(ip)[::-1].hex().upper()  # as /proc/net/tcp prints it
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        address, _, remote_port = fields[2].partition(":")
        if fields[3] == "01" and address == want and port in (None, int(remote_port, 16)):
            count += 1
    return count


def _ws_url(served: ServedDaemon, sb: Sandbox, port: int) -> str:
    return served.url.replace("http://", "ws://") + f"/v1/sandboxes/{sb.id}/ports/{port}/"


async def _connect(url: str, **options: object) -> websockets.ClientConnection:
    """A WebSocket through the proxy, once the sandbox's server (started in the background)
    takes it; uncompressed (a message of zeros would take no room on the way)."""
    for _ in range(100):
        try:
            ws = await websockets.connect(url, additional_headers=AUTH, proxy=None,
                                          close_timeout=1, compression=None, **options)
        except (OSError, websockets.InvalidStatus):
            await asyncio.sleep(0.1)
            continue
        try:  # the proxy accepts, then closes (1011) if nothing listens there yet
            await asyncio.wait_for(asyncio.shield(ws.wait_closed()), 0.5)
        except TimeoutError:
            return ws
    pytest.fail("the sandbox's WebSocket server never took a connection")


PING_FLOOD = HANDSHAKE + textwrap.dedent("""
    srv = socket.create_server(("0.0.0.0", 8765))
    while True:
        conn, _ = srv.accept()
        handshake(conn)
        pings = (b"\\x89\\x7d" + bytes(125)) * 1024
        try:
            while True:
                conn.sendall(pings)  # and never reads a pong
        except OSError:
            open("/tmp/flood-ended", "w").close()
        conn.close()
""")


def test_a_ping_flood_holds_no_memory_and_ends_with_its_client(
        served: ServedDaemon, sandbox: Sandbox) -> None:
    """Its pongs were written without flow control: the daemon grew ~25 MiB/s while the
    client stayed, and on after it left (the relay waited for ever to send its close)."""
    sandbox.files.write("/srv/flood.py", PING_FLOOD)
    sandbox.exec("python3 /srv/flood.py >/dev/null 2>&1", background=True)

    async def scenario() -> int:
        ws = await _connect(_ws_url(served, sandbox, 8765))
        before = _rss(served.proc.pid)
        await asyncio.sleep(15)
        grown = _rss(served.proc.pid) - before
        await ws.close()
        return grown

    grown = asyncio.run(scenario())
    assert grown < 100 * MiB, f"the daemon grew {grown / MiB:.0f} MiB in 15 s"
    assert eventually(lambda: _established(sandbox.ip, 8765) == 0, within=10), \
        "the relay outlived its client"
    assert sandbox.exec("test -e /tmp/flood-ended").exit_code == 0


DEAF = HANDSHAKE + textwrap.dedent("""
    srv = socket.create_server(("0.0.0.0", 8766))
    held = []
    while True:
        conn, _ = srv.accept()
        handshake(conn)
        held.append(conn)  # reads nothing, sends nothing
""")


def test_a_server_that_never_reads_is_let_go_once_its_client_leaves(
        served: ServedDaemon, sandbox: Sandbox) -> None:
    """Sending to it waited for ever, and so did the relay's close once its client left."""
    sandbox.files.write("/srv/deaf.py", DEAF)
    sandbox.exec("python3 /srv/deaf.py >/dev/null 2>&1", background=True)

    async def scenario() -> int:
        ws = await _connect(_ws_url(served, sandbox, 8766))
        sent = 0
        with contextlib.suppress(TimeoutError):
            for _ in range(64):  # until the daemon takes no more (the kernel takes ~70 MiB)
                await asyncio.wait_for(ws.send(bytes(4 * MiB)), 3)
                sent += 1
        ws.transport.abort()
        return sent

    sent = asyncio.run(scenario())
    assert sent < 64, "the sandbox's server took everything: nothing was held up"
    assert eventually(lambda: _established(sandbox.ip, 8766) == 0, within=45), \
        "the relay outlived its client"


def test_a_relay_ends_when_its_sandbox_closes(served: ServedDaemon, sandbox: Sandbox) -> None:
    """A quiet relay to a closed sandbox waited on an address that never answers again,
    until the keepalive gave up (~40 s): its client was kept, and so was the relay."""
    sandbox.files.write("/srv/deaf.py", DEAF)
    sandbox.exec("python3 /srv/deaf.py >/dev/null 2>&1", background=True)

    async def scenario() -> None:
        ws = await _connect(_ws_url(served, sandbox, 8766))
        await asyncio.to_thread(sandbox.close)
        try:
            await asyncio.wait_for(ws.wait_closed(), 20)
        except TimeoutError:
            pytest.fail("the relay outlived its sandbox by 20 s")

    asyncio.run(scenario())


SMUGGLING = textwrap.dedent("""
    import socket, threading
    srv = socket.create_server(("0.0.0.0", 8200))
    def serve(conn):
        request = conn.recv(65536)
        if b"/first" in request:  # answers twice: the second for a request never made
            conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 5\\r\\n\\r\\nfirst"
                         b"HTTP/1.1 200 OK\\r\\nContent-Length: 6\\r\\n\\r\\nforged")
        else:
            conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 4\\r\\n\\r\\nreal")
        threading.Event().wait()  # keeps the connection open
    while True:
        threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
""")


def test_an_answer_nobody_asked_for_is_no_later_requests_answer(
        served: ServedDaemon, sandbox: Sandbox) -> None:
    """A connection kept for later requests carried a second answer the server sent to
    the first one, and the next request to that address got it: an address a sandbox
    made later may hold."""
    sandbox.files.write("/srv/smuggle.py", SMUGGLING)
    sandbox.exec("python3 /srv/smuggle.py >/dev/null 2>&1", background=True)
    prefix = f"/v1/sandboxes/{sandbox.id}/ports/8200"
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as client:
        assert eventually(lambda: client.get(f"{prefix}/first").text == "first")
        assert client.get(f"{prefix}/second").text == "real"


STREAMER = HANDSHAKE + textwrap.dedent("""
    size = int(sys.argv[1])
    srv = socket.create_server(("0.0.0.0", 8767))

    def stream(conn):
        handshake(conn)
        frame = b"\\x82\\x7f" + struct.pack(">Q", size) + bytes(size)
        try:
            while True:
                conn.sendall(frame)
        except OSError:
            conn.close()

    while True:
        threading.Thread(target=stream, args=(srv.accept()[0],), daemon=True).start()
""")


def test_clients_that_never_read_cost_a_bounded_relay_each(
        served: ServedDaemon, sandbox: Sandbox) -> None:
    """A relay held up to four of the server's messages in a queue on top of those in hand
    and in the client's send buffer: ~55 MiB a client at 8 MiB messages."""
    sandbox.files.write("/srv/stream.py", STREAMER)
    sandbox.exec(f"python3 /srv/stream.py {8 * MiB} >/dev/null 2>&1", background=True)
    url = _ws_url(served, sandbox, 8767)

    async def scenario() -> int:
        clients = [await _connect(url, max_size=None, max_queue=1)]
        before = _rss(served.proc.pid)
        clients += [await _connect(url, max_size=None, max_queue=1) for _ in range(5)]
        for ws in clients:  # they read nothing: stop reading their sockets at once
            ws.transport.pause_reading()
        await asyncio.sleep(10)
        grown = _rss(served.proc.pid) - before
        for ws in clients:
            ws.transport.abort()
        return grown

    grown = asyncio.run(scenario())
    assert grown < 5 * 40 * MiB, f"five more relays grew the daemon {grown / MiB:.0f} MiB"


NEVER_ANSWERS = textwrap.dedent("""
    import socket, threading
    server = socket.create_server(("0.0.0.0", 8100), backlog=512)
    held = []
    while True:
        held.append(server.accept()[0])  # reads nothing, answers nothing
""")


def test_requests_given_up_before_an_answer_are_dropped(served: ServedDaemon,
                                                        sandbox: Sandbox) -> None:
    """They were held for ever: 256 of them made every later request to the sandbox a 429,
    and their sockets outlived the sandbox."""
    sandbox.files.write("/srv/never.py", NEVER_ANSWERS)
    sandbox.exec("python3 /srv/never.py >/dev/null 2>&1", background=True)
    sandbox.files.write("/srv/www/hello.txt", "hello\n")
    sandbox.exec("cd /srv/www && python3 -m http.server --bind 0.0.0.0 8000 >/dev/null 2>&1",
                 background=True)
    base = f"{served.url}/v1/sandboxes/{sandbox.id}/ports"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)

    async def impatient(count: int) -> list[object]:
        async with httpx.AsyncClient(headers=AUTH, timeout=3, limits=limits) as client:
            return await asyncio.gather(*[client.get(f"{base}/8100/") for _ in range(count)],
                                        return_exceptions=True)

    assert eventually(lambda: httpx.get(f"{base}/8000/hello.txt", headers=AUTH,
                                        timeout=10).status_code == 200)
    replies = asyncio.run(impatient(PROXIED_PER_SANDBOX + 44))
    assert sum(isinstance(r, httpx.TimeoutException) for r in replies) == PROXIED_PER_SANDBOX
    assert eventually(lambda: _established(sandbox.ip, 8100) == 0, within=10), \
        "the daemon kept its requests of clients that left"
    assert httpx.get(f"{base}/8000/hello.txt", headers=AUTH, timeout=10).status_code == 200

    async def patient_then_close() -> list[object]:
        async with httpx.AsyncClient(headers=AUTH, timeout=60, limits=limits) as client:
            waiting = [asyncio.ensure_future(client.get(f"{base}/8100/")) for _ in range(20)]
            while _established(sandbox.ip, 8100) < 20:
                await asyncio.sleep(0.1)
            await asyncio.to_thread(sandbox.close)
            started = time.monotonic()
            replies = await asyncio.gather(*waiting, return_exceptions=True)
            assert time.monotonic() - started < 10, "requests outlived their sandbox"
            return replies

    ip = sandbox.ip
    replies = asyncio.run(patient_then_close())
    assert [getattr(r, "status_code", r) for r in replies] == [502] * 20
    assert _established(ip) == 0


REDIRECTING = textwrap.dedent("""
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    victim = "/v1/sandboxes/" + sys.argv[1]

    class Redirecting(BaseHTTPRequestHandler):
        def answer(self):
            targets = {"/": victim, "/scheme": "https:" + victim,
                       "/named": "https://daemon.example" + victim}
            if self.path not in targets:
                body = self.path.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(307)
            self.send_header("Location", targets[self.path])
            self.send_header("Content-Location", "../../../.." + victim)
            self.send_header("Refresh", "0; url=http://127.0.0.1:%s%s" % (sys.argv[2], victim))
            self.send_header("Set-Cookie", "branchbox_key =planted; Path=/")
            self.send_header("Set-Cookie", "Branchbox_Key\\t=planted")
            self.send_header("Set-Cookie", "app=1; Path=/")
            self.send_header("Set-Cookie", "=branchbox_key=planted")  # sent as that name
            self.send_header("Set-Cookie", "wide=1; Domain=example.com; Path=/app; HttpOnly")
            self.send_header("Clear-Site-Data", '"*"')
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_DELETE = answer

        def log_message(self, *args):
            pass

    HTTPServer(("0.0.0.0", 8000), Redirecting).serve_forever()
""")


def test_a_sandboxs_redirects_stay_under_its_prefix(served: ServedDaemon,
                                                   sandbox: Sandbox) -> None:
    """A 307 to ``/v1/sandboxes/<victim>`` made a client that follows redirects (python
    requests, httpx) send the daemon's key there, with its DELETE: the victim closed."""
    with Sandbox(url=served.url, api_key=KEY) as victim:
        sandbox.files.write("/srv/redirect.py", REDIRECTING)
        sandbox.exec(f"python3 /srv/redirect.py {victim.id} {served.port} >/dev/null 2>&1",
                     background=True)
        prefix = f"/v1/sandboxes/{sandbox.id}/ports/8000"
        with httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as client:
            assert eventually(lambda: client.get(f"{prefix}/").status_code == 307)
            reply = client.get(f"{prefix}/")
            followed = client.delete(f"{prefix}/", follow_redirects=True)
            assert client.get(f"/v1/sandboxes/{victim.id}").status_code == 200
            # "https:/v1/..." names no host: on an https page (a TLS proxy in front) it is
            # the daemon's own path; a proxy's name for the daemon is the daemon's too.
            scheme_only = client.get(f"{prefix}/scheme").headers["location"]
            named = client.get(f"{prefix}/named", headers={
                "X-Forwarded-Host": "daemon.example"}).headers["location"]
            elsewhere = client.get(f"{prefix}/named").headers["location"]
    moved = f"{prefix}/v1/sandboxes/{victim.id}"
    assert followed.status_code == 200 and followed.text == f"/v1/sandboxes/{victim.id}"
    assert reply.headers["location"] == scheme_only == named == moved
    assert elsewhere == f"https://daemon.example/v1/sandboxes/{victim.id}"  # another host
    assert reply.headers["content-location"] == moved
    assert reply.headers["refresh"] == f"0; url={moved}"
    # Kept to the sandbox's prefix: a cookie for "/" reached every sandbox's server.
    assert reply.headers.get_list("set-cookie") == [
        f"app=1; Path={prefix}/", f"wide=1; HttpOnly; Path={prefix}/app"]
    assert "clear-site-data" not in reply.headers
