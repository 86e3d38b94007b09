"""Output written to fds 1 and 2 is cut at the output limit, not held (issue 16, finding 9).

A subprocess of the REPL that writes a gigabyte used to fill a memory file of
that size inside the sandbox: under a 256 MiB memory limit the REPL was killed.
Now the call returns, with the first 16 MiB and a truncation marker, and what
a leftover writer keeps writing after the call is dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from branchbox import Sandbox

GIGABYTE = 1 << 30


def test_a_gigabyte_from_a_subprocess_is_cut_at_the_limit(make: Callable[..., Sandbox]) -> None:
    sb = make(memory_mb=256)
    run = sb.run_code("import subprocess\n"
                      f"subprocess.run('yes | head -c {GIGABYTE}', shell=True).returncode")
    assert run.error is None, run.error
    assert run.text == "0"
    assert run.truncated
    assert len(run.stdout) <= 16 << 20
    assert run.stdout.startswith("y\ny\n")
    assert "output truncated" in run.stderr
    assert sb.run_code("40 + 2").text == "42"  # the REPL lives on, its fds are its own


def test_a_writer_left_running_after_the_call_does_not_block_or_leak(
        make: Callable[..., Sandbox]) -> None:
    sb = make(memory_mb=256)
    sb.run_code("import subprocess\n"
                f"p = subprocess.Popen('yes | head -c {GIGABYTE}; echo end > /tmp/end', "
                "shell=True)")
    run = sb.run_code("p.wait(timeout=120)\nopen('/tmp/end').read()")
    assert run.error is None, run.error
    assert run.text == "'end\\n'"  # its output after the call was read and dropped
    assert "y\n" not in run.stdout


def test_calls_are_drained_by_the_c_thread_here(make: Callable[..., Sandbox]) -> None:
    """On x86_64 the pipes are drained by bb-drain's C thread (agent/bb_drain.c), so the
    tests above exercise it; the agent's own tests (run bare) the Python thread."""
    sb = make()
    assert sb.run_code("from bbagent import capture\ncapture.native()").text == "True"


def test_many_leftover_writers_and_a_big_write_of_the_repl_itself(
        make: Callable[..., Sandbox]) -> None:
    """More leftover pipes than the C thread takes: the Python thread drains that call.
    A write of the REPL itself far beyond a pipe's size does not block either way."""
    sb = make(memory_mb=256)
    for _ in range(70):  # each call's pipes are kept by a writer that outlives it
        sb.run_code("import subprocess\n"
                    "subprocess.Popen(['sh', '-c', 'sleep 30 & wait'])", timeout=30)
    run = sb.run_code("import os\nfor _ in range(64): os.write(1, b'z' * 65536)\n"
                      "os.write(2, b'tail')\n'ok'", timeout=60)
    assert run.error is None, run.error
    assert run.text == "'ok'"
    assert len(run.stdout) == 64 * 65536 and run.stderr.endswith("tail")


def test_a_file_size_limit_set_by_user_code_does_not_stop_the_drain(
        make: Callable[..., Sandbox]) -> None:
    """The memory files are files: past an RLIMIT_FSIZE the cell set, the rest is dropped,
    and the pipes are still drained (a drain that stopped would block the writer)."""
    sb = make()
    run = sb.run_code("import os, resource\n"
                      "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
                      "for _ in range(64): os.write(1, b'q' * 65536)\n"
                      "'ok'", timeout=60)
    assert run.error is None, run.error
    assert run.text == "'ok'"
    assert sb.run_code("2 + 2").text == "4"


REUSE_PIPE_NUMBER = (
    "import os\n"
    "def ino(fd):\n"
    "    try:\n"
    "        return os.fstat(fd).st_ino\n"
    "    except OSError:\n"
    "        return None\n"
    "r = [fd for fd in range(3, 1024) if ino(fd) == os.fstat(1).st_ino][0]  # its read end\n"
    "f = os.open('/etc/hostname', os.O_RDONLY)\n"
    "os.dup2(f, r)  # the pipe's number is a file of the cell's now\n"
    "os.close(f)\n"
    "try:\n"
    "    os.write(1, b'after')\n"
    "except BrokenPipeError:\n"
    "    pass  # no reader left, unless the drain was inside a read of the pipe just then\n"
)


def test_a_pipe_number_user_code_took_over_is_left_alone(make: Callable[..., Sandbox]) -> None:
    """The cell closes the read end of its own stdout pipe and opens a file on that
    number: the drain neither reads the file into the output nor closes it. (Whether
    the cell's next write to fd 1 finds a reader is the kernel's: the pipe has none
    left, unless the drain was inside a read of it at that moment.)"""
    sb = make()
    hostname = sb.run_code("open('/etc/hostname').read()").text
    run = sb.run_code(REUSE_PIPE_NUMBER, timeout=30)
    assert run.error is None, run.error
    assert hostname.strip("'\\n") not in run.stdout
    later = sb.run_code("os.pread(r, 100, 0).decode()")
    assert later.error is None, later.error  # still open: not closed as a finished pipe
    assert later.text == hostname
