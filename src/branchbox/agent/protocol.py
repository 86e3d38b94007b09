"""Framing of the control channel between the daemon and a sandbox's agent.

The channel is a unix stream socket (one end held by the daemon, the other by
the sandbox's REPL process). Every message is one frame::

    !II header_len payload_len | header (UTF-8 JSON object) | payload (raw bytes)

The header carries the meaning; the payload carries file contents without any
base64 inflation. Requests from the daemon have ``{"op": ..., "rid": n, ...}``;
the agent answers with any number of events ``{"rid": n, "ev": "<kind>", ...}``
and exactly one final event, ``"ev": "done"`` (with ``"result"``) or
``"ev": "fail"`` (with ``"error": {"type", "message"}``).

Standard library only: this module runs inside the sandbox on the image's
python3 as well as in the daemon.
"""

from __future__ import annotations

import json
import socket
import struct

_HEAD = struct.Struct("!II")
VERSION = 2  # 2: a listing comes as chunks of entries; SIGINT stops a read or listing
"""What the daemon and the agent say to each other, as one number: raise it with any
change a daemon or an agent of the other version would misread (an op, a field, a
fork slot's fds). A family's REPLs all run the agent its first REPL started with, and
outlive the daemon: a daemon upgraded and restarted re-attaches only to those whose
``ping`` answers its own version (engine.reattach); the others come back stopped."""
CHUNK = 1024 * 1024  # file data travels in frames of at most this many bytes
# A frame is read whole before it can be checked, so these bound what one frame can make
# its reader hold. The header limit is set by the largest legitimate one: a background
# command's ``wait`` result carrying its kept output, JSON-escaped. Payloads are only ever
# file data, in pieces of CHUNK.
MAX_HEADER = 64 * 1024 * 1024
MAX_PAYLOAD = 4 * CHUNK


class ChannelClosed(EOFError):
    """The other end of the control channel went away."""


class FrameTooLarge(ValueError):
    """A frame its reader would refuse (and close the channel for); nothing was sent."""


def encode(header: dict, payload: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER:
        raise FrameTooLarge(f"{len(head) / 2**20:.0f} MiB of JSON, more than the "
                            f"{MAX_HEADER >> 20} MiB a frame may carry")
    return _HEAD.pack(len(head), len(payload)) + head + payload


def decode_header(prefix: bytes) -> tuple[int, int]:
    hlen, plen = _HEAD.unpack(prefix)
    if not 0 < hlen <= MAX_HEADER or plen > MAX_PAYLOAD:
        raise ValueError(f"frame too large: header {hlen}, payload {plen}")
    return hlen, plen


def send(sock: socket.socket, header: dict, payload: bytes = b"", fds: list[int] = ()) -> None:
    """Send one frame; ``fds`` ride along as SCM_RIGHTS on its first byte."""
    data = encode(header, payload)
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk, got, _flags, _addr = socket.recv_fds(sock, n - len(buf), 16)
        fds.extend(got)
        if not chunk:
            raise ChannelClosed("control channel closed")
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket) -> tuple[dict, bytes, list[int]]:
    """Receive one frame: header, payload and any file descriptors sent with it."""
    fds: list[int] = []
    hlen, plen = decode_header(_recv_exact(sock, _HEAD.size, fds))
    header = json.loads(_recv_exact(sock, hlen, fds))
    payload = _recv_exact(sock, plen, fds) if plen else b""
    return header, payload, fds
