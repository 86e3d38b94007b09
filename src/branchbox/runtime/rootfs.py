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

import compileall
import hashlib
import os
import py_compile
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

from branchbox.agent import sysc
from branchbox.storage.idmap import UID_COUNT

_MOUNT_ATTR_NODEV = 0x4
_AGENT_SOURCE = Path(__file__).resolve().parent.parent / "agent"


def overlay_tree(upper: Path, work: Path, lowers: list[Path | int]) -> int:
    """A detached overlay mount (close-on-exec fd); ``lowers`` top first, each a
    directory or the fd of a (detached) mount.

    No host path reaches the mount's options: overlayfs records each layer as the
    string it was given and shows it in /proc/self/mountinfo, where code in the
    sandbox would read the data directory, the image cache and every layer's path.
    So every layer (upperdir and workdir too) goes in as ``/proc/self/fd/N`` of an
    O_PATH fd, which the kernel resolves at configure time and records verbatim.
    Handing it the fd itself (FSCONFIG_SET_FD) is no better: the kernel then records
    the d_path of the fd, i.e. the host path (checked on 6.18).
    """
    fs = sysc.fsopen("overlay")
    opened: list[int] = []

    def layer(path: Path | int) -> str:
        if isinstance(path, int):  # a mount fd: refer to it the same way, by number
            return f"/proc/self/fd/{path}"
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        opened.append(fd)
        return f"/proc/self/fd/{fd}"

    try:
        for lower in lowers:
            sysc.fsconfig(fs, sysc.FSCONFIG_SET_STRING, "lowerdir+", layer(lower))
        # Pinned, not left to the host's module defaults: diff, squash and commit read
        # the layers directly and understand whiteouts and opaque dirs, not metacopy
        # files, redirects or an index.
        for option in ("metacopy", "redirect_dir", "index"):
            sysc.fsconfig(fs, sysc.FSCONFIG_SET_STRING, option, "off")
        sysc.fsconfig(fs, sysc.FSCONFIG_SET_STRING, "upperdir", layer(upper))
        sysc.fsconfig(fs, sysc.FSCONFIG_SET_STRING, "workdir", layer(work))
        sysc.fsconfig(fs, sysc.FSCONFIG_CMD_CREATE)
        return sysc.fsmount(fs, _MOUNT_ATTR_NODEV)
    finally:
        os.close(fs)
        for fd in opened:  # the mount holds its own references to the layers
            os.close(fd)


def prepare_agent_layer(data_dir: Path, *, in_use: bool) -> Path:
    """The agent layer of this daemon's agent code: ``data_dir/agent-layer-<digest>``,
    holding /.branchbox/{bbagent,root,oldroot,proc}; built if missing.

    Named by a digest of the agent's sources, so sandboxes always run the agent code
    of the daemon that serves them, and a daemon of the same code reuses the layer
    its predecessor built. Another version's layer (an upgrade) is deleted unless
    ``in_use``: sandboxes a restarted daemon re-attached to stack it, and a lower
    layer deleted under a mounted overlay would vanish from under them (their forks
    attach the child's root on its /.branchbox/root). Owned by the host's root, so it
    shows as nobody's inside and nothing in a sandbox can change it, even through its
    host path.
    """
    sources = sorted([*_AGENT_SOURCE.glob("*.py"), *_AGENT_SOURCE.glob("*.[ch]")])
    digest = hashlib.sha256(sys.implementation.cache_tag.encode())  # its byte-code's tag
    for src in sources:
        digest.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    dest = data_dir / f"agent-layer-{digest.hexdigest()[:16]}"
    if not in_use:
        for old in data_dir.glob("agent-layer*"):
            if old != dest:
                shutil.rmtree(old, ignore_errors=True)
    if dest.is_dir():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    top = tmp / ".branchbox"
    (top / "bbagent").mkdir(parents=True)
    for src in _AGENT_SOURCE.glob("*.py"):
        shutil.copy2(src, top / "bbagent" / src.name)
    _compile_agent(top / "bbagent")
    _compile_c("bb_init.c", top / "bb-init", ["-static"])
    for name in ("bb_dormant", "bb_drain"):
        _compile_c(f"{name}.c", top / f"{name.replace('_', '-')}.so",
                   ["-shared", "-fPIC", "-nostdlib", "-fno-builtin", "-fno-stack-protector",
                    "-Wl,-z,defs"])
    for mountpoint in ("root", "oldroot", "proc"):
        (top / mountpoint).mkdir()
    tmp.chmod(0o755)
    top.chmod(0o755)
    tmp.rename(dest)
    return dest


