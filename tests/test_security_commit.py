"""Workspace commit treats the sandbox as hostile: attacks run from inside real sandboxes.

Each test is an attack a sandbox's root could mount on the daemon (host root)
through ``commit()``, run against the real engine on both storage backends:

- setuid/setgid files, FIFOs and sockets made in the workspace must not
  arrive on the host as such, and the sandbox must not choose host owners;
- a thread flipping a workspace directory and a symlink to a root-only host
  directory while the daemon commits must never get that directory's
  content copied into the workspace (the daemon would follow the symlink).

One test also drives the storage layer directly, to hit the race's losing
instant deterministically: a plan made when a path was a directory, read
after it became a symlink.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from readback import regular_files
from waiting import eventually

from branchbox import SandboxError
from branchbox.agent import sysc
from branchbox.storage import journal
from branchbox.storage import workspace_commit as wc

OWNER = 1234  # the workspace directory's host owner (uid and gid)
OTHER = 4321  # the host owner of a file that exists before the sandbox starts


@pytest.fixture
def workspace() -> Iterator[Path]:
    """A host directory owned by neither root nor the sandbox's ids."""
    root = Path(tempfile.mkdtemp(prefix="bbsec-ws-"))
    os.chown(root, OWNER, OWNER)
    root.chmod(0o755)
    yield root
    shutil.rmtree(root)  # never follows the symlinks a commit may have placed here


@pytest.fixture
def secret() -> Iterator[tuple[Path, bytes]]:
    """A root-only host directory holding a file the sandbox must never see."""
    where = Path(tempfile.mkdtemp(prefix="bbsec-secret-"))
    where.chmod(0o700)
    marker = f"TOP-SECRET-{secrets.token_hex(8)}".encode()
    (where / "key").write_bytes(marker + b"\n")
    (where / "key").chmod(0o600)
    yield where, marker
    shutil.rmtree(where)


def test_setid_bits_are_stripped_and_owners_are_the_hosts(harness, workspace: Path) -> None:
    (workspace / "shared.txt").write_text("host version\n")
    os.chown(workspace / "shared.txt", OTHER, OTHER)
    (workspace / "shared.txt").chmod(0o4755)  # a host setuid file the sandbox edits
    (workspace / "group").mkdir()
    os.chown(workspace / "group", OTHER, OTHER)
    (workspace / "group").chmod(0o2775)  # the host's own setgid dir: left as it is
    with harness.sandbox(workspace=str(workspace), cwd=str(workspace)) as sb:
        done = sb.exec(
            "printf '#!/bin/sh\\nid\\n' > suid && chown 5555:5555 suid && chmod 4755 suid && "
            "mkdir sgid && chmod 2775 sgid && echo x > sgid/f && chmod 6755 sgid/f && "
            "echo sandbox version >> shared.txt && chown 0:0 shared.txt && "
            "chmod 4755 shared.txt && echo y > group/new && chown 0:0 group/new"
        )
        assert done.exit_code == 0, done.stderr
        result = sb.commit()
    st = os.lstat(workspace / "suid")
    assert stat.S_IMODE(st.st_mode) == 0o755, oct(st.st_mode)
    assert (st.st_uid, st.st_gid) == (OWNER, OWNER)  # not 5555, not root
    st = os.lstat(workspace / "sgid")
    assert stat.S_IMODE(st.st_mode) == 0o775 and (st.st_uid, st.st_gid) == (OWNER, OWNER)
    st = os.lstat(workspace / "sgid/f")
    assert stat.S_IMODE(st.st_mode) == 0o755 and (st.st_uid, st.st_gid) == (OWNER, OWNER)
    # A changed existing file keeps its host owner and gets no setid bit back.
    st = os.lstat(workspace / "shared.txt")
    assert (workspace / "shared.txt").read_text() == "host version\nsandbox version\n"
    assert (st.st_uid, st.st_gid) == (OTHER, OTHER)
    assert stat.S_IMODE(st.st_mode) == 0o755
    # The host's setgid dir merges unchanged; what the sandbox adds in it is new.
    st = os.lstat(workspace / "group")
    assert stat.S_IMODE(st.st_mode) == 0o2775 and st.st_uid == OTHER
    assert os.lstat(workspace / "group/new").st_uid == OWNER
    # Nothing in the workspace is setuid/setgid but the host's own directory.
    for dirpath, dirnames, filenames in os.walk(workspace):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if path != str(workspace / "group"):
                assert not os.lstat(path).st_mode & (stat.S_ISUID | stat.S_ISGID), path
    # And the user is told what was changed.
    stripped = {entry["path"]: entry["bits"] for entry in result["stripped"]}
    assert stripped == {
        "suid": ["setuid"],
        "sgid": ["setgid"],
        "sgid/f": ["setuid", "setgid"],
        "shared.txt": ["setuid"],
    }
    assert result["refused"] == [] and "suid" in result["changed"]
    assert result["version"] == 1 and result["bytes"] > 0


