"""The in-sandbox agent, run as a real process and driven over a socketpair.

No namespaces are needed: the agent is started as ``python -m branchbox.agent
<fd>`` (or, where a test needs extra ops, by a small script that builds the
same agent) and spoken to with the control protocol. Where a test needs
"while the call is still running", it holds the call on a FIFO instead of
sleeping, so no test depends on timing.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import branchbox
from branchbox.agent import files, protocol
from branchbox.engine import listing

SRC = str(Path(branchbox.__file__).resolve().parents[1])
RECV_TIMEOUT = 20.0

# An agent with the package's ops plus two test ops: "fork" does what the real fork handler
# does to the request loop (fork, reset_after_fork onto a socket received with the request)
# without any namespace work; "boom" fails the way a buggy handler would.
SCRIPT_AGENT = """
import os, socket, sys
from branchbox.agent.main import register_ops
from branchbox.agent.server import Agent

def handle_fork(agent, req, payload, fds):
    pid = os.fork()
    if pid == 0:
        agent.reset_after_fork(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=fds[0]))
        agent.done(0, {"pid": os.getpid()})
        return
    os.close(fds[0])
    agent.done(req["rid"], {"pid": pid})

def handle_boom(agent, req, payload, fds):
    raise RuntimeError("handler bug")

agent = Agent(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=int(sys.argv[1])))
register_ops(agent)
agent.register("fork", handle_fork)
agent.register("boom", handle_boom)
agent.serve()
"""


class Channel:
    """The daemon's side of one agent's control socket."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(RECV_TIMEOUT)
        self.sock = sock
        self._rid = 0
        self.backlog: dict[int, list[tuple[dict, bytes]]] = {}
        self.blobs: dict[int, list[bytes]] = {}  # by rid: blob events for its next header
        self.headers: list[bytes] = []  # every header received, as sent

    def send(self, op: str, payload: bytes = b"", fds: list[int] = (), **fields: object) -> int:
        self._rid += 1
        protocol.send(self.sock, {"op": op, "rid": self._rid, **fields}, payload, fds)
        return self._rid

    def send_more(self, rid: int, op: str, payload: bytes, **fields: object) -> None:
        """Another frame of request ``rid`` (a write sends its file in several)."""
        protocol.send(self.sock, {"op": op, "rid": rid, **fields}, payload)

    def next(self, rid: int) -> tuple[dict, bytes]:
        """The next frame of request ``rid`` (frames of other requests are kept for later)."""
        while not self.backlog.get(rid):
            header, payload, _fds = protocol.recv(self.sock)
            self.headers.append(protocol.encode(header)[8:])
            if header["ev"] == "blob":  # as the daemon's channel: held for the header
                self.blobs.setdefault(header["rid"], []).append(payload)
                continue
            header = protocol.unspill(header, b"".join(self.blobs.pop(header["rid"], [])))
            self.backlog.setdefault(header["rid"], []).append((header, payload))
        return self.backlog[rid].pop(0)

    def collect(self, rid: int) -> tuple[list[tuple[dict, bytes]], dict]:
        """All events of ``rid`` and its final event."""
        events = []
        while True:
            header, payload = self.next(rid)
            if header["ev"] in ("done", "fail"):
                return events, header
            events.append((header, payload))

    def call(self, op: str, payload: bytes = b"", **fields: object) -> dict:
        _events, final = self.collect(self.send(op, payload, **fields))
        assert final["ev"] == "done", final
        return final["result"]

    def error(self, op: str, **fields: object) -> dict:
        _events, final = self.collect(self.send(op, **fields))
        assert final["ev"] == "fail", final
        return final["error"]

    def run(self, code: str, **fields: object) -> tuple[str, str, dict]:
        """run_code: (stdout, stderr, result)."""
        events, final = self.collect(self.send("run_code", code=code, **fields))
        assert final["ev"] == "done", final
        return _text(events, "stdout"), _text(events, "stderr"), final["result"]

    def exec(self, **fields: object) -> tuple[str, str, dict]:
        """A foreground exec: (stdout, stderr, final event)."""
        events, final = self.collect(self.send("exec", **fields))
        return _text(events, "stdout"), _text(events, "stderr"), final


def _text(events: list[tuple[dict, bytes]], kind: str) -> str:
    return "".join(header["data"] for header, _ in events if header["ev"] == kind)


