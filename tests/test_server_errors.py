"""What the server answers when something goes wrong that no handler expected, and when a
sandbox names its files with bytes that are not UTF-8 (any but NUL and '/' are allowed).

An unexpected exception must come back as a JSON 500 and leave the client's kept-alive
connection usable: Starlette's own last-resort handler re-raised it for the log, and
uvicorn then closed the connection under the client's next call (ReadError). A name
that is not UTF-8 reaches the daemon as a str with lone surrogates, which UTF-8 cannot
encode: diff, listings and commits of one answered 500, the commit already made, and
the files API could not name one (the SDK refused to encode it, the server's query
parser replaced its bytes).
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from branchbox.server.errors import install_error_handlers
from branchbox.server.sandbox_json import SandboxJSON


@pytest.fixture
def failing_server() -> Iterator[Path]:
    """uvicorn serving an app with the server's error handling, on a unix socket: one
    route fails unexpectedly, one answers."""
    app = FastAPI(default_response_class=SandboxJSON)
    install_error_handlers(app)

    @app.get("/fails")
    async def fails() -> dict:
        raise RuntimeError("nobody expected this")

    @app.get("/answers")
    async def answers() -> dict:
        return {"ok": True}

    sock = Path(tempfile.mkdtemp(prefix="branchbox-test-errors-")) / "s.sock"
    server = uvicorn.Server(uvicorn.Config(app, uds=str(sock), log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield sock
    finally:
        server.should_exit = True
        thread.join(30)
        sock.unlink(missing_ok=True)
        sock.parent.rmdir()


def test_an_unexpected_error_is_a_json_500_and_the_connection_goes_on(
        failing_server: Path) -> None:
    """Two requests on one connection, the second sent before the first's answer came:
    both are answered (the connection was closed after the 500 before)."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(failing_server))
        conn.settimeout(30)
        conn.sendall(b"GET /fails HTTP/1.1\r\nHost: s\r\n\r\n"
                     b"GET /answers HTTP/1.1\r\nHost: s\r\n\r\n")
        got = b""
        while got.count(b"HTTP/1.1 ") < 2 or not got.endswith(b'{"ok":true}'):
            chunk = conn.recv(65536)
            if not chunk:
                break
            got += chunk
    assert got.startswith(b"HTTP/1.1 500 "), got
    assert (b'{"error":"internal error: RuntimeError: nobody expected this",'
            b'"type":"SandboxError"}') in got
    assert b"HTTP/1.1 200 " in got and got.endswith(b'{"ok":true}'), got


def test_names_that_are_not_utf8_come_back_from_diff_listing_and_commit(
        harness, workspace: Path) -> None:
    raw = b"bad\xff\xfename"
    name = os.fsdecode(raw)  # as Python names it: 'bad\udcff\udcfename'
    make = (f"import os\nfor d in (b'/root', {os.fsencode(workspace)!r}):\n"
            f"    open(os.path.join(d, {raw!r}), 'w').close()")
    with harness.sandbox(workspace=str(workspace)) as sb:
        (kid,) = sb.fork(1)
        kid.run_code(make)
        assert f"/root/{name}" in sb.diff(kid)["added"]
        assert name in [entry["name"] for entry in kid.files.list("/root")]
        listed = f"/root/{name}"  # the files API takes the name it gave (its bytes)
        kid.files.write(listed, b"written")
        assert kid.files.read(listed) == b"written" and kid.files.exists(listed)
        assert kid.files.stat(listed)["size"] == 7
        assert kid.run_code(f"print(open({os.fsencode(listed)!r}).read())").stdout == "written\n"
        kid.files.write(listed + "2", b"")
        kid.files.remove(listed + "2")
        assert not kid.files.exists(listed + "2")
        assert not kid.files.exists("/root/bad\ufffd\ufffdname")  # not the same file
        sb.merge_into(kid)
        assert sb.commit()["changed"] == [name]
        assert os.listdir(os.fsencode(workspace)) == [raw]

