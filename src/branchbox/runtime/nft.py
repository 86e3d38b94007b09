"""nftables through its own library: libnftables' JSON API, loaded with ctypes.

Debian ships the library (``libnftables1``) and a pure-ctypes Python module
(``python3-nftables``) for the system's python3 only; the project's virtualenv
runs another interpreter, and adding the system's whole dist-packages to it
would drag in every other Debian module. The part we need is five C calls, so
they are wrapped here. No ``nft`` process is ever started: a command is one
netlink transaction, all or nothing.
"""

from __future__ import annotations

import ctypes
import json
import threading

_SONAME = "libnftables.so.1"
_OUTPUT_JSON = 1 << 4  # NFT_CTX_OUTPUT_JSON
_OUTPUT_HANDLE = 1 << 3  # NFT_CTX_OUTPUT_HANDLE


class NftError(RuntimeError):
    """A command was refused; the message is libnftables' own."""


class Nft:
    """One libnftables context; thread-safe (one command at a time)."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL(_SONAME, use_errno=True)
        except OSError as exc:
            raise NftError(f"{_SONAME} is missing: install Debian's libnftables1 "
                           "(make system-deps does)") from exc
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        self._lib = lib
        self._ctx = lib.nft_ctx_new(0)
        lib.nft_ctx_output_set_flags(self._ctx, _OUTPUT_JSON | _OUTPUT_HANDLE)
        lib.nft_ctx_buffer_output(self._ctx)
        lib.nft_ctx_buffer_error(self._ctx)
        self._lock = threading.Lock()

    def run(self, commands: list[dict]) -> dict:
        """Run ``{"nftables": commands}`` as one transaction; returns the JSON output
        (``{}`` for commands that print nothing)."""
        text = json.dumps({"nftables": commands}).encode()
        with self._lock:
            rc = self._lib.nft_run_cmd_from_buffer(self._ctx, text)
            out = self._lib.nft_ctx_get_output_buffer(self._ctx) or b""
            err = self._lib.nft_ctx_get_error_buffer(self._ctx) or b""
        if rc != 0:
            raise NftError(err.decode(errors="replace").strip() or f"nft command failed ({rc})")
        return json.loads(out) if out.strip() else {}

    def run_text(self, text: str) -> None:
        """Run commands in nft's own syntax (a base ruleset reads better so), one
        transaction."""
        with self._lock:
            rc = self._lib.nft_run_cmd_from_buffer(self._ctx, text.encode())
            err = self._lib.nft_ctx_get_error_buffer(self._ctx) or b""
        if rc != 0:
            raise NftError(err.decode(errors="replace").strip() or f"nft command failed ({rc})")

    def tables(self) -> list[tuple[str, str]]:
        """(family, name) of every table in the host's ruleset."""
        out = self.run([{"list": {"tables": {}}}])
        return [(item["table"]["family"], item["table"]["name"])
                for item in out.get("nftables", []) if "table" in item]

    def close(self) -> None:
        if self._ctx:
            self._lib.nft_ctx_free(self._ctx)
            self._ctx = None
