"""A sandbox's root filesystem: an overlay of its writable layer over frozen layers.

The overlay is built with the new mount API (fsopen/fsconfig/fsmount), which
hands back a *detached* mount: it never appears in the daemon's mount table,
so nothing on the host can trip over it, and the fd can be sent to a process
that attaches it inside its own mount namespace. Lower layers are added one
by one (``lowerdir+``), so no option-string length limit caps the chain.

Lowest layers, bottom up: the image, then the agent layer (the agent's code
at /.branchbox plus the mount points entry.py uses), then frozen layers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from branchbox.agent import sysc
from branchbox.storage.idmap import UID_BASE

_MOUNT_ATTR_NODEV = 0x4
_AGENT_SOURCE = Path(__file__).resolve().parent.parent / "agent"


def overlay_tree(upper: Path, work: Path, lowers: list[Path]) -> int:
    """A detached overlay mount (close-on-exec fd); ``lowers`` top first."""
    fs = sysc.fsopen("overlay")
    try:
        for lower in lowers:
            sysc.fsconfig(fs, sysc.FSCONFIG_SET_STRING, "lowerdir+", str(lower))
        sysc.fsconfig(fs, sysc.FSCONFIG_SET_STRING, "upperdir", str(upper))
        sysc.fsconfig(fs, sysc.FSCONFIG_SET_STRING, "workdir", str(work))
        sysc.fsconfig(fs, sysc.FSCONFIG_CMD_CREATE)
        return sysc.fsmount(fs, _MOUNT_ATTR_NODEV)
    finally:
        os.close(fs)


def prepare_agent_layer(dest: Path) -> Path:
    """(Re)build the agent layer at ``dest``: /.branchbox/{bbagent,root,oldroot,proc}.

    Rebuilt at every daemon start so sandboxes always run the agent code of
    the daemon that serves them. Owned by the sandbox's root (shifted ids).
    """
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    top = tmp / ".branchbox"
    (top / "bbagent").mkdir(parents=True)
    for src in _AGENT_SOURCE.glob("*.py"):
        shutil.copy2(src, top / "bbagent" / src.name)
    for mountpoint in ("root", "oldroot", "proc"):
        (top / mountpoint).mkdir()
    for path in [tmp, *tmp.rglob("*")]:
        os.lchown(path, UID_BASE, UID_BASE)
    tmp.chmod(0o755)
    top.chmod(0o755)
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def prepare_writable(volume: Path) -> tuple[Path, Path]:
    """Create upper/ and work/ in a fresh volume; upper's root owned by sandbox root."""
    upper, work = volume / "upper", volume / "work"
    upper.mkdir()
    work.mkdir()
    os.chown(upper, UID_BASE, UID_BASE)
    upper.chmod(0o755)
    return upper, work
