"""``build_image``: a spec and a context directory sent as one tar, progress read back.

The context is packed on this side, as Docker's client does: files, directories and
symlinks (as links, never followed), each under its path relative to the context;
anything else (a socket, a device, a fifo) is refused here with its path. The spec
travels in the same tar under a name of its own, which the server leaves out of
what COPY sees.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path

from branchbox.sdk._errors import InvalidRequest, error_from_reply
from branchbox.sdk._http import Api

SPEC_MEMBER = ".branchbox-spec"


def context_tar(spec: str, context: str | Path | None) -> bytes:
    """A tar of directory ``context`` (or of nothing) with ``spec`` as SPEC_MEMBER."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        data = spec.encode()
        info = tarfile.TarInfo(SPEC_MEMBER)
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
        if context is not None:
            root = Path(context)
            if not root.is_dir():
                raise InvalidRequest(f"the build context {str(root)!r} is not a directory")
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                for entry in (*dirnames, *sorted(filenames)):
                    path = Path(dirpath) / entry
                    mode = path.lstat().st_mode
                    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                        raise InvalidRequest(f"{path} is a special file; a build context "
                                             "holds only files, directories and symlinks")
                    tar.add(path, arcname=str(path.relative_to(root)), recursive=False)
    return buffer.getvalue()


async def build(api: Api, name: str, body: bytes, internet: bool | None,
                on_event: Callable[[dict], None] | None) -> dict:
    """POST the build (``body``: a :func:`context_tar`), hand each progress line to
    ``on_event``; the image's info."""
    params: dict[str, str] = {"name": name, "spec": SPEC_MEMBER}
    if internet is not None:
        params["internet"] = "true" if internet else "false"
    lines = api.lines("POST", "/v1/images", params=params, content=body,
                      headers={"content-type": "application/x-tar"})
    async with contextlib.aclosing(lines):  # closed here, not by the loop's shutdown
        async for line in lines:
            kind = line.get("type")
            if kind == "error":
                raise error_from_reply(line.get("status", 500),
                                       {"error": line.get("error"), "type": line.get("kind")})
            if kind == "image":
                return {k: v for k, v in line.items() if k != "type"}
            if on_event is not None:
                on_event(line)
    raise error_from_reply(502, "the server's stream ended before the build's result")
