"""Root filesystem images: built once with debootstrap, cached, shared by all sandboxes.

An image is ``cache_dir/<name>/rootfs`` plus ``manifest.json``. The manifest
is written last, so its presence means the rootfs is complete. Builds happen
in a scratch directory beside it and are renamed into place, so a crash never
leaves a half-built rootfs where a sandbox could find it; the next build
removes the scratch directory. A lock file serializes builders across
processes: a second caller waits and then uses the first one's result.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from branchbox.agent import sysc
from branchbox.storage import loopback
from branchbox.storage.copyfs import remove_tree
from branchbox.storage.idmap import UID_BASE, shift_tree

DEFAULT_CACHE_DIR = Path("/var/cache/branchbox/images")
_OUTPUT_TAIL = 30


@dataclass(frozen=True)
class ImageSpec:
    """How to build an image with debootstrap."""

    suite: str
    packages: tuple[str, ...]
    mirror: str = "http://deb.debian.org/debian"
    variant: str = "minbase"


KNOWN_IMAGES: dict[str, ImageSpec] = {
    "default": ImageSpec(
        suite="bookworm",
        packages=(
            "python3",
            "python3-numpy",
            "python3-pandas",
            "python3-pip",
            "python3-venv",
            "procps",
            "iproute2",
            "ca-certificates",
        ),
    ),
}


class ImageNotFound(LookupError):
    """No image of that name is known; the message lists the ones that are."""


class ImageBuildError(RuntimeError):
    """Building an image failed; the message ends with the builder's last output."""


def ensure_image(
    name: str = "default", cache_dir: Path = DEFAULT_CACHE_DIR, progress: bool = True
) -> Path:
    """Return the rootfs directory of image ``name``, building it first if needed.

    Its files are owned by ``UID_BASE`` + the id they have inside a sandbox.
    With ``progress`` a progress bar goes to stderr during a build; without,
    nothing is printed.
    """
    spec = KNOWN_IMAGES.get(name)
    if spec is None:
        raise ImageNotFound(f"unknown image {name!r}; known images: {', '.join(KNOWN_IMAGES)}")
    image_dir = Path(cache_dir) / name
    rootfs, manifest = image_dir / "rootfs", image_dir / "manifest.json"
    if manifest.is_file() and rootfs.is_dir():
        return rootfs
    image_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(image_dir / ".lock", name, progress):
        if manifest.is_file() and rootfs.is_dir():
            return rootfs
        _discard_leftovers(image_dir)
        _build(name, spec, image_dir, progress)
    return rootfs


@contextmanager
def _build_lock(lock_path: Path, name: str, progress: bool) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"waiting for another process to build image {name!r}...", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _discard_leftovers(image_dir: Path) -> None:
    """Remove what a crashed build left: scratch dirs, a rootfs without manifest, or vice versa.

    Only called under the lock and when the image is incomplete, so
    everything but the lock file is debris.
    """
    for entry in image_dir.iterdir():
        if entry.name != ".lock":
            _unmount_under(entry)
            remove_tree(entry)


def _unmount_under(path: Path) -> None:
    """Unmount what debootstrap may have left mounted inside ``path`` (/proc, /sys)."""
    for mountpoint in loopback.mounts_under(path, loopback.current_mounts()):
        sysc.umount2(mountpoint, sysc.MNT_DETACH)


