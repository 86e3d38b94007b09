"""Checks of what a new sandbox is asked to have, shared by every way of making one (a
create, a start from a snapshot)."""

from __future__ import annotations

from branchbox.engine import errors

ENV_MAX = 128 * 1024
"""Bytes of a sandbox's environment (``KEY=value`` strings): one exec's arguments and
environment share the kernel's limit, a quarter of the stack limit (2 MiB at 8 MiB)."""


def check_lifetimes(**seconds: float | None) -> None:
    """A timeout or an idle timeout is more than 0 and at most a week."""
    for name, value in seconds.items():
        if value is not None and not 0 < value <= 7 * 86400:
            raise errors.InvalidRequest(f"{name} must be between 0 and 604800 seconds")


def check_env(env: dict | None) -> None:
    if env is None:
        return
    if not isinstance(env, dict):
        raise errors.InvalidRequest("env must be an object of strings")
    for key, value in env.items():
        if (
            not isinstance(key, str)
            or not isinstance(value, str)
            or not key
            or "=" in key
            or "\0" in key
            or "\0" in value
        ):
            raise errors.InvalidRequest(f"invalid environment variable {key!r}")
    size = sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())
    if size > ENV_MAX:
        raise errors.InvalidRequest(
            f"env is {size} bytes; at most {ENV_MAX} (every command of the sandbox is "
            "started with it, and the kernel limits what an exec takes)")
