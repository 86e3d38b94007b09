"""Sandboxes on both storage backends: the REPL, commands, files, faults, limits, isolation."""

from __future__ import annotations

import os
import threading
import time

import pytest
from waiting import eventually

from branchbox import (
    CommandNotFound,
    InvalidRequest,
    ReplGone,
    SandboxNotFound,
    SandboxTimeout,
)
from branchbox.storage.idmap import UID_BASE


def test_quickstart(sandbox, harness) -> None:
    sandbox.run_code("import pandas as pd\ndf = pd.DataFrame({'a': range(10)})")
    assert sandbox.run_code("int(df.a.sum())").text == "45"
    out = sandbox.exec("uname -n; id -u").stdout.split()
    assert out == [sandbox.id, "0"]
    sandbox.files.write("/root/data/x.txt", b"hi")
    assert sandbox.files.read("/root/data/x.txt") == b"hi"
    assert sandbox.run_code("open('/root/data/x.txt').read()").text == "'hi'"


def test_the_repl_loads_the_agent_from_byte_code_made_ahead(make) -> None:
    """The agent layer is read-only in a sandbox: without its byte-code made when the
    layer is built, every REPL start would compile the agent again."""
    sb = make()
    missing = sb.run_code(
        "import os, sys\n"
        "sorted(n for n, m in list(sys.modules.items()) if n.startswith('bbagent')"
        " and not os.path.exists(m.__cached__))").text
    assert missing == "[]"
    assert "bbagent.main" in sb.run_code("import sys; sorted(sys.modules)").text


def test_repl_keeps_state_streams_and_reports_errors(sandbox) -> None:
    seen: list[str] = []
    r = sandbox.run_code("x = 41\nprint('hello')\nx + 1", on_stdout=seen.append)
    assert (r.text, r.stdout, "".join(seen)) == ("42", "hello\n", "hello\n")
    err = sandbox.run_code("1/0").error
    assert err.name == "ZeroDivisionError" and "division by zero" in err.value
    assert "ZeroDivisionError" in err.traceback
    assert sandbox.run_code("x").text == "41"


def test_rich_output(sandbox) -> None:
    r = sandbox.run_code(
        "class Pic:\n"
        "    def _repr_png_(self): return b'\\x89PNG fake'\n"
        "    def _repr_html_(self): return '<b>pic</b>'\n"
        "Pic()")
    assert r.results["text/html"] == "<b>pic</b>"
    assert "image/png" in r.results


def test_timeout_interrupts_and_keeps_state(sandbox) -> None:
    sandbox.run_code("state = 'kept'")
    with pytest.raises(SandboxTimeout):
        sandbox.run_code("while True: pass", timeout=1)
    assert sandbox.run_code("state").text == "'kept'"


def test_exec_streams_cwd_env_and_exit_codes(sandbox) -> None:
    chunks: list[str] = []
    r = sandbox.exec("echo one; sleep 0.2; echo two; exit 3", on_stdout=chunks.append)
    assert (r.stdout, r.exit_code) == ("one\ntwo\n", 3)
    assert len(chunks) == 2  # streamed as it happened, not at the end
    r = sandbox.exec("pwd; echo $GREETING", cwd="/tmp", env={"GREETING": "hi"})
    assert r.stdout == "/tmp\nhi\n"


def test_exec_argv_with_empty_arguments(sandbox) -> None:
    """An empty argument is an argument (bb-init once took it for the end of argv)."""
    r = sandbox.exec(["printf", "[%s]", "", "x", ""], env={"EMPTY": ""})
    assert (r.stdout, r.exit_code) == ("[][x][]", 0)
    assert sandbox.exec(["sh", "-c", 'echo "${EMPTY-unset}"'], env={"EMPTY": ""}).stdout == "\n"
    with pytest.raises(CommandNotFound):
        sandbox.exec([""])


def test_background_command(sandbox) -> None:
    handle = sandbox.exec("sleep 0.3; echo done", background=True)
    assert handle.wait().stdout == "done\n"
    handle = sandbox.exec("sleep 60", background=True)
    handle.kill()