def _build(name: str, spec: ImageSpec, image_dir: Path, progress: bool) -> None:
    build_dir = Path(tempfile.mkdtemp(prefix="build-", dir=image_dir))
    target = build_dir / "rootfs"
    try:
        with _progress(name, progress) as report:
            _debootstrap(spec, target, report)
            _unmount_under(target)
            report("I: Finishing the root filesystem")
            _finish_rootfs(target)
            report(f"I: Shifting ownership to uid {UID_BASE}+")
            shift_tree(target, UID_BASE)
            manifest = {
                "name": name,
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
                "suite": spec.suite,
                "variant": spec.variant,
                "mirror": spec.mirror,
                "packages": list(spec.packages),
                "python": _python_version(target),
                "size_bytes": _disk_usage(target),
                "uid_base": UID_BASE,
            }
        os.rename(target, image_dir / "rootfs")
        _write_atomically(image_dir / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    finally:
        _unmount_under(build_dir)
        remove_tree(build_dir)


def _debootstrap(spec: ImageSpec, target: Path, report: Callable[[str], None]) -> None:
    """Run debootstrap into ``target``, feeding each output line to ``report``."""
    cmd = ["debootstrap", f"--variant={spec.variant}"]
    if spec.packages:
        cmd.append(f"--include={','.join(spec.packages)}")
    cmd += [spec.suite, os.fspath(target), spec.mirror]
    env = {**os.environ, "LC_ALL": "C", "DEBIAN_FRONTEND": "noninteractive"}
    tail: deque[str] = deque(maxlen=_OUTPUT_TAIL)
    try:
        # Its own session, so an interrupted build can kill dpkg & co. too.
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
    except FileNotFoundError:
        raise ImageBuildError("debootstrap not found (apt-get install debootstrap)") from None
    with proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                report(line)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    if proc.returncode != 0:
        raise ImageBuildError(
            f"debootstrap exited with status {proc.returncode}; last output:\n"
            + "\n".join(tail)
            + _log_tail(target / "debootstrap" / "debootstrap.log")
        )


def _log_tail(log: Path) -> str:
    """The end of debootstrap's own log, which names the failing package; the log is deleted."""
    try:
        lines = log.read_text(errors="replace").splitlines()[-_OUTPUT_TAIL:]
    except OSError:
        return ""
    return f"\n--- {log} (last lines) ---\n" + "\n".join(lines)


# Per-package lines; "I: Unpacking the base system..." and index files
# ("Retrieving InRelease") are not packages.
_PHASE = re.compile(
    r"I: (Retrieving|Validating|Extracting|Unpacking|Configuring) (?!the )([a-z0-9][a-z0-9+.-]*)"
)


@contextmanager
def _progress(name: str, enabled: bool) -> Iterator[Callable[[str], None]]:
    """Yield a function taking debootstrap output lines; it drives a rich bar on stderr.

    The number of packages is unknown until debootstrap has downloaded them,
    so the bar has no total. It shows the phase, how many packages the phase
    has done (out of the number downloaded, once that is known) and the
    package at hand.
    """
    if not enabled:
        yield lambda _line: None
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    counts: Counter[str] = Counter()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(f"image {name}: starting debootstrap", total=None)

        def report(line: str) -> None:
            match = _PHASE.match(line)
            if match:
                phase, package = match[1], match[2].rstrip(".")
                counts[phase] += 1
                done = str(counts[phase])
                if phase != "Retrieving":
                    done += f"/{counts['Retrieving']}"
                text = f"image {name}: {phase} {done} [dim]{escape(package)}"
                bar.update(task, description=text)
            elif line.startswith("I: "):
                bar.update(task, description=f"image {name}: {escape(line[3:].strip())}")

        yield report
        bar.update(task, description=f"image {name}: done")


def _finish_rootfs(root: Path) -> None:
    """Make a debootstrapped tree fit to be a sandbox's root."""
    # Package caches and lists are rebuilt by `apt-get update`; no need to ship them.
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*"):
        for path in root.glob(pattern):
            if path.is_file() and path.name != "lock":
                path.unlink()
    # Mount points, filled per sandbox; /dev gets its own nodes at run time.
    for mountpoint in ("proc", "sys", "dev", ".branchbox"):
        remove_tree(root / mountpoint)
        (root / mountpoint).mkdir(mode=0o755)
    (root / "tmp").mkdir(exist_ok=True)
    (root / "tmp").chmod(0o1777)
    (root / "root").mkdir(exist_ok=True)
    (root / "root").chmod(0o700)
    (root / "etc" / "hostname").write_text("sandbox\n")
    (root / "etc" / "hosts").write_text(
        "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )


def _python_version(root: Path) -> str | None:
    """The python3 version recorded in the image's dpkg database."""
    status = (root / "var" / "lib" / "dpkg" / "status").read_text(errors="replace")
    match = re.search(r"^Package: python3\n(?:[^\n]+\n)*?Version: (\d+(?:\.\d+)*)", status, re.M)
    return match.group(1) if match else None


def _disk_usage(root: Path) -> int:
    """Bytes allocated under ``root``, each inode counted once (like ``du -s``)."""
    seen: set[int] = set()
    total = 0
    pending = [os.fspath(root)]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
    return total


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
