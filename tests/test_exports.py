"""The public names of ``branchbox`` are a contract (API.md): pin them."""

from __future__ import annotations

import subprocess
import sys

import pytest

import branchbox
import branchbox.sdk

PUBLIC = [
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


def test_all_is_pinned() -> None:
    assert branchbox.__all__ == PUBLIC
    assert branchbox.sdk.__all__ == PUBLIC


def test_every_public_name_resolves_to_the_sdk_object() -> None:
    for name in PUBLIC:
        assert getattr(branchbox, name) is getattr(branchbox.sdk, name)
        assert name in dir(branchbox)


def test_errors_share_one_root() -> None:
    errors = [getattr(branchbox, name) for name in PUBLIC
              if isinstance(getattr(branchbox, name), type)
              and issubclass(getattr(branchbox, name), BaseException)]
    assert len(errors) == 16
    assert all(issubclass(cls, branchbox.SandboxError) for cls in errors)
    assert issubclass(branchbox.SandboxTimeout, TimeoutError)
    assert issubclass(branchbox.FileNotFound, FileNotFoundError)
    assert issubclass(branchbox.StaleBranchError, branchbox.Conflict)


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        branchbox.NoSuchThing  # noqa: B018


def test_importing_branchbox_does_not_load_the_sdk() -> None:
    """Sandbox processes import branchbox.* submodules; they must not pay for httpx."""
    probe = ("import sys, branchbox, branchbox.engine.config; "
             "print(sorted(m for m in ('httpx', 'branchbox.sdk') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