class AgentProcess(Channel):
    def __init__(self, argv: list[str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "PYTHONPATH": SRC}
        self.proc = subprocess.Popen(
            [sys.executable, *argv, str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env
        )
        theirs.close()
        super().__init__(ours)

    def close(self) -> None:
        self.sock.close()
        try:
            assert self.proc.wait(RECV_TIMEOUT) == 0  # the agent ends when its channel closes
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def agent() -> Iterator[AgentProcess]:
    process = AgentProcess(["-m", "branchbox.agent"])
    yield process
    process.close()


@pytest.fixture
def script_agent() -> Iterator[AgentProcess]:
    process = AgentProcess(["-c", SCRIPT_AGENT])
    yield process
    process.close()


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    """A FIFO a call blocks on until the test writes to it."""
    path = tmp_path / "gate"
    os.mkfifo(path)
    return path


def _release(fifo: Path) -> None:
    with open(fifo, "w") as gate:
        gate.write("x")


# ---------------------------------------------------------------------------------- request loop


def test_ping_answers_with_the_agent_pid_and_protocol_version(agent: AgentProcess) -> None:
    assert agent.call("ping") == {"pid": agent.proc.pid, "protocol": protocol.VERSION}


def test_unknown_op_is_an_invalid_request(agent: AgentProcess) -> None:
    assert agent.error("no_such_op")["type"] == "InvalidRequest"
    assert agent.call("ping")["pid"] == agent.proc.pid


def test_handler_exception_fails_the_request_and_the_agent_serves_on(
    script_agent: AgentProcess,
) -> None:
    error = script_agent.error("boom")
    assert error["type"] == "Internal"
    assert "RuntimeError: handler bug" in error["message"]
    assert script_agent.call("ping")["pid"] == script_agent.proc.pid


def test_bad_fields_are_invalid_requests(agent: AgentProcess) -> None:
    assert agent.error("run_code")["type"] == "InvalidRequest"  # no code
    assert agent.error("run_code", code="1", timeout=0)["type"] == "InvalidRequest"
    assert agent.error("exec", cmd=["ls", 3])["type"] == "InvalidRequest"
    assert agent.error("exec", cmd="true", max_output=-1)["type"] == "InvalidRequest"
    assert agent.error("wait", pid=True)["type"] == "InvalidRequest"


# ----------------------------------------------------------------------------------- run_code


def test_globals_persist_and_the_last_expression_is_the_text(agent: AgentProcess) -> None:
    _out, _err, result = agent.run("x = 41")
    assert result["text"] is None and result["error"] is None and result["results"] == {}
    _out, _err, result = agent.run("y = x + 1\ny")
    assert result["text"] == "42"
    assert result["results"]["text/plain"] == "42"
    assert agent.run("_ * 2")[2]["text"] == "84"  # `_` is the previous value
    assert agent.run("None")[2]["text"] is None
    assert agent.run("__name__")[2]["text"] == "'__main__'"
    assert result["duration"] >= 0 and result["truncated"] is False
    assert result["timed_out"] is False


def test_user_code_does_not_inherit_the_agents_future_imports(agent: AgentProcess) -> None:
    _out, _err, result = agent.run("def f(a: int): pass\nf.__annotations__['a']")
    assert result["text"] == "<class 'int'>"


def test_stdout_is_streamed_before_the_call_ends(agent: AgentProcess, fifo: Path) -> None:
    rid = agent.send("run_code", code=f"print('ready')\nopen({str(fifo)!r}).read()\nprint('end')")
    header, _ = agent.next(rid)  # would time out if output waited for the end of the call
    assert (header["ev"], header["data"]) == ("stdout", "ready\n")
    _release(fifo)
    events, final = agent.collect(rid)
    assert _text(events, "stdout") == "end\n"
    assert final["ev"] == "done"


def test_output_written_to_fds_1_and_2_is_captured(agent: AgentProcess) -> None:
    out, err, result = agent.run(
        "import os, subprocess, sys\n"
        "os.write(1, b'raw out\\n')\n"
        "os.write(2, b'raw err\\n')\n"
        "subprocess.run(['echo', 'from a child'])\n"
        "subprocess.run(['echo', 'via fileno'], stdout=sys.stdout)\n"
        "print('python err', file=sys.stderr)"
    )
    assert result["error"] is None
    assert out == "raw out\nfrom a child\nvia fileno\n"
    assert err == "python err\nraw err\n"
    # Between calls fd 1 is the agent's own stdout again: the next call captures nothing old.
    assert agent.run("print('next')")[0] == "next\n"


def test_rich_representations_of_the_value(agent: AgentProcess) -> None:
    code = (
        "class Pic:\n"
        "    def _repr_png_(self): return b'\\x89PNG fake'\n"
        "    def _repr_html_(self): return '<b>pic</b>'\n"
        "    def _repr_json_(self): return {'a': [1, 2]}\n"
        "    def _repr_markdown_(self): raise ValueError('no markdown')\n"
        "    def __repr__(self): return 'Pic()'\n"
        "Pic()"
    )
    _out, err, result = agent.run(code)
    results = result["results"]
    assert base64.b64decode(results["image/png"]) == b"\x89PNG fake"
    assert results["text/html"] == "<b>pic</b>"
    assert results["application/json"] == {"a": [1, 2]}
    assert results["text/plain"] == result["text"] == "Pic()"
    assert "text/markdown" not in results and "_repr_markdown_() failed" in err
    assert set(agent.run("Pic")[2]["results"]) == {"text/plain"}  # the class itself


def test_matplotlib_figures_come_back_as_png(agent: AgentProcess) -> None:
    out, err, result = agent.run(
        "import matplotlib\n"
        "matplotlib.use('Agg')\n"
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3]); plt.figure(); plt.plot([3, 2, 1]); plt.show()"
    )
    assert result["error"] is None, result["error"]
    assert "non-interactive" not in err  # pyplot.show() does not warn
    assert len(result["figures"]) == 2
    png = base64.b64decode(result["figures"][0]["image/png"])
    assert png.startswith(b"\x89PNG")
    assert result["results"]["image/png"] == result["figures"][0]["image/png"]
    assert agent.run("plt.get_fignums()")[2]["text"] == "[]"  # closed after the call