def test_a_sparse_file_arrives_sparse(harness, workspace: Path) -> None:
    """A 3 GiB file of one written page costs the sandbox a page of its disk limit; its
    commit wrote 3 GiB of zeros onto the host's disk (``truncate -s 1T`` would fill it)."""
    with harness.sandbox(workspace=str(workspace), cwd=str(workspace)) as sb:
        done = sb.exec("truncate -s 3G sparse && printf marker | "
                       "dd of=sparse bs=1 seek=1073741824 conv=notrunc status=none")
        assert done.exit_code == 0, done.stderr
        sb.commit()
    st = os.lstat(workspace / "sparse")
    assert st.st_size == 3 << 30
    assert st.st_blocks * 512 < 1 << 20, f"{st.st_blocks * 512} bytes allocated on the host"
    with open(workspace / "sparse", "rb") as f:
        f.seek(1 << 30)
        assert f.read(6) == b"marker"


def test_fifos_and_sockets_are_refused_and_reported_the_rest_commits(
    harness, workspace: Path
) -> None:
    with harness.sandbox(workspace=str(workspace), cwd=str(workspace)) as sb:
        done = sb.exec(
            "mkfifo pipe && mkdir sub && mkfifo sub/pipe2 && "
            "python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"sock\")' && "
            "echo kept > plain.txt"
        )
        assert done.exit_code == 0, done.stderr
        result = sb.commit()
        assert sb.exec("test -p pipe").exit_code == 0  # the sandbox keeps its own
    for special in ("pipe", "sock", "sub/pipe2"):
        assert not os.path.lexists(workspace / special), special
    assert (workspace / "plain.txt").read_text() == "kept\n"
    assert stat.S_ISDIR(os.lstat(workspace / "sub").st_mode)
    refused = {entry["path"]: entry["kind"] for entry in result["refused"]}
    assert refused == {"pipe": "fifo", "sock": "socket", "sub/pipe2": "fifo"}
    assert set(result["changed"]) == {"plain.txt", "sub"}
    assert result["stripped"] == []


def test_symlinks_pointing_out_of_the_workspace_are_listed(harness, workspace: Path) -> None:
    """Symlinks are committed as they are (nothing follows them), and those whose target
    is absolute or climbs past the workspace's root, by itself or through another link,
    are listed for the host's user to look at; links that stay inside are not."""
    with harness.sandbox(workspace=str(workspace), cwd=str(workspace)) as sb:
        done = sb.exec(
            "mkdir -p sub/deeper && ln -s /etc/shadow abs && ln -s ../../x sub/up && "
            "ln -s ../inside sub/stays && ln -s sub alias && "
            "ln -s ../../../y sub/deeper/up3 && ln -s ./a/../../z dotted && "
            "mkdir a && ln -s .. a/p && ln -s p/.. a/x && ln -s p/../.. a/y && "
            "ln -s loop1 a/loop2 && ln -s loop2 a/loop1"
        )
        assert done.exit_code == 0, done.stderr
        result = sb.commit()
    assert os.readlink(workspace / "abs") == "/etc/shadow"  # committed, not followed
    out = {entry["path"]: entry["target"] for entry in result["links_out"]}
    assert out == {"abs": "/etc/shadow", "sub/up": "../../x",
                   "sub/deeper/up3": "../../../y", "dotted": "./a/../../z",
                   # through another link: a/p is the root, a/x its parent, a/y above
                   "a/x": "p/..", "a/y": "p/../..",
                   # a loop the kernel gives up on counts as leaving
                   "a/loop1": "loop2", "a/loop2": "loop1"}