def test_bad_input_gets_typed_errors(sandbox, harness) -> None:
    with pytest.raises(InvalidRequest, match="image"):
        harness.sandbox(image="no-such-image")
    with pytest.raises(InvalidRequest, match="env is"):
        harness.sandbox(env={"BIG": "x" * 200_000})
    with pytest.raises(InvalidRequest):
        sandbox.files.write("relative/path", b"x")
    with pytest.raises(InvalidRequest):
        sandbox.files.write("/root/../../etc/escape", b"x")
    with pytest.raises(CommandNotFound):
        sandbox.exec("definitely-not-a-command-xyz")
    assert sandbox.run_code("1+1").text == "2"  # nothing was lost


def test_huge_output_is_bounded_with_a_marker(sandbox) -> None:
    r = sandbox.exec("head -c 300000000 /dev/zero | tr '\\0' a")
    assert r.exit_code == 0
    assert len(r.stdout) <= 17 * 1024 * 1024
    assert "output truncated" in r.stderr
    r = sandbox.run_code("print('b' * 50_000_000)")
    assert len(r.stdout) <= 17 * 1024 * 1024 and r.truncated


@pytest.mark.parametrize("code", [
    "import os; os._exit(3)",
    "import ctypes; ctypes.string_at(0)",  # segfault
])
def test_repl_that_kills_itself(make, code) -> None:
    sb, other = make(), make()
    with pytest.raises(ReplGone):
        sb.run_code(code)
    assert sb.info()["state"] == "gone"
    with pytest.raises(ReplGone):
        sb.run_code("1")
    assert other.run_code("2+2").text == "4"  # neighbours and the daemon are unaffected
    sb.close()


def test_memory_hog_hits_the_sandbox_limit(make) -> None:
    sb, other = make(memory_mb=128), make()
    with pytest.raises(ReplGone):
        sb.run_code("hog = bytearray(1024 * 1024 * 1024)\nhog[::4096] = b'x' * len(hog[::4096])")
    assert other.run_code("'alive'").text == "'alive'"


def test_fork_bomb_hits_the_sandbox_limit(make, harness) -> None:
    sb, other = make(), make()
    cgroup = harness.engine.get(sb.id).body.cgroup
    # In the background: the answer of a foreground exec (its shell's exit, then its
    # output, a flood of bash's fork retries) competes for CPU with the bomb itself.
    sb.exec(":(){ :|:& };:", background=True)
    assert eventually(lambda: cgroup.pids_current() > 50, within=30), "the bomb never spread"
    time.sleep(2)
    assert cgroup.pids_current() <= harness.engine.config.pids_max
    assert other.exec("echo fine").stdout == "fine\n"
    sb.close()  # kills the whole bomb: nothing of it is left in the cgroup
    assert not cgroup.dirs


def test_isolation_from_the_host(sandbox, harness) -> None:
    for host_path in ("/work", str(harness.data_dir), "/var/lib/branchbox"):
        assert sandbox.exec(f"test -e {host_path}").exit_code == 1, host_path
    assert not sandbox.files.exists(str(harness.data_dir / "branchbox.sock"))
    # ps sees only this sandbox: its command namespace's init, the shell and ps itself
    pids = sandbox.exec("ps -e -o pid=,comm=").stdout.split("\n")
    assert len([p for p in pids if p.strip()]) <= 3, pids
    # a file created by sandbox root is owned by the unprivileged mapped uid on the host:
    # the first of its family's own range (never the images' storage range)
    sandbox.exec("echo x > /root/owned.txt")
    base = harness.engine.get(sandbox.id).body.layers.ids.base
    assert harness.host_path(sandbox, "/root/owned.txt").stat().st_uid == base > UID_BASE
    # no block devices, and mounting a host disk is refused
    assert sandbox.exec("find /dev -type b").stdout == ""
    r = sandbox.exec("mknod /tmp/disk b 254 0 && mount /tmp/disk /mnt")
    assert r.exit_code != 0
    # the network is the sandbox's own: loopback and its veth end (issue 10), nothing of the
    # host's
    links = [line.split(":")[1].strip().split("@")[0]
             for line in sandbox.exec("ip -o link").stdout.splitlines()]
    assert sorted(links) == ["eth0", "lo"]