def test_an_exception_is_reported_without_agent_frames(agent: AgentProcess) -> None:
    _out, _err, result = agent.run("def f():\n    raise ValueError('bad input')\nf()")
    error = result["error"]
    assert error["name"] == "ValueError" and error["value"] == "bad input"
    assert "raise ValueError('bad input')" in error["traceback"]  # the cell's source lines
    assert ", in f" in error["traceback"]
    assert "branchbox" not in error["traceback"]
    assert result["text"] is None


def test_an_answer_too_large_for_one_frame_is_cut_and_the_repl_lives(
        agent: AgentProcess) -> None:
    """A cell's answer is one frame, and a frame past protocol.MAX_HEADER (64 MiB) ends
    the control channel: an exception with a 200 MB message, or an object whose HTML
    is 100 MB, cost the REPL and everything in it."""
    agent.run("kept = 42")
    _out, _err, result = agent.run("raise ValueError('x' * (200 << 20))")
    error = result["error"]
    assert error["name"] == "ValueError"
    assert error["value"].endswith("[branchbox: message truncated]")
    assert len(error["value"]) < 2 << 20 and len(error["traceback"]) < 2 << 20
    assert error["traceback"].startswith("[branchbox: traceback truncated]")
    _out, _err, result = agent.run(
        "class Page:\n    def _repr_html_(self):\n        return '<b>' * (40 << 20)\nPage()")
    assert "text/html" not in result["results"] and "text/plain" in result["results"]
    assert any("text/html" in warning for warning in result["warnings"]), result["warnings"]
    assert agent.run("print(kept)")[0] == "42\n"


def test_long_answers_go_ahead_as_blobs_and_come_back_whole(agent: AgentProcess) -> None:
    """The daemon decodes a sandbox's headers on its one event loop, so it takes them up
    to 1 MiB and 100,000 values: a long result (HTML of 3 MiB with text JSON escapes six
    times over, a lone surrogate, a text of 300,000 commas) goes ahead as blob events,
    and the answer comes back exactly as it was."""
    html = ("é<b>" * (750 << 10)) + "\udcff"
    code = ("class Page:\n"
            "    def _repr_html_(self): return " + repr(html) + "\n"
            "    def __repr__(self): return ',' * 300_000\n"
            "Page()")
    before = len(agent.headers)
    _out, _err, result = agent.run(code)
    assert result["results"]["text/html"] == html
    assert result["text"] == "," * 300_000
    sent = agent.headers[before:]
    assert any(b'"ev":"blob"' in h for h in sent)
    assert all(len(h) <= protocol.MAX_AGENT_HEADER
               and protocol.tokens(h) <= protocol.MAX_AGENT_TOKENS for h in sent)


def test_answers_of_many_short_values_stay_within_what_the_daemon_takes(
        agent: AgentProcess) -> None:
    """Short strings and numbers cannot go ahead as blobs: a JSON result of 150,000
    numbers, or a ps of commands with thousands of arguments, made the whole answer a
    PayloadTooLarge. The result is left out with a warning; ps lists an argv's first
    1,024 arguments, and as many commands as fit, saying how many it left out."""
    before = len(agent.headers)
    _out, _err, result = agent.run(
        "class Data:\n    def _repr_json_(self): return [0] * 150_000\nData()")
    assert "application/json" not in result["results"]
    assert any("application/json" in warning for warning in result["warnings"])
    for _ in range(60):
        agent.call("exec", cmd=["true", *["x"] * 3000], background=True)
    listed = agent.call("ps")
    assert all(len(c["argv"]) == 1024 for c in listed["commands"])
    assert listed["commands"] and listed["omitted"] == 60 - len(listed["commands"]) > 0
    assert all(len(h) <= protocol.MAX_AGENT_HEADER
               and protocol.tokens(h) <= protocol.MAX_AGENT_TOKENS
               for h in agent.headers[before:])


