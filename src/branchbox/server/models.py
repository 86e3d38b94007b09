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
# Shorter timeouts are no timeouts (a timer that fires before the code starts): refused.
MIN_TIMEOUT = 0.001
PATH_MAX = 4096  # bytes, with the terminating NUL (linux/limits.h)
NAME_MAX = 255


def _shown(text: str) -> str:
    """``text`` for an error message: a hostile 5,000-character value is not echoed."""
    return repr(text) if len(text) <= 80 else repr(text[:77]) + "..."


def check_sandbox_path(path: str) -> str:
    """An absolute path inside the sandbox, with no NUL and no ``..`` component, that
    the kernel can take: under PATH_MAX bytes, each name at most NAME_MAX.

    ``..`` is refused rather than resolved: the agent resolves paths inside the
    sandbox's own root, and a request that needs ``..`` is almost always a bug.
    The lengths are checked here so that a path the kernel would refuse
    (ENAMETOOLONG) is a 400 before any sandbox sees it.
    """
    if "\0" in path:
        raise ValueError("path must not contain NUL bytes")
    if not path.startswith("/"):
        raise ValueError(f"path must be absolute (start with '/'): {_shown(path)}")
    parts = path.split("/")
    if ".." in parts:
        raise ValueError(f"path must not contain '..' components: {_shown(path)}")
    if len(path.encode("utf-8", "surrogateescape")) >= PATH_MAX:
        raise ValueError(f"path must be shorter than {PATH_MAX} bytes: {_shown(path)}")
    if any(len(part.encode("utf-8", "surrogateescape")) > NAME_MAX for part in parts):
        raise ValueError(f"each name in a path must be at most {NAME_MAX} bytes: "
                         f"{_shown(path)}")
    return path


def _check_env(env: dict[str, str]) -> dict[str, str]:
    """Names and values execve can carry: a name is non-empty without '=' or NUL (the
    kernel splits "NAME=value" at the first '='), a value has no NUL."""
    for name, value in env.items():
        if not name or "=" in name or "\0" in name:
            raise ValueError(f"invalid environment variable name {_shown(name)}")
        if "\0" in value:
            raise ValueError(f"environment variable {_shown(name)} must not contain NUL")
    return env


def _check_command(cmd: object) -> object:
    """One clear message instead of pydantic's per-union-member errors; no NUL, which no
    argument of execve can hold."""
    if isinstance(cmd, str) and cmd:
        args = [cmd]
    elif isinstance(cmd, list) and cmd and all(isinstance(arg, str) for arg in cmd):
        args = cmd
    else:
        raise ValueError("cmd must be a non-empty string or a non-empty list of strings")
    if any("\0" in arg for arg in args):
        raise ValueError("cmd must not contain NUL bytes")
    return cmd


SandboxPath = Annotated[str, AfterValidator(check_sandbox_path)]
Command = Annotated[str | list[str], BeforeValidator(_check_command)]
# Finite (no NaN or Infinity, which Python's JSON accepts), at least MIN_TIMEOUT.
Timeout = Annotated[float, Field(ge=MIN_TIMEOUT, le=MAX_RUN_TIMEOUT, allow_inf_nan=False)]
Env = Annotated[dict[str, str], AfterValidator(_check_env)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class NetworkLists(_Body):
    allow_out: list[str] | None = None
    deny_out: list[str] | None = None


class UpdateNetwork(NetworkLists):
    """``PATCH /v1/sandboxes/{id}/network``: fields not given keep their value."""

    internet: bool | None = None
    egress: bool | None = None


class CreateSandbox(_Body):
    """``POST /v1/sandboxes``; the aliases are Podflare's names for the same options."""

    image: str = Field("default", validation_alias=AliasChoices("image", "template"))
    env: Env | None = None
    cwd: SandboxPath | None = None
    timeout: Timeout | None = Field(None, validation_alias=AliasChoices("timeout",
                                                                        "timeout_seconds"))
    memory_mb: int | None = Field(None, validation_alias=AliasChoices("memory_mb", "ram_mib"))
    workspace: SandboxPath | None = None  # a host directory, mounted copy-on-write
    # MiB the sandbox's writable layer may hold (the engine checks the range).
    disk_mb: int | None = None
    # Closed after this many seconds without a request on it (a run in progress is use).
    idle_timeout: Timeout | None = Field(None, validation_alias=AliasChoices(
        "idle_timeout", "idle_timeout_seconds"))
    # Egress through NAT (None: the daemon's default, off unless `serve --internet`);
    # ``egress`` is Podflare's name for it. ``network``: E2B's allow_out/deny_out lists
    # of CIDRs or host names (allow wins over deny).
    internet: bool | None = None
    egress: bool | None = None
    network: NetworkLists | None = None
    # Podflare's: rootfs_gb is taken as disk_mb (x 1024) when disk_mb is not given;
    # a persistent sandbox is kept as a space at its idle timeout (engine.snapshots).
    rootfs_gb: int | None = None
    persistent: bool | None = None
    # Start from this snapshot's instant (engine.snapshots): its image, cwd and limits;
    # env, timeout and the network policy may be given.
    snapshot: str | None = Field(None, min_length=1, max_length=64)


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


class CreateCheckpoint(_Body):
    name: str | None = None  # a label; the engine checks its length


class ResumeSpace(_Body):
    """``POST /v1/spaces/{id}/resume``, Podflare's names."""

    timeout: Timeout | None = Field(None, validation_alias=AliasChoices("timeout",
                                                                        "timeout_seconds"))
    idle_timeout: Timeout | None = Field(None, validation_alias=AliasChoices(
        "idle_timeout", "idle_timeout_seconds"))
    persistent: bool | None = None
    egress: bool | None = None


class CreateSnapshot(_Body):
    name: str | None = None  # an image name (the engine checks it); None: one is made


# The bodies of calls that HTTP carries in their path, as the calls WebSocket takes them
# (server.call_channel): there a call names one sandbox and carries a body.
class Restore(_Body):
    checkpoint: str


class ForkCheckpoint(_Body):
    checkpoint: str
    n: int = 1


class MergeInto(_Body):
    winner: str


class Close(_Body):
    """A close names nothing but its sandbox."""


class Diff(_Body):
    other: str
    paths: list[SandboxPath] | None = None
