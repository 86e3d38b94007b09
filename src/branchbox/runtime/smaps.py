"""Memory totals of host processes from /proc/PID/smaps_rollup.

Used by ``info()`` (the REPL's huge-page backed heap, ``agent.huge_heap``) and by
the benches (PSS of a family). The file is the kernel's text, not the sandbox's:
reading it never follows anything a sandbox controls.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def rollup_kib(pids: Iterable[int], fields: tuple[str, ...]) -> int:
    """The sum of ``fields`` (e.g. ``("Pss",)``, ``("AnonHugePages",)``) over these
    host processes, in KiB; a process that exited since it was listed counts 0."""
    kib = 0
    for pid in pids:
        try:
            text = Path(f"/proc/{int(pid)}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            name, _, rest = line.partition(":")
            if name in fields:
                kib += int(rest.split()[0])
    return kib
