"""The daemon on TCP: a kept-alive connection answers without waiting on delayed ACKs."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
from served import ServedDaemon

KEY = "tcp-test-key"


@pytest.fixture(scope="module")
def daemon() -> Iterator[ServedDaemon]:
    served = ServedDaemon("tcp", {**os.environ, "BRANCHBOX_API_KEY": KEY})
    yield served
    served.stop()


def _servers_end(pid: int, client: socket.socket) -> socket.socket:
    """The daemon's own socket of ``client``'s connection (a copy, by pidfd_getfd)."""
    mine = client.getsockname()
    pidfd = os.pidfd_open(pid)
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:  # the daemon opens and closes fds meanwhile (warm sandboxes starting)
                if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    continue
                fd = _pidfd_getfd(pidfd, int(name))
            except OSError:
                continue
            try:
                sock = socket.socket(fileno=fd)
            except OSError:  # the number was given to something else meanwhile
                os.close(fd)
                continue
            try:
                if sock.family == socket.AF_INET and sock.getpeername() == mine:
                    return sock
            except OSError:
                pass
            sock.close()
    finally:
        os.close(pidfd)
    pytest.fail("the daemon holds no socket of this connection")


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    got = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd(2), x86-64
    if got < 0:
        raise OSError(ctypes.get_errno(), "pidfd_getfd")
    return got


def test_answers_are_not_held_back_by_nagle(daemon: ServedDaemon) -> None:
    """Answers go out as uvicorn writes them (TCP_NODELAY on the daemon's side): a
    listener made without naming its protocol left Nagle on for every connection, and
    each answer on a kept-alive connection waited for the client's delayed ACK."""
    port = int(daemon.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"GET /v1/healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        answer = b""
        while not answer.endswith(b"\r\n\r\nok"):  # headers and body: two writes
            answer += client.recv(4096)
        server_end = _servers_end(daemon.proc.pid, client)
        with server_end:
            assert server_end.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
