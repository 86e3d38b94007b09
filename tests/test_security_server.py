"""The server plane against a hostile sandbox: what the port proxy lets through.

The port proxy shares the daemon's origin, so a browser sends the live page's key
cookie there too; the daemon's credentials must never reach a sandbox's server,
and a page the sandbox serves must not act as the daemon's origin.
"""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import websockets
from ws_scripts import HANDSHAKE

from branchbox import Sandbox
from branchbox.sdk._portal import portal
from branchbox.server.ports import WS_MAX_MESSAGE
from branchbox.server.ui.session import COOKIE

HEADER_ECHO = textwrap.dedent("""
    import json
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Echo(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Set-Cookie", "%s=planted; Path=/")
            self.send_header("Set-Cookie", "app=1; Path=/")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    HTTPServer(("0.0.0.0", 8000), Echo).serve_forever()
""") % COOKIE


def _until_up(fetch: Callable[[], httpx.Response]) -> httpx.Response:
    for _ in range(100):
        reply = fetch()
        if reply.status_code == 200:
            return reply
        time.sleep(0.1)
    pytest.fail(f"the sandbox's server never answered through the proxy: {reply.text}")


def test_the_proxy_keeps_the_daemons_credentials_from_the_sandbox(
        make: Callable[..., Sandbox], harness) -> None:
    sb = make()
    sb.files.write("/srv/echo.py", HEADER_ECHO)
    sb.exec("python3 /srv/echo.py >/dev/null 2>&1", background=True)
    sent = {"Cookie": f"theme=dark; {COOKIE}=the-daemons-key; lang=en",
            "X-API-Key": "the-daemons-key", "X-Access-Token": "a-token",
            "E2B-Traffic-Access-Token": "a-token", "Authorization": "Bearer the-daemons-key",
            "X-Custom": "kept"}

    async def fetch() -> httpx.Response:
        async with httpx.AsyncClient(transport=harness.transport(),
                                     base_url="http://branchbox") as client:
            return await client.get(f"/v1/sandboxes/{sb.id}/ports/8000/", headers=sent)

    reply = _until_up(lambda: portal.run(fetch()))
    seen = reply.json()
    assert "the-daemons-key" not in json.dumps(seen) and "a-token" not in json.dumps(seen)
    assert seen["cookie"] == "theme=dark; lang=en" and seen["x-custom"] == "kept"
    # The sandbox's page is its own opaque origin and cannot plant the daemon's cookie;
    # its own cookies are kept to its prefix (a cookie for "/" reached every sandbox).
    assert reply.headers["content-security-policy"].startswith("sandbox ")
    assert reply.headers.get_list("set-cookie") == [
        f"app=1; Path=/v1/sandboxes/{sb.id}/ports/8000/"]


WS_BIG = HANDSHAKE + textwrap.dedent("""
    size = int(sys.argv[1])
    srv = socket.create_server(("0.0.0.0", 8765))
    while True:
        conn, _ = srv.accept()
        handshake(conn)
        try:  # one binary message of `size` bytes, then a small one
            conn.sendall(b"\\x82\\x7f" + struct.pack(">Q", size))
            for _ in range(size // 65536):
                conn.sendall(bytes(65536))
            conn.sendall(bytes(size % 65536) + b"\\x82\\x05small")
        except OSError:
            pass
        conn.close()
""")


@pytest.fixture(scope="module")
def served() -> Iterator[object]:
    from served import ServedDaemon

    daemon = ServedDaemon("srvsec", {**os.environ, "BRANCHBOX_API_KEY": "srvsec-key"})
    yield daemon
    daemon.stop()


def test_a_sandboxs_oversized_websocket_message_closes_the_relay(served) -> None:
    """A sandbox sending one huge message must not make the daemon hold it whole."""
    with Sandbox(url=served.url, api_key="srvsec-key") as sb:
        sb.files.write("/srv/big.py", WS_BIG)
        sb.exec(f"python3 /srv/big.py {WS_MAX_MESSAGE + 1} >/srv/big.log 2>&1", background=True)
        url = served.url.replace("http://", "ws://") + f"/v1/sandboxes/{sb.id}/ports/8765/"

        async def relay() -> list[object]:
            got: list[object] = []
            for _ in range(100):
                try:
                    async with websockets.connect(
                            url, additional_headers={"Authorization": "Bearer srvsec-key"},
                            max_size=None, proxy=None) as ws:
                        async for message in ws:
                            got.append(len(message))
                    return got
                except websockets.ConnectionClosed:
                    return got
                except (OSError, websockets.InvalidStatus):
                    await asyncio.sleep(0.1)  # the server in the sandbox is not up yet
            pytest.fail("the relay never connected: " + sb.files.read("/srv/big.log").decode())

        got = asyncio.run(relay())
        assert got == [], f"the relay passed on {got} from the sandbox"
