"""Request bodies and parameters: what the REST API accepts, checked before the engine sees it.

Bodies are strict (no "5" for 5, no true for 1) and refuse unknown fields, so
a typo in a field name is a 400 instead of a silently ignored option. Ranges
the engine owns (fork's n, memory, sandbox timeout) are left to the engine,
which knows its configured limits; the edge checks types and shapes.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field

MAX_RUN_TIMEOUT = 7 * 86400.0


def check_sandbox_path(path: str) -> str:
    """An absolute path inside the sandbox, with no NUL and no ``..`` component.

    ``..`` is refused rather than resolved: the agent resolves paths inside the
    sandbox's own root, and a request that needs ``..`` is almost always a bug.
    """
    if "\0" in path:
        raise ValueError("path must not contain NUL bytes")
    if not path.startswith("/"):
        raise ValueError(f"path must be absolute (start with '/'): {path!r}")
    if ".." in path.split("/"):
        raise ValueError(f"path must not contain '..' components: {path!r}")
    return path


def _check_command(cmd: object) -> object:
    """One clear message instead of pydantic's per-union-member errors."""
    if isinstance(cmd, str) and cmd:
        return cmd
    if isinstance(cmd, list) and cmd and all(isinstance(arg, str) for arg in cmd):
        return cmd
    raise ValueError("cmd must be a non-empty string or a non-empty list of strings")


SandboxPath = Annotated[str, AfterValidator(check_sandbox_path)]
Command = Annotated[str | list[str], BeforeValidator(_check_command)]
Timeout = Annotated[float, Field(gt=0, le=MAX_RUN_TIMEOUT)]
Env = dict[str, str]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CreateSandbox(_Body):
    """``POST /v1/sandboxes``; the aliases are Podflare's names for the same options."""

    image: str = Field("default", validation_alias=AliasChoices("image", "template"))
    env: Env | None = None
    cwd: SandboxPath | None = None
    timeout: float | None = Field(None, validation_alias=AliasChoices("timeout",
                                                                      "timeout_seconds"))
    memory_mb: int | None = Field(None, validation_alias=AliasChoices("memory_mb", "ram_mib"))
    workspace: SandboxPath | None = None  # a host directory, mounted copy-on-write
    # Closed after this many seconds without a request on it (a run in progress is use).
    idle_timeout: float | None = Field(None, validation_alias=AliasChoices(
        "idle_timeout", "idle_timeout_seconds"))
    # Accepted so Podflare's SDK can send them. Every sandbox is loopback-only, which
    # already honours egress=false; root filesystems grow on the host's disk (no fixed
    # size); and nothing is frozen into a "space" on idle.
    egress: bool = True
    rootfs_gb: int | None = None
    persistent: bool | None = None


class RunCode(_Body):
    code: str
    timeout: Timeout | None = None


class RunCommand(_Body):
    cmd: Command
    cwd: SandboxPath | None = None
    env: Env | None = None
    timeout: Timeout | None = None
    background: bool = False


class PodflareExec(_Body):
    """Podflare's ``/exec``: one body for Python code and shell scripts."""

    code: str
    language: str = Field("python", pattern="^(python|bash)$")
    timeout: Timeout | None = None


class WaitCommand(_Body):
    timeout: Timeout | None = None


class KillCommand(_Body):
    signal: int = Field(9, ge=1, le=64)


class Fork(_Body):
    n: int = 1


class Diff(_Body):
    other: str
    paths: list[SandboxPath] | None = None