def test_any_answer_too_large_for_a_frame_is_a_typed_failure(tmp_path: Path) -> None:
    """An answer past the frame limit made the daemon close the channel, and the REPL
    was gone (seen: an object whose ``_repr_html_`` is 100 MB). Every answer too large
    is now a PayloadTooLarge failure and the agent goes on; a listing of any size comes
    in chunks (700,000 files were a 77 MB answer). Here a limit of 1 MiB and a directory
    of 20,000 files stand for the real ones."""
    wide = tmp_path / "wide"
    wide.mkdir()
    for i in range(20_000):
        (wide / f"f{i:07d}").touch()
    small = ("from branchbox.agent import protocol\nprotocol.MAX_SPILLED = 1 << 20\n"
             + SCRIPT_AGENT)
    process = AgentProcess(["-c", small])
    try:
        _events, final = process.collect(process.send(
            "run_code", code="class Big:\n    def _repr_html_(self): return 'x' * (2 << 20)\n"
                             "Big()"))
        assert final["ev"] == "fail" and final["error"]["type"] == "PayloadTooLarge", final
        assert "MiB" in final["error"]["message"]
        chunks, final = process.collect(process.send("list", path=str(wide)))
        assert final == {"rid": final["rid"], "ev": "done", "result": {"count": 20_000}}
        assert len(chunks) > 1 and all(len(p) <= files.LIST_CHUNK for _, p in chunks)
        names = [e["name"] for _, p in chunks for e in listing.entries(p)]
        assert names == [f"f{i:07d}" for i in range(20_000)]
    finally:
        process.close()


NO_THREAD_ONCE = """
import _thread
from branchbox.agent import capture
capture._drain_library = lambda: None  # the Python drain thread, which is what fails
_start, _failures = _thread.start_new_thread, [1]
def _start_once_failing(func, args):
    if _failures:
        _failures.pop()
        raise RuntimeError("can't start new thread")
    return _start(func, args)
_thread.start_new_thread = _start_once_failing
"""


def test_a_call_without_a_thread_for_its_output_is_a_resource_limit() -> None:
    """At the sandbox's process limit (1,021 background commands), run_code answered
    with the agent's traceback ("can't start new thread") and left fds 1 and 2 on pipes
    nobody read. Now a ResourceLimit, and the next call's output is captured."""
    process = AgentProcess(["-c", NO_THREAD_ONCE + SCRIPT_AGENT])
    try:
        _events, final = process.collect(process.send("run_code", code="print('lost')"))
        assert final["ev"] == "fail" and final["error"]["type"] == "ResourceLimit", final
        assert "process limit" in final["error"]["message"]
        out, err, result = process.run("import os\nprint('seen')\nos.write(1, b'raw\\n')")
        assert (out, result["error"]) == ("seen\nraw\n", None), (out, err, result)
    finally:
        process.close()


def test_a_repl_out_of_open_files_still_runs_the_code_that_closes_them(
        agent: AgentProcess) -> None:
    """User code that holds every fd its limit allows left the next call without the
    pipes of its output capture: an "Internal" traceback, and no way to run the code
    that would close them. Now the call runs with Python's own output and says what it
    could not capture."""
    agent.run("import os, resource\nresource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
              "held = []\ntry:\n    while True:\n        held.append(os.open(os.devnull, 0))\n"
              "except OSError:\n    pass")
    out, _err, result = agent.run("print(len(held) > 200)")
    assert (out, result["error"]) == ("True\n", None), result
    assert any("out of open files" in warning for warning in result["warnings"]), result
    agent.run("for fd in held:\n    os.close(fd)")
    out, _err, result = agent.run("os.write(1, b'raw\\n')")
    assert (out, result["warnings"]) == ("raw\n", []), (out, result)


def test_bytes_written_to_stdout_buffer_are_output(agent: AgentProcess) -> None:
    out, err, result = agent.run(
        "import sys\nsys.stdout.buffer.write(b'caf\\xc3')\n"
        "sys.stdout.buffer.write(b'\\xa9 \\xff\\n')\nsys.stderr.buffer.write(b'e\\n')\n"
        "sys.stdout.buffer.flush()")
    assert result["error"] is None, result["error"]
    assert (out, err) == ("caf\u00e9 \ufffd\n", "e\n")


def test_a_syntax_error_is_reported_and_nothing_runs(agent: AgentProcess) -> None:
    _out, _err, result = agent.run("z = 1\nx = (")
    assert result["error"]["name"] == "SyntaxError"
    assert "branchbox" not in result["error"]["traceback"]
    assert agent.run("'z' in globals()")[2]["text"] == "False"


def test_system_exit_is_an_error_not_the_end_of_the_agent(agent: AgentProcess) -> None:
    agent.run("kept = 'yes'")
    _out, _err, result = agent.run("import sys\nsys.exit(3)")
    assert result["error"]["name"] == "SystemExit" and result["error"]["value"] == "3"
    _out, _err, result = agent.run("exit()")
    assert result["error"]["name"] == "SystemExit"
    assert agent.run("kept")[2]["text"] == "'yes'"
    assert agent.run("input()")[2]["error"]["name"] == "EOFError"  # stdin is /dev/null


def test_timeout_interrupts_the_call_and_keeps_the_globals(agent: AgentProcess) -> None:
    agent.run("counter = 0")
    _out, _err, result = agent.run("while True:\n    counter += 1", timeout=0.2)
    assert result["timed_out"] is True
    assert result["error"]["name"] == "KeyboardInterrupt"
    assert int(agent.run("counter")[2]["text"]) > 0
    assert agent.run("1 + 1", timeout=5)[2]["timed_out"] is False


