"""Shell commands: ``exec`` (foreground or background) and ``wait``, ``kill``, ``ps``,
``follow``, ``input``, ``close_stdin``.

A command never blocks the loop: its pipes and a pidfd are watched by the
agent's selector, so the agent keeps answering (files, other commands, fork)
while commands run. A foreground command streams its output as events and
ends its request with done (or fail "Timeout"); a background command answers
``{"pid"}`` at once and keeps its output (bounded) until a ``wait`` collects it.

A command is finished when its process exits, not when its pipes reach EOF:
``server &`` leaves a grandchild holding the pipes, and waiting for EOF would
hang the request for as long as that grandchild lives. Whatever is in the
pipes at exit is read; later writes by grandchildren are not collected.

Each command leads its own session and process group (``start_new_session``),
so a timeout or ``kill`` reaches everything it started, and a ^C aimed at the
REPL never reaches it.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import fcntl
import json
import os
import shlex
import signal
import struct
import termios
import time
from collections.abc import Callable
from functools import partial
from typing import IO, Protocol

from . import protocol
from .plain_command import without_shell
from .server import Agent, OutputLimit, RequestError, Timer, output_limit, param, timeout_param
from .spawner import spawn

_READ_SIZE = 64 * 1024
# After exit, read at most this much more from a pipe. What the process itself wrote fits in
# the pipe (at most fs.pipe-max-size, 1 MiB by default); anything beyond comes from a
# grandchild that is still writing, and draining that could go on forever.
_DRAIN_LIMIT = 1024 * 1024 + _READ_SIZE
# Only without a pidfd (a kernel before 5.3): how often to look for the exit.
_POLL_INTERVAL = 0.05
# A wait result carries stdout and stderr, sent ahead of its header as blobs (at most
# protocol.MAX_SPILLED bytes); cut to their JSON's size below that, which is cautious.
_RESULT_BUDGET = protocol.MAX_SPILLED - 1024 * 1024
_NOT_FOUND = b"command not found"
# What starting a command through the command namespace's init (spawner) fails with once
# that init is gone: nothing can be started in its namespace any more.
_INIT_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ECONNREFUSED, errno.ENOTCONN)
_MAX_ARGS = 1024  # arguments of a command a ps answer lists


class Process(Protocol):
    """What a command's process offers: a ``Popen``, or a ``spawner.Spawned``."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None
    returncode: int | None

    def poll(self) -> int | None: ...


class _Stream:
    """One output pipe (stdout or stderr) of a command."""

    def __init__(self, name: str, pipe: IO[bytes]) -> None:
        self.name = name
        self.pipe = pipe  # unbuffered and non-blocking: read() gives None when empty
        self.open = True
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.kept = bytearray()  # a background command's output, up to its limit


