"""branchbox: fork / explore / commit runtime for AI agents.

The public names load lazily (PEP 562): the runtime imports ``branchbox.*``
submodules inside every sandbox process, which must not pay for httpx.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: every family's launcher imports this package

if TYPE_CHECKING:
    from typing import Any

    from branchbox.sdk import (
        AsyncCheckpoint,
        AsyncCommandHandle,
        AsyncFiles,
        AsyncSandbox,
        AuthError,
        Checkpoint,
        CommandHandle,
        CommandNotFound,
        CommandResult,
        Conflict,
        Execution,
        ExecutionError,
        FileNotFound,
        Files,
        ImageBuildFailed,
        InsufficientStorage,
        InvalidRequest,
        NodeUnavailable,
        PayloadTooLarge,
        ReplGone,
        ResourceLimit,
        Sandbox,
        SandboxError,
        SandboxNotFound,
        SandboxTimeout,
        ServerStopping,
        StaleBranchError,
    )

__all__ = [
    "AsyncCheckpoint",
    "AsyncCommandHandle",
    "AsyncFiles",
    "AsyncSandbox",
    "AuthError",
    "Checkpoint",
    "CommandHandle",
    "CommandNotFound",
    "CommandResult",
    "Conflict",
    "Execution",
    "ExecutionError",
    "FileNotFound",
    "Files",
    "ImageBuildFailed",
    "InsufficientStorage",
    "InvalidRequest",
    "NodeUnavailable",
    "PayloadTooLarge",
    "ReplGone",
    "ResourceLimit",
    "Sandbox",
    "SandboxError",
    "SandboxNotFound",
    "SandboxTimeout",
    "ServerStopping",
    "StaleBranchError",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from branchbox import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'branchbox' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
