"""The SDK's exceptions, and the one table that turns a server reply into one of them.

::

    SandboxError                      anything the SDK raises (also: daemon unreachable)
    ├── InvalidRequest                bad arguments (400)
    ├── AuthError                     missing or wrong API key (401)
    ├── SandboxNotFound               no such sandbox: closed, expired or never made (404)
    ├── FileNotFound                  no such file in the sandbox (also a FileNotFoundError)
    ├── SandboxTimeout                a run or command hit its timeout (also a TimeoutError)
    ├── Conflict                      the sandbox is busy, or the operation lost a race (409)
    │   └── StaleBranchError          a sibling merged or committed first
    ├── ReplGone                      the sandbox's REPL died, or its command init (410)
    ├── CommandNotFound               exec of a program the sandbox does not have
    ├── PayloadTooLarge               upload over the server's limit (413)
    ├── ResourceLimit                 the sandbox's process limit is reached (429)
    ├── ServerStopping                the server stopped during the call (503)
    ├── NodeUnavailable               behind a gateway: the sandbox's node is down (503)
    └── InsufficientStorage           the sandbox's disk limit or the store is full (507)

Every message ends with a hint on how to fix the problem.
"""

from __future__ import annotations

from typing import Any, ClassVar


class SandboxError(Exception):
    """Base of every SDK exception. ``message`` is the server's text, ``status`` its HTTP
    status (None for failures on this side), ``kind`` the server's error type."""

    hint: ClassVar[str] = ""

    def __init__(self, message: str, *, status: int | None = None, kind: str | None = None,
                 hint: str | None = None) -> None:
        hint = self.hint if hint is None else hint
        super().__init__(f"{message}; {hint}" if hint else message)
        self.message = message
        self.status = status
        self.kind = kind or type(self).__name__


class InvalidRequest(SandboxError):
    hint = "check the arguments against the SDK's documentation"


class AuthError(SandboxError):
    hint = "pass api_key= or set BRANCHBOX_API_KEY to a key the server accepts"


class SandboxNotFound(SandboxError):
    hint = ("the sandbox was closed, merged, expired through its timeout, or never existed; "
            "`branchbox ls` lists the live ones")


class FileNotFound(SandboxError, FileNotFoundError):
    hint = "check the path inside the sandbox with files.list() or files.exists()"


class SandboxTimeout(SandboxError, TimeoutError):
    """The call ran out of time. A run its interrupt stopped keeps the REPL and its
    variables; one that ignored the interrupt had the sandbox's processes killed (the
    message says so, and later calls get ReplGone). ``result`` (an Execution or
    CommandResult) holds what it printed before it was stopped, when the server sent that."""

    hint = ("pass a larger timeout= or split the work (the REPL state is kept unless the "
            "message says its processes were killed)")
    result: Any = None


class Conflict(SandboxError):
    # Not only "busy": a name taken, a paused sandbox, a branch whose parent moved on.
    hint = ("retry once what the message names has changed (a busy sandbox: once its "
            "current call has finished)")


class StaleBranchError(Conflict):
    hint = "a sibling branch merged or committed first; fork again from the parent"


class ReplGone(SandboxError):
    hint = "the sandbox's REPL process died (out of memory, or killed); close the sandbox"


class CommandNotFound(SandboxError):
    """``result`` is the command's result (its stderr says what the shell said)."""

    hint = "install the program in the sandbox or check its name and PATH"
    result: Any = None


class PayloadTooLarge(SandboxError):
    hint = ("send less at once (split the file, or raise the server's --max-upload-mb) "
            "or ask for less (a listing of fewer entries: exec `ls` or os.scandir in code)")


class ImageBuildFailed(SandboxError):
    hint = "fix the failing step (its output is above); no image was made"


class ResourceLimit(SandboxError):
    hint = "wait for the sandbox's processes to exit, or kill some (exec('pkill ...'))"


class ServerStopping(SandboxError):
    hint = "the call may not have run; retry it once the server is back"


class NodeUnavailable(SandboxError):
    hint = ("the node that holds this sandbox does not answer the gateway; the call may not "
            "have run. Retry once the node is back: sandboxes on other nodes are unaffected")


class InsufficientStorage(SandboxError, OSError):
    """Also an OSError, as a full disk is for local code."""

    hint = ("delete files in the sandbox, or create it with a larger disk_mb; if the store "
            "itself is full, the server's host disk needs room")


# The server's error "type" -> exception, with the HTTP status that means the same thing
# when a reply carries no type (a proxy's error page, an older server).
_TABLE: dict[str, tuple[type[SandboxError], int | None]] = {
    "InvalidRequest": (InvalidRequest, 400),
    "EndpointNotFound": (InvalidRequest, None),
    "MethodNotAllowed": (InvalidRequest, 405),
    "AuthError": (AuthError, 401),
    "SandboxNotFound": (SandboxNotFound, 404),
    "SnapshotNotFound": (SandboxNotFound, None),
    "FileNotFound": (FileNotFound, None),
    "SandboxTimeout": (SandboxTimeout, 408),
    "Conflict": (Conflict, 409),
    "StaleBranchError": (StaleBranchError, None),
    "ReplGone": (ReplGone, 410),
    "CommandsGone": (ReplGone, None),
    "CommandNotFound": (CommandNotFound, None),
    "PayloadTooLarge": (PayloadTooLarge, 413),
    "ResourceLimit": (ResourceLimit, 429),
    "FamilyOverLimit": (ResourceLimit, None),
    "ServerStopping": (ServerStopping, 503),
    "NodeUnavailable": (NodeUnavailable, None),
    "InsufficientStorage": (InsufficientStorage, 507),
    "ImageBuildFailed": (ImageBuildFailed, 422),
    "PathTooLong": (SandboxError, None),  # a sandbox's path too long for the host (422)
    "MalformedAnswer": (SandboxError, None),  # the sandbox's agent answered out of shape
}
_BY_STATUS = {status: cls for cls, status in _TABLE.values() if status is not None}
# Kinds whose class's hint does not fit them.
_HINTS = {"CommandsGone": "the REPL and files still work; close the sandbox for one that "
                          "runs commands",
          "MalformedAnswer": "code in the sandbox answered in its agent's place; close the "
                             "sandbox if that was not meant",
          "SnapshotNotFound": "Sandbox.list_snapshots() lists the snapshots; one lasts "
                              "until deleted (a space until resumed) or the server stops",
          "FamilyOverLimit": "free memory or delete files in the family's sandboxes, delete "
                             "checkpoints or close sandboxes, then retry"}


def error_from_reply(status: int, body: Any) -> SandboxError:
    """The exception for an error reply ``{"error": message, "type": kind}`` (or any body)."""
    if isinstance(body, dict):
        message = str(body.get("error") or body.get("message") or f"HTTP {status}")
        kind = body.get("type")
    else:
        message, kind = ("" if body is None else str(body).strip()) or f"HTTP {status}", None
    cls = _TABLE[kind][0] if kind in _TABLE else _BY_STATUS.get(status, SandboxError)
    return cls(message, status=status, kind=kind, hint=_HINTS.get(kind))


def error_from_line(line: dict) -> SandboxError:
    """The exception for a stream's ``error`` line (``{"type": "error", "error",
    "kind", "status"}``: how a run reports a failure once its answer has begun)."""
    return error_from_reply(line.get("status", 500), {"error": line.get("error"),
                                                      "type": line.get("kind")})
