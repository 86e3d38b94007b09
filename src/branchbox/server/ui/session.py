"""How the page's browser proves its key: an HttpOnly cookie set once from ``/ui?key=``.

A browser's ``EventSource`` cannot send an ``Authorization`` header, and a key the
page's script could read would be a key any injected script could steal; so the
key lives in a cookie the script never sees, and the API takes it as the bearer
token. The cookie is ``SameSite=Strict`` and, for anything but a read, the API
also wants the page's own header: a form or image on another site can send
neither, so the cookie cannot be ridden across sites.
"""

from __future__ import annotations

from starlette.requests import HTTPConnection

COOKIE = "branchbox_key"
UI_HEADER = "x-branchbox-ui"
_READS = ("GET", "HEAD")


def authorization(request: HTTPConnection) -> str:
    """The request's ``Authorization`` header, or else the page's key cookie as one."""
    header = request.headers.get("authorization")
    if header is not None:
        return header
    key = request.cookies.get(COOKIE)
    method = request.scope.get("method", "GET")
    if key and (method in _READS or request.headers.get(UI_HEADER) == "1"):
        return f"Bearer {key}"
    return ""
