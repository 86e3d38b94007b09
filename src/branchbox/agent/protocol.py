"""Framing of the control channel between the daemon and a sandbox's agent.

The channel is a unix stream socket (one end held by the daemon, the other by
the sandbox's REPL process). Every message is one frame::

    !II header_len payload_len | header (UTF-8 JSON object) | payload (raw bytes)

The header carries the meaning; the payload carries file contents without any
base64 inflation. Requests from the daemon have ``{"op": ..., "rid": n, ...}``;
the agent answers with any number of events ``{"rid": n, "ev": "<kind>", ...}``
and exactly one final event, ``"ev": "done"`` (with ``"result"``) or
``"ev": "fail"`` (with ``"error": {"type", "message"}``).

A header the daemon reads from a sandbox is small (:data:`MAX_AGENT_HEADER`):
decoding JSON costs the daemon's one event loop time in proportion to the values
it holds, so an answer with long strings (a cell's result, a command's kept
output) sends them ahead as ``blob`` events (raw UTF-8 payloads) and names where
they go (:func:`spill`, :func:`unspill`).

Standard library only: this module runs inside the sandbox on the image's
python3 as well as in the daemon.
"""

from __future__ import annotations

import json
import socket
import struct

_HEAD = struct.Struct("!II")
VERSION = 3  # 2: a listing in chunks; SIGINT stops a read or listing. 3: spilled strings
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
MAX_AGENT_HEADER = 1024 * 1024
"""Bytes of a header the daemon takes from a sandbox. The rest of an answer travels as
blobs. A header of nothing but tiny values (``[[],[],...]``) costs json.loads ~20-40 ms
a MiB, all of it on the daemon's event loop: at the 64 MiB of MAX_HEADER, one frame
written by user code stopped every sandbox of the daemon for seconds."""
MAX_AGENT_TOKENS = 100_000
"""Commas and opening brackets in such a header, counted before it is decoded. What
json.loads costs is the values it makes (up to ~120 ns each for nested empty lists:
12 ms at this many), and these bytes bound their number from above."""
MAX_SPILLED = MAX_HEADER
"""Bytes of the strings one header may have sent ahead as blobs."""
_SPILLED_AT_LEAST = 256  # characters: shorter strings stay, unless they hold tokens
_SPILL_DEPTH = 32  # containers deep: deeper strings stay (and may make a frame too large)


class ChannelClosed(EOFError):
    """The other end of the control channel went away."""


class FrameTooLarge(ValueError):
    """A frame its reader would refuse (and close the channel for); nothing was sent."""


def encode(header: dict, payload: bytes = b"") -> bytes:
    return frame(_dumps(header), payload)


def frame(head: bytes, payload: bytes = b"") -> bytes:
    """A frame of an encoded header and its payload."""
    if len(head) > MAX_HEADER:
        raise FrameTooLarge(f"{len(head) / 2**20:.0f} MiB of JSON, more than the "
                            f"{MAX_HEADER >> 20} MiB a frame may carry")
    return _HEAD.pack(len(head), len(payload)) + head + payload


def spill(header: dict) -> tuple[bytes, list[bytes]]:
    """``header``, encoded, as it may be sent to the daemon: whole if its JSON fits
    :data:`MAX_AGENT_HEADER` bytes and :data:`MAX_AGENT_TOKENS` (:func:`tokens`), else
    with its heaviest strings None, named in ``"blobs"`` ([path, bytes] in order); and
    those strings' UTF-8 (lone surrogates kept: non-UTF-8 file names), to send first as
    blob events. Raises FrameTooLarge if even that does not fit."""
    limit, max_tokens = MAX_AGENT_HEADER, MAX_AGENT_TOKENS
    encoded = _dumps(header)
    size, count = len(encoded), tokens(encoded)
    if size <= limit and count <= max_tokens:
        return encoded, []
    found: list[tuple[list, str]] = []
    _strings(header, [], found)
    weighed = []
    for path, text in found:
        quoted = json.dumps(text).encode()
        weighed.append((len(quoted) / limit + tokens(quoted) / max_tokens, path, text, quoted))
    weighed.sort(key=lambda item: -item[0])
    moved = []
    for _, path, text, quoted in weighed:
        if size <= limit and count <= max_tokens:
            break
        data = text.encode("utf-8", "surrogatepass")
        entry = json.dumps([path, len(data)]).encode() + b","
        size += len(entry) - len(quoted) + len(b"null")
        count += tokens(entry) - tokens(quoted)
        moved.append((path, data))
    header = json.loads(encoded)  # a copy to punch holes in
    for path, _ in moved:
        _place(header, path, None)
    header["blobs"] = [[path, len(data)] for path, data in moved]
    encoded = _dumps(header)
    if len(encoded) > limit or tokens(encoded) > max_tokens \
            or sum(len(data) for _, data in moved) > MAX_SPILLED:
        raise FrameTooLarge(f"{len(encoded) / 2**20:.1f} MiB of JSON ({tokens(encoded)} "
                            f"values) besides its longest strings, more than a frame to the "
                            f"daemon may carry ({limit >> 20} MiB, {max_tokens})")
    return encoded, [data for _, data in moved]