def _compile_agent(package: Path) -> None:
    """Byte-code for the agent, made once here: the layer is read-only in a sandbox, so
    without it every REPL start compiled the whole agent again (~25 ms of CPU a create).

    Compiled by the daemon's own interpreter, so only images whose Python has the same
    version find it (the default image's does); another version compiles at each start,
    as before. Unchecked hashes: the layer is named by its sources' digest and never
    changes, so no start needs to stat the sources to trust the byte-code.
    """
    if not compileall.compile_dir(package, quiet=1, workers=1,
                                  invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH):
        raise RuntimeError(f"compiling the agent in {package} failed")


def _compile_c(name: str, dest: Path, flags: list[str]) -> None:
    """Build a part of the agent written in C: Q's init (``bb_init.c``, static), the
    checkpoints' library (``bb_dormant.c``) and the output drain (``bb_drain.c``), both
    without libc: all run on any image."""
    source = _AGENT_SOURCE / name
    cmd = ["gcc", *flags, "-Os", "-s", "-o", str(dest), str(source)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise RuntimeError("gcc is needed to build the sandbox's agent (apt install gcc "
                           "libc6-dev)") from exc
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"building {source} failed:\n{exc.stderr}") from exc


def blank_writable(volume: Path) -> None:
    """Lay out an empty volume for any family: upper/ and work/ for the root (host
    root's until :func:`prepare_writable` gives upper/ to a family)."""
    (volume / "work").mkdir()
    (volume / "upper").mkdir(mode=0o700)


def prepare_writable(volume: Path, uid_base: int, workspace: Path | None = None) -> None:
    """Give a volume laid out by :func:`blank_writable` to a family whose root is host id
    ``uid_base``: its upper/, and with a workspace also its layers and mount point (see
    :func:`prepare_workspace`)."""
    upper = volume / "upper"
    _own(upper, uid_base)
    if workspace is not None:
        prepare_workspace(volume, workspace, uid_base)
        point = upper
        for part in workspace.parts[1:]:
            point = point / part
            point.mkdir()
            _own(point, uid_base)


def prepare_workspace(volume: Path, workspace: Path, uid_base: int) -> None:
    """ws/upper and ws/work in a volume, for a workspace of host directory ``workspace``.

    The workspace's layers live in the same volume as the root's, so the one snapshot
    a fork takes captures both at the same instant.
    """
    (volume / "ws").mkdir()
    (volume / "ws" / "work").mkdir()
    ws_upper = volume / "ws" / "upper"
    ws_upper.mkdir()
    # The overlay's top directory takes its owner and mode from the upper one: make it
    # the host directory's, seen through the family's id shift like everything below it.
    host = workspace.stat()
    os.chown(ws_upper, host.st_uid + uid_base, host.st_gid + uid_base)
    ws_upper.chmod(stat.S_IMODE(host.st_mode))


def _own(path: Path, uid_base: int) -> None:
    os.chown(path, uid_base, uid_base)
    path.chmod(0o755)


def idmap_userns(inside: int, outside: int, count: int = UID_COUNT) -> int:
    """An fd of a user namespace mapping ids ``inside``.. onto host ids ``outside``..
    (``count`` of each, uids and gids alike).

    An idmapped mount of it shows a file stored with id ``inside + i`` as owned by
    host id ``outside + i``, and ids outside the map as nobody's. Idmapped mounts
    take their mapping from a user namespace; this one is made by a throwaway
    `unshare --user` process (never a fork of the threaded daemon) and outlives it
    through the fd. Costs a process start: callers make one per mapping and keep it.
    """
    holder = subprocess.Popen(["unshare", "--user", "--", "sleep", "60"],
                              stdin=subprocess.DEVNULL)
    try:
        ours = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{holder.pid}/ns/user") == ours:
            if holder.poll() is not None or time.monotonic() > deadline:
                raise OSError("could not create the id-mapping user namespace")
            time.sleep(0.001)
        mapping = f"{inside} {outside} {count}\n"
        Path(f"/proc/{holder.pid}/uid_map").write_text(mapping)
        Path(f"/proc/{holder.pid}/gid_map").write_text(mapping)
        return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        holder.kill()
        holder.wait()


def idmapped_tree(path: Path, userns_fd: int) -> int:
    """A detached mount of host directory ``path`` whose owners appear through
    ``userns_fd``'s map (see :func:`idmap_userns`).

    A workspace, with a map of 0.. onto a family's range: a host file of uid 0 is
    root's inside, uid 1000 is uid 1000's. An image, with a map of its storage range
    onto the family's: it shows owned by root inside. Such a mount can be an overlay
    lower layer (overlayfs takes idmapped layers since Linux 5.19), and one mount
    serves any number of overlays; copy-up writes the mapped (the family's) ids."""
    tree = sysc.open_tree(str(path), sysc.OPEN_TREE_CLONE | os.O_CLOEXEC)
    try:
        sysc.mount_setattr_idmap(tree, userns_fd)
    except BaseException:
        os.close(tree)
        raise
    return tree