def test_image_files_are_root_owned_and_modifiable(sandbox) -> None:
    assert sandbox.exec("stat -c %u:%g /usr/bin/python3.11").stdout.strip() == "0:0"
    sandbox.files.write("/root/pkg/setup.py",
                        b"from setuptools import setup\nsetup(name='bbdemo', version='1.0',"
                        b" py_modules=['bbdemo'])\n")
    sandbox.files.write("/root/pkg/bbdemo.py", b"ANSWER = 42\n")
    r = sandbox.exec("pip install --no-index --no-build-isolation --break-system-packages "
                     "/root/pkg", timeout=120)
    assert r.exit_code == 0, r.stderr
    assert sandbox.run_code("import bbdemo; bbdemo.ANSWER").text == "42"
    sandbox.exec("echo changed >> /etc/os-release")  # copy-up of an image file
    assert sandbox.exec("tail -1 /etc/os-release").stdout == "changed\n"


def test_files_large_list_exists_remove(sandbox) -> None:
    blob = os.urandom(5 * 1024 * 1024 + 3)
    sandbox.files.write("/tmp/big.bin", blob)
    assert sandbox.files.read("/tmp/big.bin") == blob
    names = [e["name"] for e in sandbox.files.list("/tmp")]
    assert "big.bin" in names
    sandbox.files.remove("/tmp/big.bin")
    assert not sandbox.files.exists("/tmp/big.bin")


def test_a_listing_larger_than_any_answer_comes_whole_and_in_order(sandbox) -> None:
    """A directory's listing is streamed in checked batches: 120,000 entries of 255-byte
    names (a 72 MB answer, past the 64 MiB a frame may carry: it was a 413) come whole,
    sorted, with the agent's fields; the sandbox goes on."""
    sandbox.run_code("import os\nos.makedirs('/root/wide')\n"
                     "for i in range(120_000):\n"
                     "    open(f'/root/wide/{i:06d}' + 'n' * 249, 'w').close()")
    entries = sandbox.files.list("/root/wide")
    assert [e["name"] for e in entries] == [f"{i:06d}" + "n" * 249 for i in range(120_000)]
    assert entries[7] == {**entries[7], "path": "/root/wide/" + entries[7]["name"],
                          "type": "file", "size": 0}
    assert sandbox.run_code("'fine'").text == "'fine'"


def test_close_kills_everything_and_is_idempotent(harness) -> None:
    sb = harness.sandbox()
    sb.exec("sleep 600", background=True)
    cgroup = harness.engine.get(sb.id).body.cgroup
    dirs = list(cgroup.dirs)
    assert cgroup.pids() and dirs
    sb.close()
    sb.close()
    assert not any(d.exists() for d in dirs)
    assert sb.id not in harness.engine.live


def test_a_closed_sandboxs_volume_is_deleted_off_the_event_loop(harness) -> None:
    """Deleting a volume takes as long as it holds files (0.9 s for 300,000 on btrfs):
    a close hands it to the store's deleter thread rather than stalling every other
    sandbox's calls on the daemon's event loop, and it is gone soon after."""
    deleter = harness.engine.layers.deleter
    threads: list[str] = []
    real = deleter._delete

    def delete(path):
        threads.append(threading.current_thread().name)
        real(path)

    deleter._delete = delete
    try:
        sb = harness.sandbox()
        sb.exec("mkdir /root/many && cd /root/many && seq 2000 | xargs touch")
        volume = harness.engine.get(sb.id).body.layers.volume
        sb.close()
        assert eventually(lambda: not volume.exists(), within=10)
        assert threads and set(threads) == {"bb-delete"}
    finally:
        deleter._delete = real


def test_timeout_closes_the_sandbox(harness) -> None:
    sb = harness.sandbox(timeout=1)
    deadline = time.monotonic() + 10
    while sb.id in harness.engine.live and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(SandboxNotFound):
        sb.info()
