"""Engine errors: each knows its HTTP status and the SDK exception it becomes.

::

    EngineError (500)
    ├── InvalidRequest (400)
    ├── SandboxNotFound (404)
    │   └── SnapshotNotFound (404) no snapshot or space of that name
    ├── Conflict (409)            busy REPL, stale merge/commit
    │   └── StaleBranch (409)
    ├── SandboxTimeout (408)      a run or command hit its timeout
    ├── ReplGone (410)            the sandbox's REPL process died
    ├── CommandsGone (410)        the init of the sandbox's command namespace died
    ├── MalformedAnswer (500)     the sandbox's agent answered out of its op's shape
    ├── PayloadTooLarge (413)
    ├── PathTooLong (422)         a path in the sandbox is longer than the host can name
    ├── ResourceLimit (429)       the sandbox's process limit is reached
    │   └── FamilyOverLimit (429) its family holds more than its live sandboxes may
    ├── ServerStopping (503)      the server is stopping
    └── InsufficientStorage (507) the sandbox's disk limit, or the store, is full

``kind`` is the name the SDK maps back to its own exception class.
"""

from __future__ import annotations


class EngineError(Exception):
    status = 500
    kind = "SandboxError"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(EngineError):
    status = 400
    kind = "InvalidRequest"


class SandboxNotFound(EngineError):
    status = 404
    kind = "SandboxNotFound"

    def __init__(self, message: str = "sandbox not found") -> None:
        super().__init__(message)


class SnapshotNotFound(SandboxNotFound):
    """No snapshot (or Podflare space) of that name: never made, deleted, used up, or
    gone with a daemon's stop."""

    kind = "SnapshotNotFound"


class Conflict(EngineError):
    status = 409
    kind = "Conflict"


class StaleBranch(Conflict):
    kind = "StaleBranchError"


class SandboxTimeout(EngineError):
    status = 408
    kind = "SandboxTimeout"


class ReplGone(EngineError):
    status = 410
    kind = "ReplGone"


class CommandsGone(EngineError):
    """User code killed the init of the sandbox's command namespace (``kill -9 -1`` from
    the REPL): no command can start in it any more; the REPL and files still work."""

    status = 410
    kind = "CommandsGone"


class MalformedAnswer(EngineError):
    """The sandbox's agent answered a request with a result not of its op's shape
    (engine.answers): user code in the sandbox may answer in the agent's place."""

    kind = "MalformedAnswer"


class PayloadTooLarge(EngineError):
    status = 413
    kind = "PayloadTooLarge"


class PathTooLong(EngineError):
    """A sandbox holds a path longer than PATH_MAX (a deep tree, made with relative
    steps): the daemon, as host root, cannot name it to diff, commit or save it."""

    status = 422
    kind = "PathTooLong"

    def __init__(self, doing: str = "") -> None:
        super().__init__(f"{doing}{': ' if doing else ''}the sandbox holds a path longer "
                         "than the host can name (PATH_MAX, 4096 bytes); shorten or remove it")


class CommandNotFound(EngineError):
    status = 400
    kind = "CommandNotFound"


class FileNotFound(EngineError):
    status = 404
    kind = "FileNotFound"


class ImageBuildFailed(EngineError):
    """A step of an image build failed (the message ends with its output); no image was made."""

    status = 422
    kind = "ImageBuildFailed"


class ResourceLimit(EngineError):
    status = 429
    kind = "ResourceLimit"


class FamilyOverLimit(ResourceLimit):
    """A fork or checkpoint refused: the family holds more memory or disk than its live
    sandboxes' limits add up to, or more sandboxes than it may (engine.family_room)."""

    kind = "FamilyOverLimit"

    def __init__(self, message: str, resource: str = "") -> None:
        super().__init__(message)
        self.resource = resource  # "memory" or "disk" when over one of them


class ServerStopping(EngineError):
    status = 503
    kind = "ServerStopping"


class InsufficientStorage(EngineError):
    status = 507
    kind = "InsufficientStorage"


# What an agent "fail" type becomes in the engine.
AGENT_ERRORS: dict[str, type[EngineError]] = {
    "InvalidRequest": InvalidRequest,
    "IsADirectory": InvalidRequest,
    "NotFound": FileNotFound,
    "CommandNotFound": CommandNotFound,
    "Timeout": SandboxTimeout,
    "NoSpace": InsufficientStorage,
    "ResourceLimit": ResourceLimit,
    "Conflict": Conflict,
    "PayloadTooLarge": PayloadTooLarge,
    "CommandsGone": CommandsGone,
}
