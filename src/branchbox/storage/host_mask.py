"""What a sandbox of the host's own root must not see, and the layer that hides it.

``image="host"`` stacks the host's root filesystem (read-only, id-mapped) under a
sandbox's writable layer, so a repository's own venv, toolchains in home
directories and system tools run as they do on the host. Homes stay readable;
what is hidden is listed here: secrets (a default deny list the operator extends)
and host state a sandbox gets its own of (/proc, /sys, /dev, /run, /tmp).

Hiding is done by one overlay layer above the host's root (the *mask*):

- a denied path becomes a whiteout (a 0/0 character device), so it is absent;
  a whiteout for a file that does not exist yet is harmless and keeps it hidden
  if it appears later, so every home gets every home-relative entry whose
  directory exists (the mask invents no directory);
- a directory the sandbox gets its own of becomes an opaque empty directory.

A merged directory takes its owner and mode from the topmost layer that has it,
so every ancestor the mask creates copies the host directory's (owner shifted
into the images' id range, where the mask is stored). A deny path is resolved
through the host's own symlinks (the host's, never a sandbox's), so a
``/home -> /var/home`` link hides the real files, and a denied symlink hides its
target as well.
"""

from __future__ import annotations

import glob
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from branchbox.storage.idmap import UID_BASE, UID_COUNT

# Secrets no sandbox reads, whatever the operator adds. ``~/`` entries apply to every home.
DEFAULT_DENY: tuple[str, ...] = (
    "/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/security/opasswd",
    "/etc/ssh/ssh_host_*_key",
    "/etc/ssh/ssh_host_rsa_key", "/etc/ssh/ssh_host_ecdsa_key", "/etc/ssh/ssh_host_ed25519_key",
    "/etc/ssh/ssh_host_dsa_key", "/etc/ssl/private",
    "~/.ssh", "~/.aws", "~/.config/gcloud", "~/.azure", "~/.kube", "~/.docker/config.json",
    "~/.netrc", "~/.git-credentials", "~/.config/gh", "~/.pypirc", "~/.gnupg",
    "~/.password-store",
    "~/.local/share/keyrings", "~/.local/share/pass",
    "~/.bash_history", "~/.zsh_history", "~/.zhistory", "~/.histfile", "~/.sh_history",
    "~/.python_history", "~/.node_repl_history", "~/.psql_history", "~/.mysql_history",
    "~/.sqlite_history", "~/.lesshst", "~/.local/share/fish/fish_history",
)
# Host state each sandbox has its own of: empty here, filled (or not) by the sandbox.
OWN_DIRS: dict[str, int] = {"/proc": 0o555, "/sys": 0o555, "/dev": 0o755, "/run": 0o755,
                            "/tmp": 0o1777}
_GLOB = set("*?[")
_OPAQUE_XATTR = "trusted.overlay.opaque"


def check_pattern(pattern: str) -> str:
    """``pattern`` if it is a deny entry: an absolute path or ``~/`` + a relative one (globs
    allowed), without ``..``; else ValueError saying what is expected."""
    rel = pattern[2:] if pattern.startswith("~/") else pattern
    if not (pattern.startswith(("/", "~/")) and rel.strip("/") and "\0" not in pattern
            and ".." not in rel.split("/")):
        raise ValueError(f"a host deny entry is an absolute path or ~/PATH without '..': "
                         f"{pattern!r}")
    return pattern