def test_timeout_while_printing_keeps_the_channel_intact(agent: AgentProcess) -> None:
    _out, _err, result = agent.run("while True:\n    print('x' * 100)", timeout=0.3)
    assert result["timed_out"] is True and result["error"]["name"] == "KeyboardInterrupt"
    assert agent.call("ping")["pid"] == agent.proc.pid


def test_sigint_interrupts_user_code_but_not_the_idle_agent(agent: AgentProcess) -> None:
    assert agent.call("ping")["pid"] == agent.proc.pid  # serving: its handler is in place
    os.kill(agent.proc.pid, signal.SIGINT)
    assert agent.call("ping")["pid"] == agent.proc.pid
    rid = agent.send("run_code", code="print('ready')\nimport time\ntime.sleep(60)")
    assert agent.next(rid)[0]["data"] == "ready\n"
    os.kill(agent.proc.pid, signal.SIGINT)
    _events, final = agent.collect(rid)
    assert final["result"]["error"]["name"] == "KeyboardInterrupt"
    assert final["result"]["timed_out"] is False


def test_output_beyond_max_output_is_dropped_and_counted(agent: AgentProcess) -> None:
    out, err, result = agent.run(
        "import os\nprint('a' * 30)\nos.write(1, b'b' * 50)\nprint('c' * 20)", max_output=10
    )
    assert out == "a" * 10
    dropped = 31 + 50 + 21 - 10
    assert err == f"\n[branchbox: output truncated, {dropped} bytes dropped]\n"
    assert result["truncated"] is True


def test_a_file_size_limit_of_user_code_does_not_stop_the_python_drain(
        agent: AgentProcess) -> None:
    """The agent run bare drains with its Python thread (no bb-drain.so beside it): past an
    RLIMIT_FSIZE the cell set, its memory files take no more and the rest is dropped,
    while the pipes are still drained (the writer would block otherwise)."""
    out, _err, result = agent.run(
        "import os, resource\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        "for _ in range(64): os.write(1, b'q' * 65536)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)\n"
        "'ok'", timeout=30)
    assert result["error"] is None and result["text"] == "'ok'"
    assert len(out) <= 4096


def test_a_pipe_number_user_code_took_over_is_left_alone_by_the_python_drain(
        agent: AgentProcess) -> None:
    """As tests/test_output_cap.py checks of the C thread: the cell puts a file of its own
    on its stdout pipe's read end; the drain neither reads nor closes it."""
    from test_output_cap import REUSE_PIPE_NUMBER

    out, _err, result = agent.run(REUSE_PIPE_NUMBER, timeout=30)
    assert result["error"] is None, result["error"]
    hostname = Path("/etc/hostname").read_text()
    assert hostname not in out
    _out, _err, later = agent.run("os.pread(r, 100, 0).decode()")
    assert later["error"] is None, later["error"]
    assert later["text"] == repr(hostname)


def test_a_forked_process_of_user_code_never_reaches_the_channel(agent: AgentProcess) -> None:
    out, _err, result = agent.run(
        "import os\npid = os.fork()\nprint('child' if pid == 0 else 'parent')\n"
        "if pid: os.waitpid(pid, 0)"
    )
    assert result["error"] is None
    # The child's print went to fd 1 (captured); the child exited instead of serving.
    assert sorted(out.splitlines()) == ["child", "parent"]
    assert agent.call("ping")["pid"] == agent.proc.pid


# ----------------------------------------------------------------------------------------- exec


def test_exec_streams_output_and_reports_the_exit_code(agent: AgentProcess) -> None:
    out, err, final = agent.exec(cmd="echo out; echo err >&2; exit 3")
    assert (out, err) == ("out\n", "err\n")
    result = final["result"]
    assert result["exit_code"] == 3
    assert result["truncated"] is False and result["command_not_found"] is False
    out, _err, final = agent.exec(cmd=["printf", "%s-%s", "a b", "c"])
    assert out == "a b-c" and final["result"]["exit_code"] == 0


def test_exec_decodes_a_character_split_across_reads(agent: AgentProcess) -> None:
    out, _err, _final = agent.exec(cmd="printf '\\303'; sleep 0.05; printf '\\251\\n'")
    assert out == "é\n"


def test_exec_reports_death_by_signal_as_128_plus_signo(agent: AgentProcess) -> None:
    assert agent.exec(cmd="kill -TERM $$")[2]["result"]["exit_code"] == 128 + signal.SIGTERM


def test_exec_cwd_and_env(agent: AgentProcess, tmp_path: Path) -> None:
    out, _err, _final = agent.exec(cmd="pwd; echo $BB_VAR", cwd=str(tmp_path), env={"BB_VAR": "v"})
    assert out == f"{tmp_path}\nv\n"
    agent.run("import os\nos.environ['FROM_REPL'] = 'r'")
    assert agent.exec(cmd="echo $FROM_REPL")[0] == "r\n"
    _out, _err, final = agent.exec(cmd="true", cwd=str(tmp_path / "missing"))
    assert final["error"]["type"] == "InvalidRequest"
    assert "cwd does not exist" in final["error"]["message"]


