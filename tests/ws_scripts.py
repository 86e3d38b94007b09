"""WebSocket servers the tests write into a sandbox and run there (plain sockets: the
default image has no WebSocket library)."""

from __future__ import annotations

import textwrap

# ``handshake(conn)`` answers a client's opening handshake on an accepted socket.
HANDSHAKE = textwrap.dedent("""
    import base64, hashlib, socket, struct, sys, threading
    GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

    def handshake(conn):
        data = b""
        while b"\\r\\n\\r\\n" not in data:
            data += conn.recv(4096)
        key = [line.split(b":", 1)[1].strip() for line in data.split(b"\\r\\n")
               if line.lower().startswith(b"sec-websocket-key:")][0]
        accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\n"
                     b"Connection: Upgrade\\r\\nSec-WebSocket-Accept: " + accept + b"\\r\\n\\r\\n")
""")