def read_deny_file(path: Path) -> list[str]:
    """The entries of a deny file: one a line; blank lines and ``#`` comments skipped."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return [check_pattern(line) for line in lines if line and not line.startswith("#")]


def homes(etc: Path = Path("/etc"), root: Path = Path("/")) -> list[str]:
    """Every home directory on the host: those of /etc/passwd, /root and /home/*."""
    found = {"/root"}
    try:
        for line in (etc / "passwd").read_text(errors="replace").splitlines():
            fields = line.split(":")
            if len(fields) > 5 and fields[5].startswith("/") and fields[5] != "/":
                found.add(fields[5])
    except OSError:
        pass
    found.update("/" + str(p.relative_to(root)) for p in (root / "home").glob("*")
                 if p.is_dir() and not p.is_symlink())
    return sorted(h for h in found if (root / h.lstrip("/")).is_dir())


def hidden_paths(patterns: Iterable[str], home_dirs: Iterable[str],
                 root: Path = Path("/")) -> list[str]:
    """The absolute host paths to white out for ``patterns`` (see :data:`DEFAULT_DENY`):
    literal ones always, globs as they match now; each under its parent resolved through the
    host's symlinks (and a denied symlink's target too)."""
    home_dirs = list(home_dirs)
    wanted: set[str] = set()
    for pattern in patterns:
        check_pattern(pattern)
        paths = ([h.rstrip("/") + "/" + pattern[2:] for h in home_dirs]
                 if pattern.startswith("~/") else [pattern])
        for path in paths:
            if _GLOB & set(path):
                matches = glob.glob(str(root) + path if str(root) != "/" else path)
                wanted.update("/" + os.path.relpath(m, root) for m in matches)
            else:
                wanted.add(os.path.normpath(path))
    out: set[str] = set()
    for path in wanted:  # by the real parent: a mask directory must never shadow a link
        parent, name = os.path.split(path)
        real_parent = resolve(parent, root)
        if real_parent is None or not (root / real_parent.lstrip("/")).is_dir():
            continue  # no directory to hide it in: the mask invents none
        real = real_parent.rstrip("/") + "/" + name
        out.add(real)
        if (root / real.lstrip("/")).is_symlink() and (target := resolve(real, root)):
            out.add(target)
    return sorted(p for p in out if p != "/")


def resolve(path: str, root: Path = Path("/"), depth: int = 40) -> str | None:
    """``path`` with every symlink of tree ``root`` resolved inside it (absolute links from
    ``root``), like realpath in a chroot; None past ``depth`` links (a loop)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    done: list[str] = []
    while parts:
        part = parts.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        here = root.joinpath(*done, part)
        if here.is_symlink():
            depth -= 1
            if depth < 0:
                return None
            link = os.readlink(here)
            if link.startswith("/"):
                done = []
            parts = [p for p in link.split("/") if p not in ("", ".")] + parts
            continue
        done.append(part)
    return "/" + "/".join(done)


def build_mask(dest: Path, whiteouts: Iterable[str], own_dirs: dict[str, int],
               root: Path = Path("/")) -> None:
    """Lay out the mask layer in empty directory ``dest`` (see the module docstring):
    ``whiteouts`` hidden, ``own_dirs`` (path -> mode) empty and opaque. Owners are stored
    in the images' id range (UID_BASE + the host id), so the images' id map shows them
    as the host's ids inside. Needs root (mknod, trusted xattrs)."""
    _copy_attrs(root, dest)
    for path, mode in own_dirs.items():
        target = _ancestors(dest, path, root)
        target.mkdir(exist_ok=True)
        os.chown(target, UID_BASE, UID_BASE)
        target.chmod(mode)
        os.setxattr(target, _OPAQUE_XATTR, b"y")
    for path in whiteouts:
        if any(path == d or path.startswith(d + "/") for d in own_dirs):
            continue  # inside a directory the sandbox has its own of: hidden already
        target = _ancestors(dest, path, root)
        if target is not None and not os.path.lexists(target):
            os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(0, 0))


def _ancestors(dest: Path, path: str, root: Path) -> Path | None:
    """``dest`` + ``path``, creating the parent directories with their host owner and mode;
    None when an ancestor is hidden already (a whiteout)."""
    parts = [p for p in path.split("/") if p]
    here, host = dest, root
    for part in parts[:-1]:
        here, host = here / part, host / part
        if os.path.lexists(here) and not here.is_dir():
            return None
        if not here.exists():
            here.mkdir()
            _copy_attrs(host, here)
    return here / parts[-1]


def _copy_attrs(host: Path, here: Path) -> None:
    """Give directory ``here`` the owner and mode of host directory ``host`` (root's 0755
    when the host has none), the owner shifted into the images' range."""
    try:
        st = os.stat(host)  # the host's own directories: following its links is meant
        uid, gid, mode = st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)
    except OSError:
        uid, gid, mode = 0, 0, 0o755
    os.chown(here, UID_BASE + _mappable(uid), UID_BASE + _mappable(gid))
    here.chmod(mode)


def _mappable(host_id: int) -> int:
    """A host id as the family's user namespace can show it (nobody past its range)."""
    return host_id if 0 <= host_id < UID_COUNT else 65534