@pytest.mark.parametrize("env", [{}, {"SHLVL": "4", "PWD": "/"}, {"SHLVL": "x"}])
def test_a_plain_command_sees_what_bash_would_give_it(agent: AgentProcess, tmp_path: Path,
                                                       env: dict[str, str]) -> None:
    """``env`` runs without bash (agent.plain_command), ``'env'`` (quoted) through bash,
    which execs it in its place: the same environment, the same output."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    for cwd in (str(tmp_path), str(link)):
        plain, _err, final = agent.exec(cmd="env -0", cwd=cwd, env=env)
        assert final["result"]["exit_code"] == 0
        via_bash = agent.exec(cmd="'env' -0", cwd=cwd, env=env)[0]
        assert sorted(plain.split("\0")) == sorted(via_bash.split("\0"))
    _out, err, final = agent.exec(cmd="env -x")
    assert final["result"]["exit_code"] == 125 and "invalid option" in err


def test_a_plain_command_the_kernel_will_not_run_is_bashs(agent: AgentProcess,
                                                            tmp_path: Path) -> None:
    """The file found is exec'd as it is; when that fails, bash runs the line after all,
    so what comes out is what bash does: run a script without #! itself, or say why it
    cannot run the file (a missing interpreter), never a later file on PATH."""
    first, later = tmp_path / "first", tmp_path / "later"
    for where, text in ((first, "#!/nonexistent/interp\n"), (later, "#!/bin/sh\necho later\n")):
        where.mkdir()
        (where / "prog").write_text(text)
        (where / "prog").chmod(0o755)
    (first / "bare").write_text("echo ran by $0 in ${BASH_VERSION:+bash}\n")
    (first / "bare").chmod(0o755)
    env = {"PATH": f"{first}:{later}:/usr/bin:/bin"}
    for line in ("prog x", "bare y"):
        plain = agent.exec(cmd=line, env=env)
        quoted = agent.exec(cmd=f"'{line.split()[0]}' {line.split()[1]}", env=env)
        assert (plain[0], plain[1], plain[2]["result"]["exit_code"]) == \
            (quoted[0], quoted[1], quoted[2]["result"]["exit_code"])
    assert "later" not in agent.exec(cmd="prog", env=env)[0]
    assert agent.exec(cmd="bare", env=env)[0] == f"ran by {first / 'bare'} in bash\n"


def test_exec_command_not_found(agent: AgentProcess) -> None:
    _out, err, final = agent.exec(cmd="no-such-command-bb")
    assert final["result"]["exit_code"] == 127
    assert final["result"]["command_not_found"] is True and "command not found" in err
    assert agent.exec(cmd="exit 127")[2]["result"]["command_not_found"] is False
    _out, _err, final = agent.exec(cmd=["no-such-command-bb"])
    assert final["error"]["type"] == "CommandNotFound"


def test_exec_timeout_kills_the_process_group(agent: AgentProcess, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    _out, _err, final = agent.exec(cmd=f"sleep 60 & echo $! > {pidfile}; wait", timeout=0.5)
    assert final["ev"] == "fail" and final["error"]["type"] == "Timeout"
    grandchild = int(pidfile.read_text())
    for _ in range(200):  # SIGKILL is delivered asynchronously; wait for it to land
        if not _alive(grandchild):
            break
        time.sleep(0.01)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_exec_output_is_bounded(agent: AgentProcess) -> None:
    out, err, final = agent.exec(cmd="head -c 100000 /dev/zero | tr '\\0' a", max_output=1000)
    assert out == "a" * 1000
    assert "output truncated, 99000 bytes dropped" in err
    assert final["result"]["truncated"] is True


def test_the_agent_serves_other_requests_during_a_foreground_exec(
    agent: AgentProcess, fifo: Path
) -> None:
    rid = agent.send("exec", cmd=f"echo started; cat {fifo}")
    assert agent.next(rid)[0]["data"] == "started\n"
    assert agent.call("ping")["pid"] == agent.proc.pid
    assert agent.call("exists", path=str(fifo)) == {"exists": True}
    _release(fifo)
    events, final = agent.collect(rid)
    assert _text(events, "stdout") == "x" and final["result"]["exit_code"] == 0


def test_background_command_wait_and_ps(agent: AgentProcess, fifo: Path) -> None:
    pid = agent.call("exec", cmd=f"echo hi; cat {fifo} >/dev/null; echo bye >&2", background=True)[
        "pid"
    ]
    assert agent.call("ps")["commands"] == [
        {"pid": pid, "cmd": f"echo hi; cat {fifo} >/dev/null; echo bye >&2",
         "argv": ["/bin/bash", "-c", f"echo hi; cat {fifo} >/dev/null; echo bye >&2"],
         "running": True, "exit_code": None, "stdin": False, "pty": False}
    ]
    assert agent.error("wait", pid=pid, timeout=0.1)["type"] == "Timeout"
    rid = agent.send("wait", pid=pid)  # answered from the loop once the command exits
    assert agent.call("ping")["pid"] == agent.proc.pid
    _release(fifo)
    _events, final = agent.collect(rid)
    result = final["result"]
    assert (result["exit_code"], result["stdout"], result["stderr"]) == (0, "hi\n", "bye\n")
    assert result["truncated"] is False
    assert agent.call("ps")["commands"] == []  # collected
    assert agent.error("wait", pid=pid)["type"] == "NotFound"


def test_wait_on_a_command_that_already_exited(agent: AgentProcess) -> None:
    pid = agent.call("exec", cmd="echo done; exit 4", background=True)["pid"]
    while agent.call("ps")["commands"][0]["running"]:
        time.sleep(0.01)
    result = agent.call("wait", pid=pid)
    assert (result["exit_code"], result["stdout"]) == (4, "done\n")


def test_kill_a_background_command(agent: AgentProcess) -> None:
    pid = agent.call("exec", cmd="sleep 60", background=True)["pid"]
    assert agent.call("kill", pid=pid, signal=signal.SIGTERM) == {}
    assert agent.call("wait", pid=pid, timeout=10)["exit_code"] == 128 + signal.SIGTERM
    assert agent.error("kill", pid=pid)["type"] == "NotFound"
    pid = agent.call("exec", cmd="sleep 60", background=True)["pid"]
    agent.call("kill", pid=pid)
    assert agent.call("wait", pid=pid, timeout=10)["exit_code"] == 128 + signal.SIGKILL


def test_background_output_is_bounded(agent: AgentProcess) -> None:
    pid = agent.call("exec", cmd="seq 1 1000", background=True, max_output=20)["pid"]
    result = agent.call("wait", pid=pid, timeout=10)
    assert result["stdout"] == "".join(f"{i}\n" for i in range(1, 10)) + "10"
    assert result["truncated"] is True and "output truncated" in result["stderr"]


def test_a_follower_is_told_when_output_goes_past_the_limit(agent: AgentProcess) -> None:
    """E2B's Process.Start follows a background command: ``yes`` went silent at the
    output limit, with no word of why, and the command ran on. A follower is now told
    when it happens (and one that follows later, at once), while the command runs."""
    pid = agent.call("exec", cmd=["yes"], background=True, max_output=100_000)["pid"]
    followers = []
    for _ in range(2):  # following from the start, then after the limit
        followers.append(rid := agent.send("follow", pid=pid))
        seen = ""
        while "dropped from here on" not in seen:
            header, _ = agent.next(rid)
            assert header["ev"] in ("stdout", "stderr"), header
            seen += header["data"] if header["ev"] == "stderr" else ""
        assert "past its first 100000 bytes" in seen
        assert agent.call("ps")["commands"][0]["running"] is True
    agent.call("kill", pid=pid)
    for rid in followers:  # the end of the command ends each follow
        assert agent.collect(rid)[1]["result"]["exit_code"] == 128 + signal.SIGKILL


# ---------------------------------------------------------------------------------------- files


def test_write_in_frames_then_read_back_in_chunks(agent: AgentProcess, tmp_path: Path) -> None:
    data = os.urandom(3 * protocol.CHUNK + 12345)
    path = tmp_path / "new" / "dir" / "blob.bin"  # parents are created
    frames = [data[i : i + protocol.CHUNK] for i in range(0, len(data), protocol.CHUNK)]
    rid = agent.send("write", frames[0], path=str(path), more=True)
    for i, frame in enumerate(frames[1:], start=2):
        agent.send_more(rid, "write", frame, more=i < len(frames))
    events, final = agent.collect(rid)
    assert events == [] and final["result"] == {"size": len(data)}
    assert path.read_bytes() == data

    events, final = agent.collect(agent.send("read", path=str(path)))
    assert all(h["ev"] == "chunk" and len(p) <= protocol.CHUNK for h, p in events)
    assert b"".join(p for _h, p in events) == data
    assert final["result"] == {"size": len(data)}


def test_reading_a_socket_or_a_fifo_is_an_invalid_request(agent: AgentProcess,
                                                           tmp_path: Path) -> None:
    """A unix socket cannot be opened (ENXIO): that was an Internal failure carrying the
    agent's traceback; a FIFO is opened without waiting and refused."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "sock"))
    os.mkfifo(tmp_path / "fifo")
    try:
        for name in ("sock", "fifo"):
            error = agent.error("read", path=str(tmp_path / name))
            assert error["type"] == "InvalidRequest", error
            assert "Traceback" not in error["message"]
    finally:
        listener.close()


