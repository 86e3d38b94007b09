"""Races a hostile sandbox can run against the daemon's reads of its live layers.

The daemon (host root) reads a sandbox's writable layer for diff and, on the
copy backend, copies it for fork. A thread in the sandbox's REPL can swap a
directory and a symlink to a host path (``renameat2(RENAME_EXCHANGE)``) as
fast as it goes; a daemon that resolves a path string after checking it would
follow the symlink into the host. Attacks here, each against the real engine
on both storage backends:

- diff while a directory flips with a symlink to a root-only host directory:
  the daemon never opens (inotify says so) nor lists that directory, and no
  host file name shows up in the diff;
- fork while the same flip runs: no host file's content reaches the frozen
  layer a child reads (the copy backend copied the live volume path by path);
- a sandbox holding a task the freezer cannot stop (a host process blocked on a
  userfaultfd fault, moved into its cgroup): fork and commit fail with an error
  instead of going on half-frozen, and close still kills everything.

Two tests drive the storage layer directly, to hit a race's worst instant
deterministically or without the engine's freeze in the way.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from readback import regular_files

from branchbox import SandboxError
from branchbox.runtime import cgroups
from branchbox.storage import layerdiff
from branchbox.storage.copyfs import CopyBackend

KEYS = 64  # files in the flipped directory: many opens per diff or copy, many chances
_libc = ctypes.CDLL(None, use_errno=True)
_IN_OPEN, _IN_ACCESS, _IN_NONBLOCK = 0x20, 0x01, 0o4000


@pytest.fixture
def secret() -> Iterator[tuple[Path, bytes]]:
    """A root-only host directory whose files look like the sandbox's decoys (same
    names, same size) but hold a marker, plus one name only the host has."""
    where = Path(tempfile.mkdtemp(prefix="bbsec-secret-"))
    where.chmod(0o700)
    marker = f"SECRET{secrets.token_hex(8)}".encode()[:15] + b"\n"
    for k in range(KEYS):
        (where / f"key{k}").write_bytes(marker)
        (where / f"key{k}").chmod(0o644)
    (where / f"hostonly-{secrets.token_hex(4)}").write_bytes(marker)
    yield where, marker
    shutil.rmtree(where)


class OpenWatch:
    """inotify on a host directory: did anyone open or read it or a file in it?"""

    def __init__(self, path: Path) -> None:
        self.fd = _libc.inotify_init1(_IN_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if _libc.inotify_add_watch(self.fd, os.fsencode(path), _IN_OPEN | _IN_ACCESS) < 0:
            raise OSError(ctypes.get_errno(), "inotify_add_watch")

    def events(self) -> list[str]:
        """Names opened or read since the last call ("." for the directory itself)."""
        found = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return found
            pos = 0
            while pos < len(buf):
                _, mask, _, length = struct.unpack_from("iIII", buf, pos)
                name = buf[pos + 16: pos + 16 + length].rstrip(b"\0").decode() or "."
                found.append(f"{name} (mask {mask:#x})")
                pos += 16 + length

    def close(self) -> None:
        os.close(self.fd)


FLIP = """
import ctypes, os, sys
os.chdir(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
count = os.open("flips", os.O_WRONLY | os.O_CREAT, 0o644)
n = 0
while True:
    # renameat2(AT_FDCWD, "d", AT_FDCWD, "alt", RENAME_EXCHANGE): d is a directory and a
    # symlink to the host's secret directory in turn, as fast as it goes.
    if libc.syscall(316, -100, b"d", -100, b"alt", 2) == 0:
        n += 1
        if n % 256 == 0:
            os.pwrite(count, b"%d\\n" % n, 0)
"""

# The flipper is a process the REPL starts, so it lives in the REPL's cgroup leaf: fork
# freezes only the commands leaf, so this process (like a thread of the REPL) keeps
# running while the parent's layer is snapshotted. A process rather than a thread keeps
# the REPL single-threaded, which its own fork requires.
START_FLIPPER = """
import os, subprocess, sys
os.makedirs({where!r}, exist_ok=True)
os.chdir({where!r})
os.mkdir("d")
for _k in range({keys}):
    with open(f"d/key{{_k}}", "w") as _f:
        _f.write("decoy-decoy-dec\\n")  # as long as the host's marker
os.symlink({secret!r}, "alt")
_flipper = subprocess.Popen([sys.executable, "-c", {flip!r}, {where!r}])
"""


def start_flipper(sb, secret_dir: Path, where: str = "/root/race") -> None:
    set_up = sb.run_code(START_FLIPPER.format(where=where, keys=KEYS, secret=str(secret_dir),
                                              flip=FLIP))
    assert set_up.error is None, set_up.error


def stop_flipper(sb) -> None:
    sb.run_code("_flipper.kill(); _flipper.wait()")


def flips(sb, where: str = "/root/race") -> int:
    execution = sb.run_code(f"open({where + '/flips'!r}).read().strip() or '0'")
    assert execution.error is None, execution.error
    return int(execution.text.strip("'"))


def marked_files(root: Path, marker: bytes) -> list[str]:
    """Regular files below ``root`` holding ``marker``; symlinks are never followed."""
    return [rel for rel, data in regular_files(root).items() if marker in data]


# ------------------------------------------------------------------------------ diff

def test_diff_under_a_dir_symlink_swap_never_reaches_the_host(
        harness, make, secret: tuple[Path, bytes]) -> None:
    secret_dir, _ = secret
    hostonly = next(p.name for p in secret_dir.iterdir() if p.name.startswith("hostonly-"))
    parent = make()
    # The child's frozen layer holds d/ with the decoys, as the parent had it at the fork.
    start_flipper(parent, secret_dir)
    (child,) = parent.fork(1)
    watch = OpenWatch(secret_dir)
    try:
        diffs = 0
        for _ in range(30):
            try:
                result = parent.diff(child)
            except SandboxError:
                continue  # giving up on a layer changing under it leaks nothing
            diffs += 1
            named = [p for paths in result.values() for p in paths if hostonly in p]
            assert named == [], f"diff listed a host directory: {named}"
            opened = watch.events()
            assert opened == [], f"diff opened host files: {opened}"
        assert diffs > 0, "no diff went through: nothing was shown"
        assert flips(parent) > 0, "the flipping thread made no progress"
    finally:
        watch.close()
        stop_flipper(parent)
    child.close()


def test_diff_of_an_entry_swapped_after_it_was_resolved_reads_nothing_of_the_host(
        tmp_path: Path, secret: tuple[Path, bytes]) -> None:
    """The race's worst instant, made to happen: both sides resolved ``d/key0`` as a
    regular file of the same size, then ``d`` became a symlink to the host directory
    before the contents were compared."""
    secret_dir, _ = secret
    mine, other = tmp_path / "mine", tmp_path / "other"
    for layer in (mine, other):
        (layer / "d").mkdir(parents=True)
        (layer / "d/key0").write_bytes(b"decoy-decoy-dec\n")
        (layer / "d/key0").chmod(0o644)
    fds = [os.open(p, os.O_RDONLY | os.O_DIRECTORY) for p in (mine, other)]
    watch = OpenWatch(secret_dir)
    try:
        a, b = layerdiff.resolve([fds[0]], "d/key0"), layerdiff.resolve([fds[1]], "d/key0")
        assert a is not None and b is not None
        shutil.rmtree(mine / "d")
        (mine / "d").symlink_to(secret_dir)
        with pytest.raises(OSError) as raised:
            layerdiff._same_content(a, b, layerdiff.Budget())
        assert raised.value.errno == errno.ELOOP
        # And the whole diff now: the symlink is compared as a symlink, nothing below it.
        result = layerdiff.diff_layers([mine], [other], ["/"])
        assert result == {"added": ["/d/key0"], "removed": ["/d"], "modified": []}, result
        assert watch.events() == []
    finally:
        watch.close()
        for fd in fds:
            os.close(fd)


# ------------------------------------------------------------------------------ fork

def test_fork_under_a_dir_symlink_swap_never_copies_a_host_file(
        harness, make, secret: tuple[Path, bytes]) -> None:
    secret_dir, marker = secret
    parent = make()
    start_flipper(parent, secret_dir)
    try:
        for _ in range(12):
            (child,) = parent.fork(1)
            layer = harness.engine.get(child.id).body.layers.frozen[0].lowerdir
            leaked = marked_files(layer, marker)
            assert leaked == [], f"a host file was copied into the fork's layer: {leaked}"
            seen = child.exec("cat /root/race/d/* 2>/dev/null | sort -u").stdout
            assert marker.decode().strip() not in seen
            child.close()
        assert flips(parent) > 0, "the flipping thread made no progress"
    finally:
        stop_flipper(parent)
    assert (secret_dir / "key0").read_bytes() == marker


def test_copy_snapshot_of_a_tree_flipping_under_it_never_copies_a_host_file(
        tmp_path: Path, secret: tuple[Path, bytes]) -> None:
    """The copy itself, with no freeze to stop the writer: a host thread flips ``d``
    and a symlink to the secret directory while the volume is copied, many times."""
    secret_dir, marker = secret
    volume = tmp_path / "volume"
    (volume / "upper/d").mkdir(parents=True)
    for k in range(KEYS):
        (volume / f"upper/d/key{k}").write_bytes(b"decoy-decoy-dec\n")
    (volume / "upper/alt").symlink_to(secret_dir)
    d, alt = os.fsencode(volume / "upper/d"), os.fsencode(volume / "upper/alt")
    stop, count = threading.Event(), [0]

    def flip() -> None:
        while not stop.is_set():
            if _libc.syscall(316, -100, d, -100, alt, 2) == 0:
                count[0] += 1

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    backend = CopyBackend()
    copied = refused = 0
    try:
        for i in range(40):
            snap = tmp_path / f"snap{i}"
            try:
                backend.snapshot(volume, snap, readonly=True)
            except OSError:
                # The tree changed under the copy (a directory became a symlink: ELOOP,
                # ENOTDIR, EINVAL from readlink): refused, and nothing is left behind.
                assert not snap.exists()
                refused += 1
                continue
            copied += 1
            leaked = marked_files(snap, marker)
            assert leaked == [], f"the copy followed a symlink into the host: {leaked}"
            for entry in ("d", "alt"):  # each name is a directory or a symlink, as made
                mode = os.lstat(snap / "upper" / entry).st_mode
                assert stat.S_ISDIR(mode) or stat.S_ISLNK(mode)
            backend.delete(snap)
    finally:
        stop.set()
        flipper.join()
    assert count[0] > 0
    assert copied + refused == 40


# ----------------------------------------------------------------------------- freeze

STUCK = r"""
import ctypes, fcntl, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
uffd = libc.syscall(323, os.O_CLOEXEC)  # userfaultfd
if uffd < 0:
    print("no-uffd", ctypes.get_errno(), flush=True)
    sys.exit(0)
fcntl.ioctl(uffd, 0xC018AA3F, bytearray(struct.pack("QQQ", 0xAA, 0, 0)), True)  # API
addr = libc.mmap(None, 4096, 3, 0x22, -1, 0)
fcntl.ioctl(uffd, 0xC020AA00, bytearray(struct.pack("QQQQ", addr, 4096, 1, 0)), True)
r, w = os.pipe()
os.write(w, b"x" * 64)
print("ready", flush=True)
# read() fills the registered page from kernel mode: the fault waits on the uffd that
# nobody serves, in a state the freezer cannot stop (a SIGKILL still ends it).
libc.read(r, ctypes.c_void_p(addr), 64)
"""


@pytest.fixture
def stuck() -> Iterator[subprocess.Popen]:
    """A host process that will not freeze (blocked on a userfaultfd fault)."""
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        proc.wait()
        proc.stdout.close()
        pytest.skip(f"cannot make an unfreezable process here: {line}")
    yield proc
    proc.kill()
    proc.wait()
    proc.stdout.close()


def test_a_sandbox_that_will_not_freeze_fails_fork_and_commit_and_still_closes(
        harness, monkeypatch, stuck: subprocess.Popen, tmp_path: Path) -> None:
    monkeypatch.setattr(cgroups, "FREEZE_TIMEOUT", 0.5)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    sb = harness.sandbox(workspace=str(workspace))
    try:
        cgroup = harness.engine.get(sb.id).body.cgroup
        for leaf_dir in cgroup._split_dirs():  # where the sandbox's commands live
            (leaf_dir / "cmds" / "cgroup.procs").write_text(str(stuck.pid))
        assert stuck.pid in cgroup.pids()
        with pytest.raises(cgroups.FreezeFailed):
            cgroup.freeze()
        with pytest.raises(SandboxError, match="freeze"):
            sb.fork(1)
        sb.exec(f"echo new > {workspace}/file")
        with pytest.raises(SandboxError, match="freeze"):
            sb.commit()
        assert not (workspace / "file").exists()
        # Nothing was left frozen: the sandbox goes on (the REPL and a command).
        assert sb.run_code("6 * 7").text == "42"
        assert sb.exec("echo alive").stdout.strip() == "alive"
    finally:
        sb.close()
    assert stuck.wait(10) == -9, "close did not kill the task that would not freeze"
