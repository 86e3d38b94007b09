"""How the page's browser proves its key: an HttpOnly cookie set once from ``/ui?key=``.

A browser's ``EventSource`` cannot send an ``Authorization`` header, and a key the
page's script could read would be a key any injected script could steal; so the
key lives in a cookie the script never sees, and the API takes it as the bearer
token. The cookie is ``SameSite=Strict`` and, for anything but a read, the API
also wants the page's own header: a form or image on another site can send
neither, so the cookie cannot be ridden across sites.

The cookie opens only what the page uses: itself, the event stream, its stats
and the diff. Not, above all, the port proxy: a sandbox's own web page served
there would share the daemon's origin, and with the cookie its scripts would
hold the whole API.
"""

from __future__ import annotations

import re

from starlette.requests import HTTPConnection

COOKIE = "branchbox_key"
UI_HEADER = "x-branchbox-ui"
_READS = ("GET", "HEAD")
_PAGE_USES = re.compile(r"/ui|/ui/stats|/v1/events|/v1/sandboxes/sbx_[0-9a-f]{32}/diff")


def authorization(request: HTTPConnection) -> str:
    """The request's ``Authorization`` header, or else, for what the page uses, the page's
    key cookie as one."""
    header = request.headers.get("authorization")
    if header is not None:
        return header
    key = request.cookies.get(COOKIE)
    if not key or not _PAGE_USES.fullmatch(request.url.path):
        return ""
    if request.scope.get("method") in _READS or request.headers.get(UI_HEADER) == "1":
        return f"Bearer {key}"
    return ""
