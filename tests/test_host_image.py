"""``image="host"``: the host's own root under a sandbox, read-only and id-mapped, with secrets
and the daemon's state masked (storage/host_mask.py, engine/host_image.py)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Harness

from branchbox import Sandbox
from branchbox.sdk import InvalidRequest
from branchbox.storage import host_mask
from branchbox.storage.idmap import UID_BASE

OPERATOR_DENIED = "/etc/bb-operator-secret-*"


@pytest.fixture(scope="module")
def host_harness() -> Iterator[Harness]:
    """An engine on the btrfs store whose operator denies one path more (as
    ``branchbox serve --host-deny`` does, through the environment)."""
    os.environ["BRANCHBOX_HOST_DENY"] = OPERATOR_DENIED + os.pathsep + "~/.bb-operator-token"
    try:
        h = Harness("btrfs")
    finally:
        del os.environ["BRANCHBOX_HOST_DENY"]
    yield h
    h.stop()
    shutil.rmtree(h.data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def host_files() -> Iterator[dict[str, Path]]:
    """Files on the host, made before the first host sandbox: secrets under /root and /etc,
    a tool under a home directory, a file of another owner. Only what the fixture made is
    removed afterwards; a secret the host already has is left alone (and checked too)."""
    tag = secrets.token_hex(4)
    made: list[Path] = []

    def make(path: Path, text: str, mode: int = 0o600) -> Path:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            path.chmod(mode)
            made.append(path)
        return path

    home = Path("/root")
    files = {
        "netrc": make(home / ".netrc", "machine x login y password z\n"),
        "aws": make(home / ".aws" / "credentials", "[default]\nkey = secret\n"),
        "history": make(home / ".bash_history", "secret command\n"),
        "operator": make(Path(f"/etc/bb-operator-secret-{tag}"), "operator secret\n"),
        "operator_home": make(home / ".bb-operator-token", "token\n"),
        "tool": make(home / f".bb-test-tools-{tag}" / "bin" / "bbtool",
                     "#!/bin/sh\necho tool from a home directory\n", 0o755),
        "owned": make(home / f".bb-test-owned-{tag}", "owned by 1234\n", 0o644),
    }
    os.chown(files["owned"], 1234, 2345)
    # A home of its own holding every home entry of the default deny list.
    other_home = Path("/home") / f"bb-test-{tag}"
    for entry in host_mask.DEFAULT_DENY:
        if entry.startswith("~/"):
            files[entry] = make(other_home / entry[2:], "secret\n")
    yield files
    shutil.rmtree(other_home, ignore_errors=True)
    for path in made:
        path.unlink(missing_ok=True)
    shutil.rmtree(files["tool"].parent.parent, ignore_errors=True)
    for empty in (home / ".aws",):
        if empty.is_dir() and not any(empty.iterdir()):
            empty.rmdir()


@pytest.fixture
def host_sandbox(host_harness: Harness, host_files: dict[str, Path]):
    sb = host_harness.sandbox(image="host")
    yield sb
    sb.close()


def test_the_hosts_python_and_tools_run_inside(host_sandbox, host_files) -> None:
    host_version = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version)"],
                                  capture_output=True, text=True, check=True).stdout.strip()
    run = host_sandbox.run_code("import sys; sys.version")  # the REPL runs the host's python
    assert (run.error, run.text) == (None, repr(host_version))
    done = host_sandbox.exec(f"{host_files['tool']} && debootstrap --version | head -1 && "
                             "/usr/bin/python3 -c 'import sys; print(sys.prefix)'")
    assert done.exit_code == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == "tool from a home directory"
    assert done.stdout.splitlines()[-1] == "/usr"


def test_the_host_image_is_listed_with_its_users(host_harness, host_sandbox) -> None:
    listed = {i["name"]: i for i in Sandbox.list_images(transport=host_harness.transport())}
    assert listed["host"]["kind"] == "host" and listed["host"]["users"] == [host_sandbox.id]
    with pytest.raises(InvalidRequest, match="cannot be saved"):
        host_sandbox.save_image("from-host")


def test_host_files_keep_their_owners(host_sandbox, host_files) -> None:
    done = host_sandbox.exec(f"stat -c '%u:%g %a' /usr/bin/env /root {host_files['owned']}")
    assert done.exit_code == 0, done.stderr
    root_mode = oct(os.stat("/root").st_mode & 0o7777)[2:]
    assert done.stdout.split("\n")[:3] == ["0:0 755", f"0:0 {root_mode}", "1234:2345 644"]
    assert host_sandbox.exec("id -u").stdout.strip() == "0"


def test_secrets_and_host_state_are_masked(host_harness, host_sandbox, host_files) -> None:
    paths = ["/etc/shadow", "/etc/gshadow", "/etc/ssl/private", "/root/.ssh",
             *(str(path) for key, path in host_files.items() if key.startswith("~/")),
             str(host_files["netrc"]),
             str(host_files["aws"]), str(host_files["history"]), str(host_files["operator"]),
             str(host_files["operator_home"]), str(host_harness.data_dir),
             str(host_harness.engine.config.image_cache),
             *map(str, Path("/etc/ssh").glob("ssh_host_*_key"))]
    for path in paths:
        assert host_sandbox.exec(f"test -e {path} || test -L {path}").exit_code == 1, path
    # The sandbox's own /run and /tmp (empty at start), /proc of its own, no host /sys.
    done = host_sandbox.exec("ls -A /run /tmp /sys; ls /proc | grep -c '^[0-9]'")
    assert done.stdout.split()[:3] == ["/run:", "/sys:", "/tmp:"], done.stdout
    assert int(done.stdout.split()[3]) < 20  # its own processes; the host has hundreds
    # Homes stay readable: the rest of /root is there.
    listed = host_sandbox.exec("ls -A /root").stdout.split()
    assert host_files["tool"].parent.parent.name in listed and ".netrc" not in listed


def test_writes_land_only_in_the_sandbox(host_harness, host_sandbox) -> None:
    name = f"/usr/bb-test-{secrets.token_hex(4)}"
    done = host_sandbox.exec(f"echo mine > {name} && rm /usr/bin/env && cat {name}")
    assert (done.exit_code, done.stdout) == (0, "mine\n"), done.stderr
    assert not Path(name).exists() and Path("/usr/bin/env").exists()
    other = host_harness.sandbox(image="host")
    try:
        assert other.exec(f"test -e {name}").exit_code == 1
        assert other.exec("test -x /usr/bin/env").exit_code == 0
    finally:
        other.close()


def test_a_host_sandbox_forks(host_sandbox) -> None:
    host_sandbox.exec("echo parent > /root/bb-fork-test")
    children = host_sandbox.fork(2)
    try:
        for child in children:
            assert child.exec("cat /root/bb-fork-test").stdout == "parent\n"
            assert child.exec("python3 -c 'print(1)'").stdout == "1\n"
    finally:
        for child in children:
            child.close()
    assert not Path("/root/bb-fork-test").exists()


def test_a_workspace_on_the_host_image(host_harness, host_files) -> None:
    base = Path(host_harness.data_dir).parent / f"branchbox-ws-{secrets.token_hex(4)}"
    base.mkdir(mode=0o755)
    try:
        (base / "a.txt").write_text("host\n")
        sb = host_harness.sandbox(image="host", workspace=str(base), cwd=str(base))
        try:
            assert sb.exec("cat a.txt && echo new > b.txt").stdout == "host\n"
            assert not (base / "b.txt").exists()
            sb.commit()
            assert (base / "b.txt").read_text() == "new\n"
        finally:
            sb.close()
    finally:
        shutil.rmtree(base)


def test_a_store_on_the_hosts_root_refuses_the_host_image(harness, make) -> None:
    if harness.backend == "btrfs":
        assert make(image="host").exec("true").exit_code == 0
        return
    with pytest.raises(InvalidRequest, match="store on another filesystem"):
        make(image="host")


# -- the mask, on a tree standing in for the host ------------------------------------------


def test_the_mask_hides_denied_paths_through_the_hosts_links(tmp_path: Path) -> None:
    host = tmp_path / "host"
    (host / "var" / "home" / "ann" / ".ssh").mkdir(parents=True)
    (host / "home").symlink_to("var/home")
    (host / "etc").mkdir()
    (host / "etc" / "shadow").write_text("x")
    (host / "srv").mkdir()
    (host / "var" / "home" / "ann" / ".netrc").symlink_to("/srv/netrc")
    os.chown(host / "var" / "home" / "ann", 1000, 1000)
    hidden = host_mask.hidden_paths(["/etc/shadow", "~/.ssh", "~/.netrc", "~/.aws/x"],
                                    ["/home/ann", "/nohome"], root=host)
    # By the real parent (a link is never shadowed), a denied link's target too; no file
    # under a directory that does not exist.
    assert hidden == ["/etc/shadow", "/srv/netrc", "/var/home/ann/.netrc",
                      "/var/home/ann/.ssh"]
    mask = tmp_path / "mask"
    mask.mkdir()
    host_mask.build_mask(mask, hidden, {"/run": 0o755}, root=host)
    ann = mask / "var" / "home" / "ann"
    assert (ann.stat().st_uid, ann.stat().st_gid) == (UID_BASE + 1000, UID_BASE + 1000)
    assert os.major((ann / ".ssh").lstat().st_rdev) == 0 and (ann / ".ssh").is_char_device()
    assert not (mask / "home").exists()
    assert os.getxattr(mask / "run", "trusted.overlay.opaque") == b"y"


def test_deny_entries_are_checked(tmp_path: Path) -> None:
    for bad in ("relative", "/a/../etc/shadow", "~/", "/"):
        with pytest.raises(ValueError, match="absolute path or ~/PATH"):
            host_mask.check_pattern(bad)
    listing = tmp_path / "deny"
    listing.write_text("# ours\n/srv/secrets/*\n\n~/.config/tokens\n")
    assert host_mask.read_deny_file(listing) == ["/srv/secrets/*", "~/.config/tokens"]


def test_the_daemons_key_file_is_hidden_from_host_sandboxes() -> None:
    """`serve --api-keys FILE`: a key file outside the data directory (where an operator
    keeps secrets, e.g. /etc) is masked like the default deny list."""
    from served import ServedDaemon

    key = secrets.token_hex(16)
    key_file = Path(f"/etc/bb-test-keys-{secrets.token_hex(4)}")
    key_file.write_text(key + "\n")
    key_file.chmod(0o644)  # even world-readable on the host
    env = {k: v for k, v in os.environ.items() if k != "BRANCHBOX_API_KEY"}
    daemon = None
    try:
        daemon = ServedDaemon("hostkeys", env, "--storage", "btrfs", "--api-keys", str(key_file))
        with Sandbox(url=daemon.url, api_key=key, image="host") as sb:
            seen = sb.exec(f"cat {key_file}; ls /etc | grep -c bb-test-keys-")
            assert key not in seen.stdout and seen.stdout.split()[-1] == "0", seen
            assert sb.exec("test -r /etc/hostname && echo visible").stdout == "visible\n"
    finally:
        if daemon is not None:
            daemon.stop()
        key_file.unlink()
