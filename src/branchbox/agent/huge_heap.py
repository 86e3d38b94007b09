"""The REPL's heap on 2 MiB pages: mimalloc preloaded into the REPL's interpreter only.

fork() copies one page-table entry per mapped page. pymalloc's heap is 4 KiB pages,
so forking a REPL holding 1 GiB copies 262,144 entries (~13 ms a child); Debian's
libmimalloc with ``MIMALLOC_LARGE_OS_PAGES=1`` asks for transparent huge pages
(``madvise`` mode is enough), so the same heap is 512 entries and a write in a child
splits one 2 MiB mapping. Python uses it with ``PYTHONMALLOC=malloc``.

The launcher (``runtime.family_init``) adds the variables to the REPL's environment
only when the sandbox's root has the library and the sandbox's env sets none of them
itself; it names what it added in ``MARKER``. The REPL removes exactly those at boot,
before any user code, so ``os.environ``, commands and subprocesses carry no preload.
An image without the library (a Debian suite, a Dockerfile build) keeps pymalloc.
A daemon started with ``BRANCHBOX_HUGE_HEAP=off`` keeps pymalloc everywhere (to
compare, or on a kernel whose huge pages misbehave).
"""

from __future__ import annotations

import glob
import os

MARKER = "BRANCHBOX_HUGE_HEAP"
# Where Debian's libmimalloc2.0 puts its library, whatever the architecture.
LIBRARY_GLOB = "/usr/lib/*-linux-gnu/libmimalloc.so.2"


def library() -> str | None:
    """The mimalloc library of the root this process sees, or None."""
    found = sorted(glob.glob(LIBRARY_GLOB))
    return found[0] if found else None


def repl_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus the allocator variables, when the root has mimalloc and ``env``
    does not already choose a preload or an allocator (the user's choice wins)."""
    lib = None if os.environ.get(MARKER) == "off" else library()  # the daemon's env
    added = {"LD_PRELOAD": lib, "PYTHONMALLOC": "malloc", "MIMALLOC_LARGE_OS_PAGES": "1"}
    if lib is None or any(name in env for name in (*added, MARKER)):
        return env
    return {**env, **added, MARKER: ",".join(added)}


def strip_environ() -> None:
    """Forget the variables the launcher added (and its marker): the interpreter and
    its allocator are loaded already; nothing this REPL starts should inherit them."""
    names = os.environ.pop(MARKER, "")
    for name in filter(None, names.split(",")):
        os.environ.pop(name, None)