def test_a_write_replaces_the_file_only_when_complete(agent: AgentProcess, tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_text("old")
    rid = agent.send("write", b"new ", path=str(path), more=True)
    assert agent.call("read", path=str(path)) == {"size": 3}  # still the old file
    assert path.read_text() == "old"
    agent.send_more(rid, "write", b"content", more=False)
    assert agent.collect(rid)[1]["result"] == {"size": 11}
    assert path.read_text() == "new content"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]  # no temporary file left


def test_write_append_and_mode(agent: AgentProcess, tmp_path: Path) -> None:
    path = tmp_path / "log"
    agent.call("write", b"abc", path=str(path), mode=0o600)
    assert agent.call("write", b"def", path=str(path), append=True) == {"size": 6}
    assert path.read_bytes() == b"abcdef"
    assert agent.call("stat", path=str(path))["mode"] == 0o600  # kept from the old file


def test_a_write_past_a_file_size_limit_the_repl_set_is_a_typed_refusal(
        agent: AgentProcess, tmp_path: Path) -> None:
    """User code may lower the REPL's RLIMIT_FSIZE, which the agent's writes meet too:
    EFBIG came back as "Internal" with the agent's traceback."""
    agent.run("import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, (10, 10))")
    _events, final = agent.collect(agent.send("write", b"x" * 100, path=str(tmp_path / "f")))
    assert final["ev"] == "fail", final
    assert final["error"]["type"] == "InvalidRequest" and "too large" in final["error"]["message"]


