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
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from branchbox.agent import sysc
from branchbox.storage import apt_sources, loopback
from branchbox.storage.copyfs import remove_tree
from branchbox.storage.idmap import UID_BASE, shift_tree

DEFAULT_CACHE_DIR = Path("/var/cache/branchbox/images")
_OUTPUT_TAIL = 30


@dataclass(frozen=True)
class ImageSpec:
    """How to build an image: debootstrap ``packages`` of ``suite``, then a virtualenv.

    ``mirror`` None (the normal case) takes the archive and keyring from the
    host's apt sources (storage/apt_sources.py), so a host behind its own mirror
    or proxy builds unchanged. With ``venv``, ``venv`` is created with the image's
    python3 and ``pip_packages`` are installed into it through the host's pip
    configuration (storage/pip_config.py): the venv is where ``pip install`` in a
    sandbox goes (PEP 668 refuses the system python), and the REPL runs its python.
    Bump ``version`` whenever what a build produces changes: a cached image with
    another version is rebuilt.
    """

    suite: str
    packages: tuple[str, ...]
    mirror: str | None = None
    variant: str = "minbase"
    venv: str | None = None
    pip_packages: tuple[str, ...] = ()
    version: int = 1


# The default image: what data and coding agents reach for, and little else.
# Debian gives the system parts (python3 for the venv, git, curl, a C/C++ toolchain and
# python headers for packages that build native code); pip gives the Python libraries
# as wheels, current and independent of the suite's.
KNOWN_IMAGES: dict[str, ImageSpec] = {
    "default": ImageSpec(
        suite="bookworm",
        packages=(
            "python3",
            "python3-venv",
            "python3-dev",
            "gcc",
            "g++",
            "make",
            "libc6-dev",
            "git",
            "curl",
            "procps",
            "iproute2",
            "ca-certificates",
            # mimalloc backs the REPL's heap with 2 MiB pages: a fork copies one page
            # table entry per huge page instead of 512 (runtime/huge_heap.py).
            "libmimalloc2.0",
        ),
        venv="/opt/venv",
        pip_packages=("numpy", "pandas", "matplotlib", "scipy", "requests", "pytest"),
        version=4,
    ),
}

# The interpreter the REPL runs when an image's manifest names none (images built
# before the venv existed).
SYSTEM_PYTHON = "/usr/bin/python3"


class ImageNotFound(LookupError):
    """No image of that name is known; the message lists the ones that are."""


class ImageBuildError(RuntimeError):
    """Building an image failed; the message ends with the builder's last output."""


def ensure_image(
    name: str = "default", cache_dir: Path = DEFAULT_CACHE_DIR, progress: bool = True,
    spec: ImageSpec | None = None,
) -> Path:
    """Return the rootfs directory of image ``name``, building it first if needed
    (from ``spec``, else from the built-in spec of that name).

    Its files are owned by ``UID_BASE`` + the id they have inside a sandbox.
    With ``progress`` a progress bar goes to stderr during a build; without,
    nothing is printed.
    """
    spec = spec or KNOWN_IMAGES.get(name)
    if spec is None:
        raise ImageNotFound(f"unknown image {name!r}; known images: {', '.join(KNOWN_IMAGES)}")
    image_dir = Path(cache_dir) / name
    rootfs, manifest = image_dir / "rootfs", image_dir / "manifest.json"
    if _current(image_dir, spec):
        return rootfs
    image_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(image_dir / ".lock", name, progress):
        if _current(image_dir, spec):
            return rootfs
        if manifest.is_file() and rootfs.is_dir():
            _retire(image_dir)
        _discard_leftovers(image_dir)
        _build(name, spec, image_dir, progress)
    return rootfs


def _current(image_dir: Path, spec: ImageSpec) -> bool:
    """Whether ``image_dir`` holds a complete build of ``spec``'s version."""
    if not (image_dir / "rootfs").is_dir():
        return False
    manifest = image_manifest(image_dir.name, image_dir.parent)
    return manifest is not None and manifest.get("version", 1) == spec.version


