"""``image="host"``: the host's own root filesystem as a sandbox's image.

The base layers of a host sandbox, bottom up: the host's root (the root mount
alone, none of its submounts, id-mapped so host ids 0.. show as the family's:
host files keep their owners), the mask (storage/host_mask.py: secrets and the
daemon's own state hidden, and the default data dir and image cache of any other
daemon on the host, /proc /sys /dev /run /tmp the sandbox's own), and
the agent layer. The writable layer on top takes every change, so a write to
/usr lands in the sandbox and never on the host.

Why the mask and the agent layer live on a tmpfs of their own: overlayfs
refuses a lower layer below another lower layer of the same filesystem
("overlapping lowerdir path"), and both would otherwise sit under the host's
root. The tmpfs is detached (never in any mount table; the daemon reaches it as
/proc/self/fd/N) and built once, on first use: deny entries for homes are
whiteouts of every home whether the file exists or not, so later secrets are
hidden too. A store on the host's root filesystem (the copy backend there)
cannot serve a host sandbox for the same reason: its layers sit under the
host root, and the sandbox would find them through it; such a create is
refused with a message.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from branchbox.agent import sysc
from branchbox.engine.config import DEFAULT_DATA_DIR, DEFAULT_IMAGE_CACHE
from branchbox.storage import host_mask

HOST = "host"
HOST_ROOT = Path("/")


class HostImageUnavailable(RuntimeError):
    """This daemon cannot stack the host's root (the message says why)."""


class HostImage:
    """The layers of ``image="host"`` for one daemon; ``deny`` extends the default list."""

    def __init__(self, deny: list[str], hidden_dirs: list[Path], store_root: Path,
                 agent_layer: Path) -> None:
        self.agent_layer = agent_layer
        self.deny = [host_mask.check_pattern(p) for p in (*host_mask.DEFAULT_DENY, *deny)]
        self.hidden_dirs = hidden_dirs  # the daemon's data dir, the image cache
        self.store_root = store_root
        self._fd = -1
        self._lock = threading.Lock()

    def layers(self) -> list[Path]:
        """The base layers, top first: agent layer, mask, the host's root (built once)."""
        if os.stat(self.store_root).st_dev == os.stat(HOST_ROOT).st_dev:
            raise HostImageUnavailable(
                "image 'host' needs a store on another filesystem than the host's root (the "
                "btrfs store; run the daemon with BRANCHBOX_STORAGE=btrfs): a store under "
                "the host's root would be visible through it")
        with self._lock:
            if self._fd < 0:
                self._fd = self._build()
        top = Path(f"/proc/self/fd/{self._fd}")
        return [top / "agent", top / "mask", HOST_ROOT]

    def _build(self) -> int:
        fs = sysc.fsopen("tmpfs")
        try:
            sysc.fsconfig(fs, sysc.FSCONFIG_SET_STRING, "mode", "0755")
            sysc.fsconfig(fs, sysc.FSCONFIG_SET_STRING, "size", "64m")
            sysc.fsconfig(fs, sysc.FSCONFIG_CMD_CREATE)
            mount = sysc.fsmount(fs)
        finally:
            os.close(fs)
        try:
            top = Path(f"/proc/self/fd/{mount}")
            shutil.copytree(self.agent_layer, top / "agent", symlinks=True)
            (top / "mask").mkdir()
            hidden = host_mask.hidden_paths(self.deny, host_mask.homes())
            # This daemon's state, and the default places of any other daemon's.
            own = {*self.hidden_dirs, DEFAULT_DATA_DIR, DEFAULT_IMAGE_CACHE}
            hidden += [str(p.resolve()) for p in own]
            host_mask.build_mask(top / "mask", hidden, host_mask.OWN_DIRS)
        except BaseException:
            os.close(mount)
            raise
        return mount

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