def test_a_failed_upload_drops_its_remaining_frames(agent: AgentProcess, tmp_path: Path) -> None:
    rid = agent.send("write", b"x", path=str(tmp_path), more=True)
    agent.send_more(rid, "write", b"y", more=False)
    assert agent.next(rid)[0]["error"]["type"] == "IsADirectory"
    assert agent.call("ping")["pid"] == agent.proc.pid  # and no second answer for rid
    assert agent.backlog[rid] == []


def test_list_stat_exists_remove(agent: AgentProcess, tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("hello")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "inner").write_text("")
    (tmp_path / "c").symlink_to("missing")
    chunks, final = agent.collect(agent.send("list", path=str(tmp_path) + "/"))
    assert final["result"] == {"count": 3}
    entries = [e for _, payload in chunks for e in listing.entries(payload)]
    assert [(e["name"], e["type"]) for e in entries] == [
        ("a", "dir"),
        ("b.txt", "file"),
        ("c", "symlink"),
    ]
    b = entries[1]
    assert b["path"] == str(tmp_path / "b.txt") and b["size"] == 5 and b["mtime"] > 0
    assert agent.call("stat", path=str(tmp_path / "b.txt")) == b
    assert agent.call("exists", path=str(tmp_path / "c")) == {"exists": True}
    assert agent.call("exists", path=str(tmp_path / "nope")) == {"exists": False}
    assert agent.error("remove", path=str(tmp_path / "a"))["type"] == "InvalidRequest"
    assert agent.call("remove", path=str(tmp_path / "a"), recursive=True) == {}
    assert agent.call("remove", path=str(tmp_path / "b.txt")) == {}
    assert agent.error("remove", path=str(tmp_path / "b.txt"))["type"] == "NotFound"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_file_errors(agent: AgentProcess, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert agent.error("read", path=str(tmp_path))["type"] == "IsADirectory"
    assert agent.error("read", path=str(tmp_path / "missing"))["type"] == "NotFound"
    assert agent.error("read", path="/dev/zero")["type"] == "InvalidRequest"
    assert agent.error("list", path=str(tmp_path / "missing"))["type"] == "NotFound"
    assert agent.error("list", path=str(tmp_path / "file"))["type"] == "InvalidRequest"
    assert agent.error("stat", path=str(tmp_path / "missing"))["type"] == "NotFound"
    assert agent.error("write", path=str(tmp_path))["type"] == "IsADirectory"
    for bad in ("relative/path", f"{tmp_path}/../x", f"{tmp_path}/a\0b", ""):
        for op in ("read", "write", "list", "exists", "remove", "stat"):
            assert agent.error(op, path=bad)["type"] == "InvalidRequest", (op, bad)


# ----------------------------------------------------------------------------------------- fork


def test_fork_child_serves_its_own_socket_and_leaves_the_parent_intact(
    script_agent: AgentProcess, fifo: Path
) -> None:
    parent = script_agent
    parent.run("x = 1")
    bg = parent.call("exec", cmd=f"cat {fifo}; echo parent-bg", background=True)["pid"]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child_pid = parent.call("fork", fds=[theirs.fileno()])["pid"]
    theirs.close()
    child = Channel(ours)
    try:
        assert child.collect(0)[1]["result"] == {"pid": child_pid}
        assert child.call("ping")["pid"] == child_pid
        assert child.run("x")[2]["text"] == "1"  # the REPL's memory came along
        assert child.call("ps") == {"commands": []}  # the parent's commands did not
        assert child.error("wait", pid=bg)["type"] == "NotFound"
        child.run("x = 2")
        assert child.exec(cmd="echo child")[0] == "child\n"
    finally:
        ours.close()
    # The child dropped its copies without disturbing the parent's watches on them.
    assert parent.run("x")[2]["text"] == "1"
    rid = parent.send("wait", pid=bg, timeout=10)
    _release(fifo)
    assert parent.collect(rid)[1]["result"]["stdout"] == "xparent-bg\n"

