"""Why a sandbox's REPL went away under a call, said to the caller instead of "it died".

A call whose REPL channel closes learns only that. The daemon usually knows more:
it was stopping (the call gets 503 and may be retried against the next daemon), it
closed the sandbox (its timeout, a close from another client), or the kernel killed
the REPL for the sandbox's memory limit, or for every sandbox's together (the cgroup
counts OOM kills, and whether its own limit was ever reached).
"""

from __future__ import annotations

import contextlib

from branchbox.engine import errors
from branchbox.engine.live import Live


def repl_ended(sb: Live, during: str, *, closed: bool, stopping: bool) -> errors.EngineError:
    """The error for a call ``during`` whose REPL channel closed. ``closed``: the sandbox
    is no longer live (closed or expired meanwhile); ``stopping``: the server is stopping."""
    if stopping:
        return errors.ServerStopping(
            f"the server is stopping: sandbox {sb.id} was closed during {during}; "
            "retry against the restarted server")
    if closed:
        return errors.SandboxNotFound(
            f"sandbox {sb.id} was closed during {during} (closed by a client, or its "
            "timeout ran out)")
    oom_kills, own_limit = 0, True
    with contextlib.suppress(OSError, ValueError):
        oom_kills = sb.body.cgroup.oom_kills()
        own_limit = sb.body.cgroup.limit_reached()
    if oom_kills and not own_limit:
        return errors.ReplGone(
            f"the REPL of sandbox {sb.id} was killed by the kernel during {during}: the "
            "host's sandboxes together ran out of the memory they share (faster than "
            "the daemon's guard could stop the family holding the most); close it")
    if oom_kills:
        return errors.ReplGone(
            f"the REPL of sandbox {sb.id} was killed by the kernel during {during}: the "
            "sandbox ran out of memory (its memory_mb limit); close it and create one with "
            "a larger memory_mb, or use less memory")
    return errors.ReplGone(
        f"the REPL of sandbox {sb.id} exited during {during} (user code ended the process, "
        "or it was killed from inside the sandbox); close the sandbox")