def test_a_changed_file_keeps_its_host_owner_a_new_one_takes_the_directorys(
    harness, workspace: Path
) -> None:
    (workspace / "owned.txt").write_text("v1\n")
    os.chown(workspace / "owned.txt", OTHER, OTHER)
    (workspace / "replaced").write_text("a file\n")
    os.chown(workspace / "replaced", OTHER, OTHER)
    with harness.sandbox(workspace=str(workspace), cwd=str(workspace)) as sb:
        done = sb.exec(
            "echo v2 > owned.txt && chown 0:0 owned.txt && "
            "rm replaced && mkdir replaced && echo in > replaced/inner && "
            "mkdir -p fresh/deeper && echo new > fresh/deeper/file && chown -R 77:77 fresh && "
            "ln -s owned.txt alias && chown -h 0:0 alias"
        )
        assert done.exit_code == 0, done.stderr
        sb.commit()
    assert (workspace / "owned.txt").read_text() == "v2\n"
    assert os.lstat(workspace / "owned.txt").st_uid == OTHER
    assert os.lstat(workspace / "owned.txt").st_gid == OTHER
    assert os.lstat(workspace / "replaced").st_uid == OTHER  # replaces an entry: its owner
    assert os.lstat(workspace / "replaced/inner").st_uid == OWNER
    for rel in ("fresh", "fresh/deeper", "fresh/deeper/file", "alias"):
        st = os.lstat(workspace / rel)
        assert (st.st_uid, st.st_gid) == (OWNER, OWNER), rel


FLIPPER = """
import ctypes, os, threading
os.chdir({ws!r})
_libc = ctypes.CDLL(None, use_errno=True)
_flips = [0]
_stop = threading.Event()

def _pair(k):
    os.mkdir(f"d{{k}}")
    with open(f"d{{k}}/key", "w") as f:
        f.write("decoy\\n")
    os.symlink({secret!r}, f"alt{{k}}")
    return f"d{{k}}".encode(), f"alt{{k}}".encode()

def _flip():
    # renameat2(AT_FDCWD, d, AT_FDCWD, alt, RENAME_EXCHANGE): d is a directory and a
    # symlink to the host's secret directory in turn, as fast as it goes. Once a commit
    # has put d into the host directory (the overlay's lower) the kernel may refuse to
    # move it (EXDEV): then carry on with a fresh pair.
    k = 0
    d, alt = _pair(k)
    while not _stop.is_set():
        if _libc.syscall(316, -100, d, -100, alt, 2) == 0:
            _flips[0] += 1
        else:
            k += 1
            d, alt = _pair(k)

threading.Thread(target=_flip, daemon=True).start()
"""


def flips(sb) -> int:
    execution = sb.run_code("_flips[0]")
    assert execution.error is None, execution.error
    return int(execution.text)


