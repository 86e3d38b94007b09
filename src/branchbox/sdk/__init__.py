"""The Python SDK: ``Sandbox`` (blocking) and ``AsyncSandbox`` over the REST API.

Implementation modules are private (``_x.py``); these are the public names.
"""

from __future__ import annotations

from branchbox.sdk._async import AsyncCommandHandle, AsyncSandbox
from branchbox.sdk._checkpoints import AsyncCheckpoint
from branchbox.sdk._errors import (
    AuthError,
    CommandNotFound,
    Conflict,
    FileNotFound,
    ImageBuildFailed,
    InsufficientStorage,
    InvalidRequest,
    NodeUnavailable,
    PayloadTooLarge,
    ReplGone,
    ResourceLimit,
    SandboxError,
    SandboxNotFound,
    SandboxTimeout,
    ServerStopping,
    StaleBranchError,
)
from branchbox.sdk._files import AsyncFiles
from branchbox.sdk._results import CommandResult, Execution, ExecutionError
from branchbox.sdk._sync import Checkpoint, CommandHandle, Files, Sandbox

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