def _retire(image_dir: Path) -> None:
    """Move an outdated build aside (``retired-*``) instead of deleting it: a running
    daemon's sandboxes may still stack on it. Delete it once no daemon runs on it."""
    manifest = image_manifest(image_dir.name, image_dir.parent) or {}
    aside = image_dir / f"retired-v{manifest.get('version', 1)}-{time.time_ns()}"
    aside.mkdir()
    os.rename(image_dir / "manifest.json", aside / "manifest.json")
    os.rename(image_dir / "rootfs", aside / "rootfs")


def image_manifest(name: str, cache_dir: Path = DEFAULT_CACHE_DIR) -> dict | None:
    """The manifest of built image ``name`` (what it holds, its size, the interpreter the
    REPL runs), or None if it is not built."""
    try:
        return json.loads((Path(cache_dir) / name / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


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
        if entry.name != ".lock" and not entry.name.startswith("retired-"):
            _unmount_under(entry)
            remove_tree(entry)


def _unmount_under(path: Path) -> None:
    """Unmount what debootstrap may have left mounted inside ``path`` (/proc, /sys)."""
    for mountpoint in loopback.mounts_under(path, loopback.current_mounts()):
        sysc.umount2(mountpoint, sysc.MNT_DETACH)


def _build(name: str, spec: ImageSpec, image_dir: Path, progress: bool) -> None:
    build_dir = Path(tempfile.mkdtemp(prefix="build-", dir=image_dir))
    target = build_dir / "rootfs"
    started = time.monotonic()
    try:
        with _progress(name, progress) as report:
            mirror = _mirror(spec)
            _debootstrap(spec, mirror, target, report)
            _unmount_under(target)
            if spec.venv:
                _make_venv(spec, target, report)
            report("I: Finishing the root filesystem")
            _finish_rootfs(target)
            report(f"I: Shifting ownership to uid {UID_BASE}+")
            shift_tree(target, UID_BASE)
            manifest = {
                "name": name,
                "version": spec.version,
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
                "suite": spec.suite,
                "variant": spec.variant,
                "mirror": mirror.uri,
                "packages": list(spec.packages),
                "venv": spec.venv,
                "pip_packages": _pip_versions(target, spec.venv),
                "python": _python_version(target),
                "python_path": f"{spec.venv}/bin/python3" if spec.venv else SYSTEM_PYTHON,
                "size_bytes": _disk_usage(target),
                "build_seconds": round(time.monotonic() - started, 1),
                "uid_base": UID_BASE,
            }
        os.rename(target, image_dir / "rootfs")
        write_atomically(image_dir / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    finally:
        _unmount_under(build_dir)
        remove_tree(build_dir)


def _mirror(spec: ImageSpec) -> apt_sources.Mirror:
    """The spec's own mirror if it names one, else the host's archive for the suite."""
    if spec.mirror is not None:
        return apt_sources.Mirror(spec.mirror, None, "the image spec")
    try:
        return apt_sources.mirror_for(spec.suite)
    except apt_sources.NoMirror as exc:
        raise ImageBuildError(str(exc)) from None


def _debootstrap(spec: ImageSpec, mirror: apt_sources.Mirror, target: Path,
                 report: Callable[[str], None]) -> None:
    """Run debootstrap into ``target``, feeding each output line to ``report``."""
    cmd = ["debootstrap", f"--variant={spec.variant}"]
    if mirror.keyring:
        cmd.append(f"--keyring={mirror.keyring}")
    if spec.packages:
        cmd.append(f"--include={','.join(spec.packages)}")
    cmd += [spec.suite, os.fspath(target), mirror.uri]
    env = {**os.environ, **apt_sources.apt_proxy_env(), "LC_ALL": "C",
           "DEBIAN_FRONTEND": "noninteractive"}
    _run(cmd, env, report, "debootstrap", target / "debootstrap" / "debootstrap.log")


def _run(cmd: list[str], env: dict[str, str], report: Callable[[str], None], what: str,
         log: Path | None = None) -> None:
    """Run a build step, feeding each output line to ``report``; on failure raise
    ImageBuildError with the step's last output (and the end of ``log``)."""
    tail: deque[str] = deque(maxlen=_OUTPUT_TAIL)
    try:
        # Its own session, so an interrupted build can kill dpkg, pip & co. too.
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
    except FileNotFoundError:
        raise ImageBuildError(f"{cmd[0]} not found (apt-get install {cmd[0]})") from None
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
            f"{what} exited with status {proc.returncode}; last output:\n"
            + "\n".join(tail)
            + (_log_tail(log) if log is not None else "")
        )


def _make_venv(spec: ImageSpec, root: Path, report: Callable[[str], None]) -> None:
    """Create ``spec.venv`` with the image's python3 and install ``spec.pip_packages``.

    The wheels are fetched by the host's own pip (this interpreter's), for the image's
    python version and platform, so the host's pip configuration applies exactly as
    pip reads it (its files, ``PIP_*``, a local index or wheelhouse, a proxy, a CA)
    and nothing about an index is baked in here. The image's pip then installs them
    offline from a directory inside the image, in a chroot in a private mount
    namespace (what it mounts dies with it). matplotlib's font cache is warmed, so
    a sandbox's first chart does not pay for it.
    """
    assert spec.venv is not None
    venv, wheels = spec.venv, "/tmp/branchbox-wheels"
    version = _image_python_xy(root)
    machine = platform.machine()
    platforms = [f"manylinux_2_{minor}_{machine}" for minor in range(_glibc_minor(root), 16, -1)]
    platforms += [f"manylinux2014_{machine}", f"manylinux2010_{machine}",
                  f"manylinux1_{machine}", f"linux_{machine}"]
    report(f"I: Fetching wheels for python {version} with the host's pip: "
           + " ".join(spec.pip_packages))
    _run([sys.executable, "-m", "pip", "download", "--progress-bar", "off",
          "--disable-pip-version-check", "--dest", os.fspath(root / wheels.lstrip("/")),
          "--only-binary=:all:", "--implementation", "cp", "--python-version", version,
          "--abi", "cp" + version.replace(".", ""),
          *(arg for p in platforms for arg in ("--platform", p)), *spec.pip_packages],
         {**os.environ, "PIP_NO_INPUT": "1"}, report, "pip download (on the host)")
    chroot = f"chroot {shlex.quote(os.fspath(root))}"
    install = [f"{venv}/bin/python3", "-m", "pip", "install", "--no-index", "--no-cache-dir",
               "--progress-bar", "off", "--find-links", wheels, *spec.pip_packages]
    script = [
        "set -e",
        f"mount -t proc proc {shlex.quote(os.fspath(root / 'proc'))}",
        f"mount --rbind /dev {shlex.quote(os.fspath(root / 'dev'))}",
        f"{chroot} /usr/bin/python3 -m venv {shlex.quote(venv)}",
        f"{chroot} {shlex.join(install)}",
    ]
    if "matplotlib" in spec.pip_packages:
        script.append(f"{chroot} {venv}/bin/python3 -c 'import matplotlib.pyplot'")
    env = {"PATH": f"{venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root", "LC_ALL": "C.UTF-8", "MPLBACKEND": "Agg",
           "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    report(f"I: Installing into {venv}: " + " ".join(spec.pip_packages))
    try:
        _run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
              "\n".join(script)], env, report, "pip install (in the image)")
    finally:
        remove_tree(root / wheels.lstrip("/"))
    _drop_test_suites(root / venv.lstrip("/"))
    # Login shells and PAM read this; sandboxes get the same PATH from the daemon.
    (root / "etc" / "environment").write_text(f'PATH="{env["PATH"]}"\n')


def _drop_test_suites(venv: Path) -> None:
    """Remove the libraries' own test suites (``tests`` packages: ~100 MB of numpy, scipy,
    pandas, matplotlib), which nothing imports at run time."""
    for tests in venv.glob("lib/python3*/site-packages/*/**/tests"):
        if tests.is_dir() and not tests.is_symlink():
            remove_tree(tests)


def _image_python_xy(root: Path) -> str:
    """``3.11``: the image's python3 version, from where /usr/bin/python3 points."""
    match = re.fullmatch(r"python(\d+\.\d+)", os.readlink(root / "usr" / "bin" / "python3"))
    if match is None:
        raise ImageBuildError("the image's /usr/bin/python3 is not a link to pythonX.Y")
    return match[1]


def _glibc_minor(root: Path) -> int:
    """The image's glibc minor version (36 for 2.36), for the manylinux wheels it runs."""
    for lib in root.glob("usr/lib/*/libc.so.6"):
        found = re.search(rb"GNU C Library[^\n]*version 2\.(\d+)", lib.read_bytes())
        if found:
            return int(found[1])
    return 17  # manylinux2014's floor: wheels for it run on any glibc since


def _pip_versions(root: Path, venv: str | None) -> dict[str, str]:
    """name -> version of every distribution in the venv (from its dist-info names)."""
    if not venv:
        return {}
    found = {}
    for info in root.joinpath(venv.lstrip("/")).glob("lib/python3*/site-packages/*.dist-info"):
        name, _, version = info.name[: -len(".dist-info")].partition("-")
        found[name] = version
    return dict(sorted(found.items(), key=lambda kv: kv[0].lower()))


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

_PIP_STEPS = ("Collecting ", "Saved ", "Processing ", "Installing collected", "Successfully ")


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
            elif line.startswith(_PIP_STEPS):  # pip's own lines: which wheel is at hand
                text = escape(line.strip()[:100])
                bar.update(task, description=f"image {name}: pip [dim]{text}")

        yield report
        bar.update(task, description=f"image {name}: done")


def _finish_rootfs(root: Path) -> None:
    """Make a debootstrapped tree fit to be a sandbox's root."""
    # Package caches and lists are rebuilt by `apt-get update`; no need to ship them.
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*"):
        for path in root.glob(pattern):
            if path.is_file() and path.name != "lock":
                path.unlink()
    # Documentation and translations nobody reads in a sandbox (tens of MB); dpkg is told
    # to skip them for packages a sandbox installs later too. Copyright files stay.
    for pattern in ("usr/share/doc/*/*", "usr/share/man/*", "usr/share/info/*",
                    "usr/share/locale/*", "usr/share/lintian/*"):
        for path in root.glob(pattern):
            if path.name not in ("copyright", "locale.alias"):
                remove_tree(path)
    (root / "etc" / "dpkg" / "dpkg.cfg.d").mkdir(parents=True, exist_ok=True)
    (root / "etc" / "dpkg" / "dpkg.cfg.d" / "01-branchbox-lean").write_text(
        "path-exclude /usr/share/doc/*\npath-include /usr/share/doc/*/copyright\n"
        "path-exclude /usr/share/man/*\npath-exclude /usr/share/info/*\n"
        "path-exclude /usr/share/locale/*\npath-include /usr/share/locale/locale.alias\n"
    )
    # Mount points, filled per sandbox; /dev gets its own nodes at run time.
    for mountpoint in ("proc", "sys", "dev", ".branchbox"):
        remove_tree(root / mountpoint)
        (root / mountpoint).mkdir(mode=0o755)
    (root / "tmp").mkdir(exist_ok=True)
    (root / "tmp").chmod(0o1777)
    (root / "root").mkdir(exist_ok=True)
    (root / "root").chmod(0o700)
    _add_user(root, "user", 1000)
    (root / "etc" / "hostname").write_text("sandbox\n")
    (root / "etc" / "hosts").write_text(
        "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )


def _add_user(root: Path, name: str, uid: int) -> None:
    """An ordinary account with a home, as E2B's templates have (``user``, ``/home/user``):
    examples written for E2B use that path and name. Written into the account files
    directly: useradd would have to run inside the tree."""
    etc = root / "etc"
    home = root / "home" / name
    with open(etc / "passwd", "a") as f:
        f.write(f"{name}:x:{uid}:{uid}::/home/{name}:/bin/bash\n")
    with open(etc / "group", "a") as f:
        f.write(f"{name}:x:{uid}:\n")
    with open(etc / "shadow", "a") as f:
        f.write(f"{name}:!:19000:0:99999:7:::\n")
    home.mkdir(parents=True, exist_ok=True)
    for dotfile in (".bashrc", ".profile"):
        skeleton = etc / "skel" / dotfile
        if skeleton.is_file():
            (home / dotfile).write_bytes(skeleton.read_bytes())
    for path in (home, *home.iterdir()):
        os.chown(path, uid, uid)
    home.chmod(0o755)


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


def write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path``, whole or not at all (a temporary file, fsynced, renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