def tokens(encoded: bytes) -> int:
    """Commas and opening brackets in JSON text, counted at memchr speed: the values and
    keys it holds are at most twice as many, plus one (a string's own commas and brackets
    count too, so never fewer)."""
    return encoded.count(b",") + encoded.count(b"[") + encoded.count(b"{")


def _strings(value: object, path: list, found: list[tuple[list, str]]) -> None:
    if len(path) >= _SPILL_DEPTH:
        return
    items = ((k, v) for k, v in value.items() if type(k) is str) if isinstance(value, dict) \
        else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(item, str) and (len(item) >= _SPILLED_AT_LEAST
                                      or any(c in item for c in ",[{")):
            found.append(([*path, key], item))
        elif isinstance(item, dict | list):
            _strings(item, [*path, key], found)


def _place(header: dict, path: list, value: object) -> None:
    """Set the value at ``path`` (keys and indexes) of ``header``, where one must be."""
    target: object = header
    for key in path[:-1]:
        target = target[key]  # type: ignore[index]
    if not isinstance(target, dict | list):
        raise TypeError("not a container")
    target[path[-1]]  # type: ignore[index]  # KeyError/IndexError: no such place
    target[path[-1]] = value  # type: ignore[index]


def unspill(header: dict, data: bytes) -> dict:
    """``header`` with its ``"blobs"`` put back in place from ``data``, the payloads of the
    blob events that came before it; ``header`` alone if it names none. Raises
    ValueError unless the blobs are exactly ``data``, each valid UTF-8 for a place that
    holds None (a forged header must not put a string where none was)."""
    named = header.pop("blobs", None)
    if named is None:
        if data:
            raise ValueError("blob events before a header that names none")
        return header
    if not isinstance(named, list) or not named:
        raise ValueError("blobs must be a non-empty list")
    at, view = 0, memoryview(data)  # each string decoded from its slice, not a copy of it
    for item in named:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], list)
                and 0 < len(item[0]) <= _SPILL_DEPTH
                and all(type(key) in (str, int) for key in item[0])
                and type(item[1]) is int and item[1] >= 0):
            raise ValueError("a blob must be [path, bytes]")
        path, size = item
        if at + size > len(data):
            raise ValueError("blobs name more bytes than came")
        text = str(view[at : at + size], "utf-8", "surrogatepass")
        at += size
        try:
            if _get(header, path) is not None:
                raise ValueError("a blob's place holds a value already")
            _place(header, path, text)
        except (KeyError, IndexError, TypeError):
            raise ValueError("a blob names a place the header does not have") from None
    if at != len(data):
        raise ValueError("blob events carried more bytes than the header names")
    return header


def _get(header: dict, path: list) -> object:
    target: object = header
    for key in path:
        if isinstance(target, dict) and type(key) is str or \
                isinstance(target, list) and type(key) is int and key >= 0:
            target = target[key]  # type: ignore[index]
        else:
            raise TypeError("no such container")
    return target


def _dumps(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def decode_header(prefix: bytes, max_header: int = MAX_HEADER) -> tuple[int, int]:
    """(header, payload) lengths from a frame's prefix; ValueError past ``max_header`` or
    :data:`MAX_PAYLOAD`."""
    hlen, plen = _HEAD.unpack(prefix)
    if not 0 < hlen <= max_header or plen > MAX_PAYLOAD:
        raise ValueError(f"frame too large: header {hlen}, payload {plen}")
    return hlen, plen


def send(sock: socket.socket, header: dict, payload: bytes = b"", fds: list[int] = ()) -> None:
    """Send one frame; ``fds`` ride along as SCM_RIGHTS on its first byte."""
    send_frame(sock, encode(header, payload), fds)


def send_frame(sock: socket.socket, data: bytes, fds: list[int] = ()) -> None:
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