class Command:
    """One process started by ``exec``, from spawn until its result is delivered."""

    def __init__(
        self,
        table: Commands,
        proc: Process,
        argv: list[str],
        *,
        shell: bool,
        rid: int | None,
        limit: OutputLimit,
        timeout: float | None,
        stdin: int | None = None,
    ) -> None:
        self.table = table
        self.agent = table.agent
        self.proc = proc
        self.pid = proc.pid
        self.argv = argv  # as asked: a command line is bash's (["/bin/bash", "-c", line])
        self.display = argv[2] if shell else shlex.join(argv)
        self.shell = shell
        self.rid = rid  # the exec request a foreground command answers; None in background
        self.limit = limit
        self.timeout = timeout
        self.started = time.monotonic()
        self.duration = 0.0
        self.exit_code: int | None = None
        self.timed_out = False
        self.waiters: list[tuple[int, Timer | None]] = []
        # follow requests, answered at exit, each with its own decoders (stdout, stderr)
        self.followers: dict[int, dict[str, codecs.IncrementalDecoder]] = {}
        self.stdin = stdin  # the write end of its stdin pipe, if it was started with one
        if stdin is not None:
            os.set_blocking(stdin, False)  # a command that does not read must not stall us
        self._saw_not_found = False
        self._err_tail = b""
        # A PTY command has one stream, its terminal's master end, read as stdout.
        self.terminal = proc.stderr is None
        self.streams = [_Stream(name, pipe) for name, pipe in (
            ("stdout", proc.stdout), ("stderr", proc.stderr)) if pipe is not None]
        for stream in self.streams:
            os.set_blocking(stream.pipe.fileno(), False)
            self.agent.watch(stream.pipe, partial(self._on_readable, stream))
        self._timer = self.agent.call_later(timeout, self._on_timeout) if timeout else None
        # A command started through bb-init comes with a pidfd (pidfd_open is refused in
        # sandboxes); a Popen (the agent run bare, in its tests) opens one.
        self._pidfd: int | None = getattr(proc, "pidfd", None)
        if self._pidfd is None:
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(self.pid)
        if self._pidfd is None:
            self.agent.call_later(_POLL_INTERVAL, self._poll)
        else:
            self.agent.watch(self._pidfd, self._poll)

    @property
    def command_not_found(self) -> bool:
        """bash's own verdict: exit status 127 after saying "command not found"."""
        return self.shell and self.exit_code == 127 and self._saw_not_found

    def signal(self, signo: int) -> None:
        """Send ``signo`` to the command's whole process group."""
        with contextlib.suppress(ProcessLookupError):  # the group is already gone
            os.killpg(self.pid, signo)

    def _on_timeout(self) -> None:
        # The request is answered once the process is reaped (promptly, after SIGKILL).
        self.timed_out = True
        self.signal(signal.SIGKILL)

    def _on_readable(self, stream: _Stream) -> None:
        data = _read(stream)
        if data is None:
            return
        if data:
            self._output(stream, data)
        else:
            self._close(stream)

    def _output(self, stream: _Stream, data: bytes) -> None:
        if self.shell and stream.name == "stderr":
            window = self._err_tail + data  # the phrase may straddle two reads
            self._saw_not_found = self._saw_not_found or _NOT_FOUND in window
            self._err_tail = window[-len(_NOT_FOUND) :]
        was_truncated = self.limit.truncated
        kept = self.limit.take(data)
        if self.rid is None:
            stream.kept += kept
            for rid in self.followers:
                self.send_followed(rid, stream.name, kept)
                if self.limit.truncated and not was_truncated:
                    self._say_cut(rid)
            return
        text = stream.decoder.decode(kept)
        if text:
            self.agent.event(self.rid, stream.name, data=text)

    def _close(self, stream: _Stream) -> None:
        self.agent.unwatch(stream.pipe)
        stream.pipe.close()
        stream.open = False

    def _poll(self) -> None:
        if self.proc.poll() is not None:
            self._finish()
        elif self._pidfd is None:
            self.agent.call_later(_POLL_INTERVAL, self._poll)

    def _finish(self) -> None:
        for stream in self.streams:
            if stream.open:
                self._drain(stream)
                self._close(stream)
        if self._pidfd is not None:
            self.agent.unwatch(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._timer is not None:
            self._timer.cancel()
        self.close_stdin()
        code = self.proc.returncode
        assert code is not None
        self.exit_code = 128 - code if code < 0 else code
        self.duration = time.monotonic() - self.started
        if self.rid is None:
            self.table.finished(self)
        else:
            self._answer(self.rid)

    def follow(self, rid: int) -> None:
        """Send ``rid`` what the command kept so far, then its output as it comes."""
        self.followers[rid] = {
            s.name: codecs.getincrementaldecoder("utf-8")(errors="replace") for s in self.streams}
        for stream in self.streams:
            for start in range(0, len(stream.kept), _READ_SIZE):
                self.send_followed(rid, stream.name, stream.kept[start:start + _READ_SIZE])
        if self.limit.truncated:
            self._say_cut(rid)

    def _say_cut(self, rid: int) -> None:
        """Tell a follower, once, that the command's output goes past what is kept: a
        command that writes for ever (``yes``) went silent on its followers at its limit,
        with no word of why, until it ended."""
        self.agent.event(rid, "stderr", data=f"\n[branchbox: output past its first "
                         f"{self.limit.size} bytes is dropped from here on; the command "
                         "still runs]\n")

    def send_followed(self, rid: int, name: str, data: bytes | bytearray) -> None:
        text = self.followers[rid][name].decode(data)
        if text:
            self.agent.event(rid, name, data=text)

    def end_followers(self) -> None:
        """Answer every follower with the command's exit."""
        end = {"exit_code": self.exit_code, "timed_out": self.timed_out, "following": True}
        for rid, decoders in self.followers.items():
            for name, decoder in decoders.items():
                if tail := decoder.decode(b"", final=True):
                    self.agent.event(rid, name, data=tail)
            self.agent.done(rid, end)
        self.followers.clear()

    def write_stdin(self, data: bytes) -> None:
        """Write all of ``data`` to the command's stdin now, or fail: the agent cannot wait
        for a command that does not read."""
        if self.stdin is None:
            raise RequestError("InvalidRequest", f"command {self.pid} has no open stdin "
                               "(start it with stdin, and before closing it)")
        try:
            written = os.write(self.stdin, data) if data else 0
        except BrokenPipeError:
            raise RequestError("InvalidRequest", f"command {self.pid} closed its stdin") from None
        except BlockingIOError:
            written = 0
        if written < len(data):
            raise RequestError("Conflict", f"stdin of command {self.pid} is full: it took "
                               f"{written} of {len(data)} bytes (is it reading?)")

    def close_stdin(self) -> None:
        if self.stdin is not None:
            os.close(self.stdin)
            self.stdin = None

    def _drain(self, stream: _Stream) -> None:
        left = _DRAIN_LIMIT
        while left > 0:
            data = _read(stream)
            if not data:  # None: empty for now; b"": EOF
                return
            left -= len(data)
            self._output(stream, data)

    def _answer(self, rid: int) -> None:
        """End a foreground command's request."""
        for stream in self.streams:
            tail = stream.decoder.decode(b"", final=True)
            if tail:
                self.agent.event(rid, stream.name, data=tail)
        if self.limit.truncated:
            self.agent.event(rid, "stderr", data=self.limit.marker())
        self.table.foreground.discard(self)
        if self.timed_out:
            self.agent.fail(rid, "Timeout", f"command timed out after {self.timeout:g} seconds")
            return
        self.agent.done(
            rid,
            {
                "exit_code": self.exit_code,
                "truncated": self.limit.truncated,
                "duration": self.duration,
                "command_not_found": self.command_not_found,
            },
        )

    def result(self) -> dict:
        """A finished background command's ``wait`` result (computed once, then delivered)."""
        kept = {stream.name: stream.kept for stream in self.streams}
        stdout, stderr = _fit(kept["stdout"], kept.get("stderr", b""), self.limit)
        if self.limit.truncated:
            stderr += self.limit.marker()
        return {
            "exit_code": self.exit_code,
            "stdout": stdout,
            "stderr": stderr,
            "truncated": self.limit.truncated,
            "timed_out": self.timed_out,
            "duration": self.duration,
            "command_not_found": self.command_not_found,
        }

    def forget(self) -> None:
        """In a forked child: close this process's copies of the command's descriptors."""
        for stream in self.streams:
            if stream.open:
                stream.pipe.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
        self.close_stdin()
        # Not our child here. Without a returncode, Popen.__del__ would waitpid() the pid, and
        # once the parent has reaped it that number may belong to one of *our* children.
        self.proc.returncode = -signal.SIGKILL


def _read(stream: _Stream) -> bytes | None:
    """Up to _READ_SIZE bytes; None if none are there yet, b"" at the end (a terminal's
    master end says EIO once no process has the terminal open)."""
    try:
        return stream.pipe.read(_READ_SIZE)
    except OSError as exc:
        if exc.errno == errno.EIO:
            return b""
        raise


def _fit(
    stdout: bytes | bytearray, stderr: bytes | bytearray, limit: OutputLimit
) -> tuple[str, str]:
    """Decode both outputs, cutting their ends (counted as dropped) until they fit a frame."""
    while True:
        texts = (stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"))
        size = sum(len(json.dumps(text)) for text in texts)
        if size <= _RESULT_BUDGET:
            return texts
        scale = _RESULT_BUDGET / size
        cut_out, cut_err = stdout[: int(len(stdout) * scale)], stderr[: int(len(stderr) * scale)]
        limit.dropped += len(stdout) - len(cut_out) + len(stderr) - len(cut_err)
        stdout, stderr = cut_out, cut_err


def _spawn(req: dict, spawner: Callable[[], int] | None
           ) -> tuple[Process, int | None, list[str], bool]:
    """Start the command of an exec request; returns (process, where its input is written
    if the request asked for stdin or a pty, argv as asked (a command line: bash's), via
    bash?)."""
    cmd = req.get("cmd")
    if isinstance(cmd, str) and cmd:
        argv, shell = ["/bin/bash", "-c", cmd], True
    elif isinstance(cmd, list) and cmd and all(isinstance(arg, str) for arg in cmd):
        argv, shell = cmd, False
    else:
        raise RequestError(
            "InvalidRequest", "field 'cmd' must be a non-empty string or list of strings"
        )
    cwd = param(req, "cwd", str, None)
    if cwd is not None and not os.path.isdir(cwd):
        raise RequestError("InvalidRequest", f"cwd does not exist: {cwd}")
    env = param(req, "env", dict, {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise RequestError("InvalidRequest", "field 'env' must map strings to strings")
    env = {**os.environ, **env}
    size, stdin = _terminal_size(req), param(req, "stdin", bool, False)
    plain = without_shell(cmd, env, cwd) if shell else None
    try:
        if plain is not None:  # what bash would have exec'd, without bash
            try:
                return _start(spawner, plain[1], cwd, plain[2], size, stdin,
                              executable=plain[0]) + (argv, shell)
            except OSError:  # not exec'd as it is: bash runs the line, or says why
                pass
        return _start(spawner, argv, cwd, env, size, stdin) + (argv, shell)
    except ValueError as exc:  # NUL in an argument, "=" in a variable name
        raise RequestError("InvalidRequest", str(exc)) from exc
    except OSError as exc:
        if cwd is not None and exc.filename == cwd:  # removed since the check above
            raise RequestError("InvalidRequest", f"cwd does not exist: {cwd}") from exc
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise RequestError("CommandNotFound", f"command not found: {argv[0]}") from exc
        if exc.errno in (errno.EACCES, errno.ENOEXEC, errno.E2BIG):
            raise RequestError("InvalidRequest", f"cannot run {argv[0]}: {exc.strerror}") from exc
        if exc.errno in _INIT_GONE:
            raise RequestError(
                "CommandsGone", "commands cannot start: the init of the sandbox's command "
                "namespace is gone (killed from inside the sandbox, e.g. by kill -9 -1)"
            ) from exc
        raise


def _start(spawner: Callable[[], int] | None, argv: list[str], cwd: str | None, env: dict,
           size: tuple[int, int] | None, stdin: bool, executable: str | None = None
           ) -> tuple[Process, int | None]:
    """Start ``argv`` (the file ``executable``, else ``argv[0]`` on ``env``'s PATH), on a
    terminal of ``size`` or on pipes; returns (process, where its input is written, if
    it has a terminal or was asked for ``stdin``). Raises as Popen does."""
    if size is not None:
        return _spawn_terminal(spawner, argv, cwd, env, size, executable)
    stdin_r, stdin_w = os.pipe() if stdin else (None, None)
    sock = spawner() if spawner else -1
    try:
        if sock >= 0:
            proc: Process = spawn(sock, argv, cwd, env, stdin_r, executable=executable)
        else:  # the agent run bare, outside a sandbox (not imported in one: subprocess
            # brings threading, whose after-fork hook every fork child would run)
            import subprocess

            proc = subprocess.Popen(
                argv,
                executable=executable,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL if stdin_r is None else stdin_r,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                bufsize=0,
                start_new_session=True,
            )
    except BaseException:
        if stdin_w is not None:
            os.close(stdin_w)
        raise
    finally:
        if stdin_r is not None:
            os.close(stdin_r)
    return proc, stdin_w


def _terminal_size(req: dict) -> tuple[int, int] | None:
    """(rows, cols) of the ``pty`` an exec asks for, or None."""
    pty = param(req, "pty", dict, None)
    if pty is None:
        return None
    rows, cols = param(pty, "rows", int, 24), param(pty, "cols", int, 80)
    if not (1 <= rows <= 10_000 and 1 <= cols <= 10_000):
        raise RequestError("InvalidRequest", "pty rows and cols must be between 1 and 10000")
    return rows, cols


def set_terminal_size(fd: int, size: tuple[int, int]) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", size[0], size[1], 0, 0))


def _spawn_terminal(spawner: Callable[[], int] | None, argv: list[str], cwd: str | None,
                    env: dict, size: tuple[int, int],
                    executable: str | None = None) -> tuple[Process, int]:
    """Start a command on a new terminal of ``size``: (process reading as stdout from the
    terminal's master end, a descriptor of the master end to write its input to)."""
    sock = spawner() if spawner else -1
    if sock < 0:
        raise RequestError("InvalidRequest", "a pty needs a sandbox (the agent runs bare)")
    master, slave = os.openpty()
    try:
        set_terminal_size(master, size)
        proc = spawn(sock, argv, cwd, env, tty=slave, executable=executable)
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    proc.stdout = os.fdopen(master, "rb", buffering=0)
    return proc, os.dup(master)


class Commands:
    """This process's commands, and the handlers of exec, wait, kill and ps."""

    def __init__(self, agent: Agent, spawner: Callable[[], int] | None = None) -> None:
        """``spawner()`` gives the socket of the sandbox's spawner (see ``spawner.py``), or
        -1 outside a sandbox, where commands are started with Popen."""
        self.agent = agent
        self.spawner = spawner
        self.background: dict[int, Command] = {}  # until a wait has collected the result
        self.foreground: set[Command] = set()
        agent.at_fork(self._forget)

    def handle_exec(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``exec`` {cmd, cwd?, env?, timeout?, background?, max_output?}."""
        rid = req["rid"]
        background = param(req, "background", bool, False)
        timeout = timeout_param(req)
        limit = output_limit(req)
        proc, stdin, argv, shell = _spawn(req, self.spawner)
        command = Command(
            self,
            proc,
            argv,
            shell=shell,
            rid=None if background else rid,
            limit=limit,
            timeout=timeout,
            stdin=stdin,
        )
        if background:
            self.background[command.pid] = command
            agent.done(rid, {"pid": command.pid})
        else:
            self.foreground.add(command)

    def handle_wait(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``wait`` {pid, timeout?}: answered from the loop when the command exits."""
        rid = req["rid"]
        command = self._find(req)
        timeout = timeout_param(req)
        if command.exit_code is not None:
            del self.background[command.pid]
            agent.done(rid, command.result())
            return
        timer = None
        if timeout is not None:
            timer = agent.call_later(timeout, partial(self._wait_expired, command, rid, timeout))
        command.waiters.append((rid, timer))

    def _wait_expired(self, command: Command, rid: int, timeout: float) -> None:
        command.waiters = [w for w in command.waiters if w[0] != rid]
        message = f"command {command.pid} still running after {timeout:g} seconds"
        self.agent.fail(rid, "Timeout", message)

    def finished(self, command: Command) -> None:
        """A background command exited: answer its followers and its waiters, if any."""
        if command.followers:
            self._end_followers(command)
        if not command.waiters:
            return
        result = command.result()
        self.background.pop(command.pid, None)
        for rid, timer in command.waiters:
            if timer is not None:
                timer.cancel()
            self.agent.done(rid, result)
        command.waiters.clear()

    def handle_kill(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``kill`` {pid, signal?=9}: signal a background command's process group."""
        command = self._find(req)
        signo = param(req, "signal", int, signal.SIGKILL)
        if signo not in signal.valid_signals():
            raise RequestError("InvalidRequest", f"invalid signal {signo}")
        # Once reaped, its group id may be reused by an unrelated group: leave it alone.
        if command.exit_code is None:
            command.signal(signo)
        agent.done(req["rid"], {})

    def handle_cancel(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``cancel`` {target}: the daemon's caller of foreground exec ``target`` went away;
        kill the command's process group (its request still ends, unread). A ``follow``
        request ``target`` just ends; its command runs on."""
        target = param(req, "target", int)
        for command in self.foreground:
            if command.rid == target and command.exit_code is None:
                command.signal(signal.SIGKILL)
        for command in self.background.values():
            if command.followers.pop(target, None) is not None:
                agent.done(target, {"exit_code": None, "following": False})
        agent.done(req["rid"], {})

    def handle_follow(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``follow`` {pid}: a background command's output as stdout/stderr events (raw
        bytes; what it kept so far first), then done with its exit when it exits. A
        command whose end a follower received is gone from the table (nobody waits)."""
        command = self._find(req)
        command.follow(req["rid"])
        if command.exit_code is not None:
            self._end_followers(command)

    def _end_followers(self, command: Command) -> None:
        command.end_followers()
        if not command.waiters:
            self.background.pop(command.pid, None)

    def handle_input(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``input`` {pid} + payload: bytes for a background command's stdin."""
        self._find(req).write_stdin(payload)
        agent.done(req["rid"], {})

    def handle_resize(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``resize`` {pid, pty: {rows, cols}}: a PTY command's terminal size."""
        command = self._find(req)
        size = _terminal_size(req)
        if not command.terminal or command.stdin is None or size is None:
            raise RequestError("InvalidRequest", f"command {command.pid} has no open pty")
        set_terminal_size(command.stdin, size)
        agent.done(req["rid"], {})

    def handle_close_stdin(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``close_stdin`` {pid}: end of input for a background command."""
        self._find(req).close_stdin()
        agent.done(req["rid"], {})

    def handle_ps(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``ps``: the background commands not yet collected by a wait, in the order they
        started, as many as one answer carries (half of ``protocol.MAX_AGENT_TOKENS``
        values: short strings cannot go as blobs): the running ones first, then the
        latest finished; ``omitted`` says how many were left out. An argv is listed up to
        its first :data:`_MAX_ARGS` arguments."""
        started = list(self.background.values())
        ranked = [c for c in started if c.exit_code is None] + \
            [c for c in reversed(started) if c.exit_code is not None]
        room, entries = protocol.MAX_AGENT_TOKENS // 2, {}
        for c in ranked:
            entry = {"pid": c.pid, "cmd": c.display, "argv": c.argv[:_MAX_ARGS],
                     "running": c.exit_code is None, "exit_code": c.exit_code,
                     "stdin": c.stdin is not None, "pty": c.terminal}
            room -= protocol.tokens(json.dumps(entry).encode())
            if room < 0:
                break
            entries[c.pid] = entry
        answer: dict = {"commands": [entries[c.pid] for c in started if c.pid in entries]}
        if len(entries) < len(started):
            answer["omitted"] = len(started) - len(entries)
        agent.done(req["rid"], answer)

    def _find(self, req: dict) -> Command:
        pid = param(req, "pid", int)
        command = self.background.get(pid)
        if command is None:
            raise RequestError("NotFound", f"no background command with pid {pid}")
        return command

    def _forget(self) -> None:
        for command in [*self.background.values(), *self.foreground]:
            command.forget()
        self.background.clear()
        self.foreground.clear()
