"""JSON answers that carry what sandboxes name, whatever bytes the names are."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse


class SandboxJSON(JSONResponse):
    """JSON that carries what sandboxes name: a file name that is not UTF-8 (any bytes but
    NUL and '/') comes from the kernel as a str with lone surrogates, which UTF-8 cannot
    encode. Such a body goes out as ASCII JSON, the surrogates as ``\\udcXX`` escapes that
    a JSON parser turns back into the same str (``os.fsencode`` gives the bytes). Before,
    a diff, a listing or a commit of such a name answered 500 (the commit had been made).

    Set as the app's default response class, which also turns off FastAPI's direct
    serialization of ``-> dict`` answers (it refuses the surrogates)."""

    def render(self, content: Any) -> bytes:
        return dumps(content)


def dumps(content: Any) -> bytes:
    """``content`` as compact JSON, UTF-8; ASCII with escapes if it names what UTF-8
    cannot encode."""
    try:
        return json.dumps(content, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()