def test_a_symlink_swapped_in_during_commit_never_brings_a_host_file(
    harness, workspace: Path, secret: tuple[Path, bytes]
) -> None:
    secret_dir, marker = secret
    with harness.sandbox(workspace=str(workspace), cwd=str(workspace)) as sb:
        started = sb.run_code(FLIPPER.format(ws=str(workspace), secret=str(secret_dir)))
        assert started.error is None, started.error
        before = flips(sb)
        committed = 0
        for _ in range(40):
            try:
                sb.commit()
                committed += 1
            except SandboxError:
                pass  # a commit that gives up on a layer changing under it leaks nothing
            leaked = [rel for rel, data in regular_files(workspace).items() if marker in data]
            assert leaked == [], f"a root-only host file was committed as {leaked}"
        assert committed > 0, "no commit went through: nothing was shown"
        # The read-only instants commit read (btrfs snapshots) are gone again.
        assert eventually(lambda: not list(harness.engine.layers.root.glob("c-*")), within=10)
        # The attack really ran alongside the commits (not a timing: any progress at all).
        assert flips(sb) > before, "the flipping thread made no progress"
        sb.run_code("_stop.set()")
    assert (secret_dir / "key").read_bytes() == marker + b"\n"
    assert stat.S_IMODE(secret_dir.stat().st_mode) == 0o700


def test_a_layer_changed_after_the_plan_is_read_without_following_symlinks(
    tmp_path: Path, secret: tuple[Path, bytes]
) -> None:
    """The race's worst instant, made to happen: the plan saw ``d/`` as a directory with
    ``key`` in it, and by the time the content is copied ``d`` is a symlink to a
    root-only host directory that also holds a ``key``."""
    secret_dir, marker = secret
    layer, host = tmp_path / "upper", tmp_path / "host"
    (layer / "d").mkdir(parents=True)
    (layer / "d/key").write_text("decoy\n")
    host.mkdir()
    with wc._opened([layer]) as fds, wc._opened([host]) as (host_fd,):
        plan = wc._plan(wc._changes(fds, [str(layer)]), host_fd, float("inf"))
        shutil.rmtree(layer / "d")
        (layer / "d").symlink_to(secret_dir)
        with pytest.raises(OSError):
            journal.run(str(host), host_fd, plan.steps, plan.staged, fds, None)
    assert list(host.iterdir()) == []  # refused before the commit point: nothing placed
    assert not [p for p in tmp_path.iterdir() if ".branchbox-commit-" in p.name]
    assert [rel for rel, data in regular_files(tmp_path).items() if marker in data] == []


def test_host_symlinks_committed_earlier_are_replaced_never_followed(
    tmp_path: Path,
) -> None:
    """An earlier commit left ``out -> <dir outside>`` in the host workspace; a later
    delta with a directory ``out/`` must replace the link, not write through it."""
    outside, layer, host = tmp_path / "outside", tmp_path / "upper", tmp_path / "host"
    outside.mkdir()
    host.mkdir()
    (host / "out").symlink_to(outside)
    (layer / "out").mkdir(parents=True)
    (layer / "out/planted").write_text("through the link?\n")
    result = wc.commit([layer], host, since=float("inf"))
    assert list(outside.iterdir()) == []
    assert stat.S_ISDIR(os.lstat(host / "out").st_mode)
    assert (host / "out/planted").read_text() == "through the link?\n"
    assert {"out", "out/planted"} <= set(result.changed)


def test_a_mount_inside_the_workspace_is_never_written_through(tmp_path: Path) -> None:
    """Commit stays on the workspace's own filesystem: a delta under a mount point in the
    host directory is refused, and nothing reaches the mounted filesystem."""
    layer, host = tmp_path / "upper", tmp_path / "host"
    (host / "mnt").mkdir(parents=True)
    (layer / "mnt").mkdir(parents=True)
    (layer / "mnt/planted").write_text("across a mount?\n")
    (layer / "fine.txt").write_text("fine\n")
    sysc.mount("tmpfs", str(host / "mnt"), "tmpfs", 0, "size=1m")
    try:
        with pytest.raises(OSError) as caught:
            wc.commit([layer], host, since=float("inf"))
        assert caught.value.errno == errno.EXDEV
        assert list((host / "mnt").iterdir()) == []
    finally:
        sysc.umount2(str(host / "mnt"))
    assert sorted(p.name for p in host.iterdir()) == ["mnt"]  # refused before any change
