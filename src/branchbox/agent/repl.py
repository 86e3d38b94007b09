"""The persistent Python REPL behind ``run_code``.

One namespace lives as long as the process (and is inherited by fork
children: that is the point of forking a REPL). A cell runs like a Jupyter
cell: its statements, then the value of a trailing expression, whose repr and
rich representations come back in the result.

Output: during a call ``sys.stdout``/``sys.stderr`` are writers that send what
user code writes as events, line by line. Output written to fds 1 and 2
directly (os.write, subprocesses, C code) is captured up to the output limit
(see ``capture``) and sent when the call ends. The two kinds of output are
therefore not interleaved in time.

Contexts: besides the main namespace, named ones (E2B's code contexts) each hold
their own variables and, optionally, a working directory that is current while
their cells run. They are namespaces of this one interpreter, not processes:
they cost nothing to create, are inherited by fork children with the rest of
the REPL, and share imported modules (as threads of one program would).

Interrupts: SIGINT (sent by the daemon) and SIGALRM (the call's timeout) raise
KeyboardInterrupt in user code, except while a frame is being written: then it
is raised once the frame is complete, because half a frame would wreck the
channel for good. Between calls SIGINT does nothing (see main).
"""

from __future__ import annotations
import __future__

import _thread
import ast
import base64
import builtins
import codecs
import contextlib
import errno
import io
import json
import linecache
import os
import signal
import sys
import time
import traceback
import types
import warnings
from typing import Any

from . import protocol
from .capture import FdCapture
from .forking import take_warning as take_fork_warning
from .server import Agent, OutputLimit, RequestError, output_limit, param, timeout_param

MAX_REPR = 1024 * 1024
"""Characters of a trailing expression's repr kept in the result (JSON-escaped, a few MiB)."""

_FLUSH_SIZE = 64 * 1024  # buffered characters that make a writer send without a newline
# Characters per stdout/stderr event: as JSON (6 bytes for a \uXXXX escape) still within
# the header the daemon takes (protocol.MAX_AGENT_HEADER), so output never needs blobs.
_PIECE = 128 * 1024
# JSON bytes of rich results and figures one answer carries: their strings go ahead of
# the answer's header as blobs, at most protocol.MAX_SPILLED bytes of them.
MAX_RESULTS = 32 * 1024 * 1024
# JSON bytes of rich results that are not strings (application/json): those stay in the
# header, which the daemon takes up to protocol.MAX_AGENT_HEADER (and a quarter of its
# protocol.MAX_AGENT_TOKENS values).
MAX_STRUCTURED = 512 * 1024
_READ_SIZE = 64 * 1024
_RICH = (
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
)
# An object that has this attribute answers every name (a mock, a proxy): its _repr_*_
# "methods" mean nothing. IPython guards the same way.
_CANARY = "_branchbox_canary_method_should_not_exist_"
# The `from __future__` imports that still change anything, kept in force across cells.
_FUTURE_FLAGS = __future__.annotations.compiler_flag | __future__.barry_as_FLUFL.compiler_flag

class _Call:
    """One run_code request in progress."""

    def __init__(self, rid: int, limit: OutputLimit) -> None:
        self.rid = rid
        self.limit = limit
        self.pid = os.getpid()
        self.thread = _thread.get_ident()

    def owns(self) -> bool:
        """Whether this process and thread may send the call's events.

        A process forked by user code, or a thread it started, must never write
        to the control socket: its frames would interleave with ours.
        """
        return os.getpid() == self.pid and _thread.get_ident() == self.thread


def _write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _Writer(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` during a call.

    The same two objects serve every call, so a logging handler created in one
    call still writes into whichever call is running. Anything written outside
    a call, or by a forked process or another thread, goes to the file
    descriptor (captured by the call, if one is running).
    """

    encoding = "utf-8"
    errors = "strict"

    def __init__(self, repl: Repl, name: str, fd: int) -> None:
        super().__init__()
        self._repl = repl
        self._name = name
        self._fd = fd
        self._parts: list[str] = []
        self._size = 0
        self.buffer = _Bytes(self)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        """The real descriptor: ``subprocess.run(..., stdout=sys.stdout)`` is captured too."""
        return self._fd

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        call = self._repl.call
        if call is None or not call.owns():
            _write_fd(self._fd, s.encode("utf-8", "backslashreplace"))
            return len(s)
        self._parts.append(s)
        self._size += len(s)
        if "\n" in s or "\r" in s or self._size >= _FLUSH_SIZE:
            self.flush()
        return len(s)

    def flush(self) -> None:
        call = self._repl.call
        if not self._parts or call is None or not call.owns():
            return
        text = "".join(self._parts)
        self._parts.clear()
        self._size = 0
        self._repl.emit(self._name, text)

    def close(self) -> None:
        """Only flush: user code closing sys.stdout must not silence every later call."""
        self.flush()


class _Bytes(io.BufferedIOBase):
    """``sys.stdout.buffer`` (and stderr's): bytes written become the call's output as
    UTF-8 text, what is not UTF-8 as U+FFFD, a character split between two writes kept
    whole. Code that writes bytes there (a CLI library, a binary-safe print) failed with
    AttributeError."""

    def __init__(self, text: _Writer) -> None:
        super().__init__()
        self._text = text
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._text.fileno()

    def write(self, data: Any) -> int:
        data = bytes(data)
        self._text.write(self._decoder.decode(data))
        return len(data)

    def flush(self) -> None:
        self._text.flush()

    def close(self) -> None:
        """Only flush, as the text writer does."""
        self.flush()


class _NoCapture:
    """A call's capture when the REPL is out of fds: nothing captured, nothing to undo."""

    files: list[int] = []
    dropped = 0

    def restore(self) -> None:
        pass

    def close(self) -> None:
        pass


def _capture(agent: Agent, keep: int) -> tuple[FdCapture | _NoCapture, str]:
    """The call's fd capture, and a warning if there can be none. Out of open files (user
    code holds the REPL's limit), the call still runs with Python's own output: it may
    be what closes them; only what goes to fds 1 and 2 directly is not captured."""
    try:
        return FdCapture(agent, keep), ""
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        return _NoCapture(), ("out of open files: what this call wrote to fds 1 and 2 "
                              "directly (C code, subprocesses) was not captured")


def _stdin() -> io.TextIOWrapper:
    """A ``sys.stdin`` whose close() (exit() and quit() call it) leaves fd 0 open: a freed
    fd 0 would be handed to the next file opened, and commands would read from that."""
    return open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - it is sys.stdin


def _fresh_namespace() -> dict[str, Any]:
    return {"__name__": "__main__", "__builtins__": builtins}


class _Context:
    """A named namespace of the REPL (see the module docstring). Plain classes here, as in
    ``forking``: no ``dataclasses`` import at every REPL start."""

    def __init__(self, cwd: str | None) -> None:
        self.cwd = cwd
        self.namespace: dict[str, Any] = _fresh_namespace()


class _Outcome:
    def __init__(self) -> None:
        self.text: str | None = None
        self.results: dict[str, Any] = {}
        self.figures: list[dict[str, str]] = []
        self.error: dict[str, str] | None = None
        self.timed_out = False
        self.left_out = ""  # what _fit dropped, said in the answer's warnings


class Repl:
    """The ``run_code`` op and the namespace it runs in."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        # User code *is* __main__, so pickle finds the functions and classes it defines.
        sys.modules["__main__"] = main
        self.namespace = main.__dict__
        self.contexts: dict[str, _Context] = {}
        self.call: _Call | None = None
        self.stdout = _Writer(self, "stdout", 1)
        self.stderr = _Writer(self, "stderr", 2)
        self._count = 0
        self._flags = 0  # future imports of earlier cells stay in force, as in a REPL
        self._timed_out = False
        self._deferred = False
        sys.stdin = _stdin()
        # There is no display: pyplot.show() can only warn, and the figures come back anyway.
        warnings.filterwarnings("ignore", message="FigureCanvasAgg is non-interactive")

    def handle_run_code(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``run_code`` {code, timeout?, max_output?, context?, env?}: stdout/stderr events,
        then done. With ``context``, the cell runs in that named context; ``env`` is set in
        ``os.environ`` while it runs (and put back after)."""
        rid = req["rid"]
        code = param(req, "code", str)
        timeout = timeout_param(req)
        context = self._context(param(req, "context", str, None))
        env = param(req, "env", dict, {})
        if not all(isinstance(k, str) and k and "=" not in k and "\0" not in k
                   and isinstance(v, str) and "\0" not in v for k, v in env.items()):
            raise RequestError("InvalidRequest", "env must map variable names to strings")
        saved_env = {name: os.environ.get(name) for name in env}
        call = _Call(rid, output_limit(req))
        started = time.monotonic()
        if sys.stdin is None or sys.stdin.closed:
            sys.stdin = _stdin()  # exit() closed it
        saved = sys.stdout, sys.stderr
        capture, uncaptured = _capture(agent, call.limit.remaining)
        sys.stdout, sys.stderr = self.stdout, self.stderr
        self.call = call
        home = os.getcwd() if context and context.cwd else None
        try:
            if home is not None:
                os.chdir(context.cwd)
            os.environ.update(env)
            outcome = self._run(code, timeout, context.namespace if context else self.namespace)
            if os.getpid() != call.pid:
                # User code forked and did not exit: this child must never reach the loop.
                os._exit(0 if outcome.error is None else 1)
            self.stdout.flush()
            self.stderr.flush()
            capture.restore()
            self._send_captured(capture)
        finally:
            capture.close()
            sys.stdout, sys.stderr = saved
            self.call = None
            for name, value in saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            if home is not None:
                with contextlib.suppress(OSError):  # the cell removed it: stay
                    os.chdir(home)
        if call.limit.truncated:
            self._send(rid, "stderr", call.limit.marker())
        agent.done(
            rid,
            {
                "text": outcome.text,
                "results": outcome.results,
                "figures": outcome.figures,
                "error": outcome.error,
                "truncated": call.limit.truncated,
                "timed_out": outcome.timed_out,
                "duration": time.monotonic() - started,
                "warnings": [w for w in (take_fork_warning(), outcome.left_out, uncaptured)
                             if w],
            },
        )

    def handle_context(self, agent: Agent, req: dict, payload: bytes, fds: list[int]) -> None:
        """``context`` {action: create|reset|remove|list, id?, cwd?}: named contexts."""
        action = param(req, "action", str)
        if action == "list":
            agent.done(req["rid"], {"contexts": [
                {"id": name, "cwd": ctx.cwd} for name, ctx in self.contexts.items()]})
            return
        name = param(req, "id", str)
        if action == "create":
            cwd = param(req, "cwd", str, None)
            if cwd is not None and not os.path.isdir(cwd):
                raise RequestError("InvalidRequest", f"cwd does not exist: {cwd}")
            if name in self.contexts:
                raise RequestError("Conflict", f"context {name!r} exists already")
            self.contexts[name] = _Context(cwd)
        elif action == "reset":
            self._context(name).namespace = _fresh_namespace()
        elif action == "remove":
            self._context(name)
            del self.contexts[name]
        else:
            raise RequestError("InvalidRequest", f"unknown context action {action!r}")
        agent.done(req["rid"], {"id": name})

    def _context(self, name: str | None) -> _Context | None:
        if name is None:
            return None
        context = self.contexts.get(name)
        if context is None:
            raise RequestError("NotFound", f"no context {name!r} in this sandbox")
        return context

    # -- output -----------------------------------------------------------------------------

    def emit(self, name: str, text: str) -> None:
        """Send user output of the running call, within its output limit."""
        assert self.call is not None
        data = text.encode("utf-8", "replace")
        kept = self.call.limit.take(data)
        self._send(self.call.rid, name, kept.decode("utf-8", "ignore"))
        if self._deferred:  # an interrupt came in while the frame was being written
            self._deferred = False
            raise KeyboardInterrupt

    def _send(self, rid: int, name: str, text: str) -> None:
        for start in range(0, len(text), _PIECE):
            self.agent.event(rid, name, data=text[start : start + _PIECE])

    def _send_captured(self, capture: FdCapture | _NoCapture) -> None:
        assert self.call is not None
        self.call.limit.dropped += capture.dropped  # cut by the capture already
        if not capture.files:  # out of fds: nothing was captured
            return
        for name, mem in zip(("stdout", "stderr"), capture.files, strict=True):
            keep = self.call.limit.reserve(os.fstat(mem).st_size)
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            offset = 0
            while offset < keep:
                data = os.pread(mem, min(_READ_SIZE, keep - offset), offset)
                if not data:
                    break
                offset += len(data)
                self._send(self.call.rid, name, decoder.decode(data))
            self._send(self.call.rid, name, decoder.decode(b"", final=True))

    # -- running a cell ---------------------------------------------------------------------

    def _run(self, code: str, timeout: float | None, namespace: dict[str, Any]) -> _Outcome:
        self._count += 1
        filename = f"<cell-{self._count}>"
        # Tracebacks show the cell's lines, also later, from functions the cell defined.
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        outcome = _Outcome()
        try:
            body, last = self._compile(code, filename)
        except Exception as exc:  # SyntaxError; ValueError for a NUL byte
            outcome.error = _error(exc, None)
            return outcome
        failure: BaseException | None = None
        previous = self._arm()
        try:
            try:
                # Armed in here, not in _arm: a timer shorter than the way from setitimer
                # into this try would raise its KeyboardInterrupt outside it (a 500).
                if timeout is not None:
                    signal.setitimer(signal.ITIMER_REAL, timeout)
                exec(body, namespace)
                if last is not None:
                    value = eval(last, namespace)
                    if value is not None:
                        namespace["_"] = value
                        outcome.text, outcome.results = self._display(value)
            except BaseException as exc:  # SystemExit and KeyboardInterrupt are results too
                failure = exc
            try:
                outcome.figures = _figures()
            except BaseException as exc:
                failure = failure or exc
        finally:
            self._disarm(previous)
        outcome.timed_out = self._timed_out
        if failure is not None:
            outcome.error = _error(failure, failure.__traceback__)
        if outcome.figures:
            outcome.results.setdefault("image/png", outcome.figures[0]["image/png"])
        outcome.left_out = _fit(outcome)
        return outcome

    def _compile(self, code: str, filename: str) -> tuple[types.CodeType, types.CodeType | None]:
        """The cell's statements, and its trailing expression if it ends with one."""
        tree = ast.parse(code, filename, "exec")
        last = None
        # dont_inherit: this module's own `from __future__ import annotations` is not the user's.
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            expression = ast.Expression(tree.body[-1].value)
            del tree.body[-1]
            last = compile(expression, filename, "eval", self._flags, dont_inherit=True)
        body = compile(tree, filename, "exec", self._flags, dont_inherit=True)
        self._flags |= body.co_flags & _FUTURE_FLAGS
        return body, last

    def _arm(self) -> tuple[Any, Any]:
        self._timed_out = False
        self._deferred = False
        return (
            signal.signal(signal.SIGINT, self._interrupt),
            signal.signal(signal.SIGALRM, self._interrupt),
        )

    def _disarm(self, previous: tuple[Any, Any]) -> None:
        while True:
            # A signal landing in here raises KeyboardInterrupt: go again until the timer is
            # off and the handlers are back, after which nothing can raise.
            with contextlib.suppress(KeyboardInterrupt):
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGINT, previous[0])
                signal.signal(signal.SIGALRM, previous[1])
                self._deferred = False
                return

    def _interrupt(self, signum: int, frame: types.FrameType | None) -> None:
        if signum == signal.SIGALRM:
            self._timed_out = True
        if self.agent.sending:
            self._deferred = True  # raised by emit() once the frame is out
            return
        raise KeyboardInterrupt

    def _display(self, value: Any) -> tuple[str, dict[str, Any]]:
        """repr and rich representations (mime type → data) of a cell's value."""
        text = repr(value)
        if len(text) > MAX_REPR:
            text = text[:MAX_REPR] + "\n[branchbox: repr truncated]"
        results: dict[str, Any] = {"text/plain": text}
        # A class's _repr_*_ are unbound functions, not representations of the class.
        if isinstance(value, type) or hasattr(value, _CANARY):
            return text, results
        for method, mime in _RICH:
            data = _encode(mime, self._call_repr(value, method))
            if data is not None:
                results[mime] = data
        bundle = self._call_repr(value, "_repr_mimebundle_", include=None, exclude=None)
        if isinstance(bundle, dict):
            for mime, raw in bundle.items():
                data = _encode(mime, raw)
                if data is not None:
                    results.setdefault(mime, data)
        return text, results

    def _call_repr(self, value: Any, method: str, **kwargs: Any) -> Any:
        func = getattr(value, method, None)
        if not callable(func):
            return None
        try:
            data = func(**kwargs)
        except Exception as exc:
            # One broken representation must not cost the others, nor go unmentioned.
            self.emit("stderr", f"[branchbox: {type(value).__name__}.{method}() failed: {exc!r}]\n")
            return None
        return data[0] if isinstance(data, tuple) else data  # (data, metadata)


def _encode(mime: str, data: Any) -> Any:
    """``data`` as JSON can carry it: bytes as base64, or None if it cannot be carried."""
    if isinstance(data, bytes):
        return base64.b64encode(data).decode("ascii")
    if isinstance(data, str):
        return data
    if data is not None and (mime == "application/json" or mime.endswith("+json")):
        try:
            json.dumps(data)
        except (TypeError, ValueError):
            return None
        return data
    return None


def _figures() -> list[dict[str, str]]:
    """Open matplotlib figures as base64 PNG, then closed (Jupyter's inline backend does so).

    Only if user code imported pyplot: the agent never imports matplotlib.
    """
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return []
    figures = []
    try:
        for num in pyplot.get_fignums():
            buffer = io.BytesIO()
            pyplot.figure(num).savefig(buffer, format="png", bbox_inches="tight")
            figures.append({"image/png": base64.b64encode(buffer.getvalue()).decode("ascii")})
    finally:
        pyplot.close("all")  # a figure that cannot be drawn must not fail every later call
    return figures


def _fit(outcome: _Outcome) -> str:
    """Make the answer one frame can carry: an error's value cut to :data:`MAX_REPR`
    characters and its traceback to its last ones (a 200 MB message in an exception
    made a frame the daemon refused, which cost the REPL), and rich results and figures
    kept in order while they fit :data:`MAX_RESULTS`. What was left out, said."""
    if outcome.error is not None:
        value, trace = outcome.error["value"], outcome.error["traceback"]
        if len(value) > MAX_REPR:
            outcome.error["value"] = value[:MAX_REPR] + "\n[branchbox: message truncated]"
        if len(trace) > MAX_REPR:
            outcome.error["traceback"] = ("[branchbox: traceback truncated]\n"
                                          + trace[-MAX_REPR:])
    room, structured, values = MAX_RESULTS, MAX_STRUCTURED, protocol.MAX_AGENT_TOKENS // 4
    dropped = []
    for mime, data in list(outcome.results.items()):
        size = _json_size(data)
        cost = 0 if isinstance(data, str) else protocol.tokens(json.dumps(data).encode())
        if size > room or not isinstance(data, str) and (size > structured or cost > values):
            del outcome.results[mime]
            dropped.append(f"{mime} ({size / 2**20:.1f} MiB)")
        else:
            room -= size
            structured -= 0 if isinstance(data, str) else size
            values -= cost
    kept = []
    for figure in outcome.figures:
        size = sum(map(_json_size, figure.values()))
        if size <= room:
            kept.append(figure)
            room -= size
    if len(kept) < len(outcome.figures):
        dropped.append(f"{len(outcome.figures) - len(kept)} figure(s)")
        outcome.figures = kept
    if not dropped:
        return ""
    return (f"left out of the answer, past its {MAX_RESULTS >> 20} MiB of results (of which "
            f"{MAX_STRUCTURED >> 10} KiB and {protocol.MAX_AGENT_TOKENS // 4} values of JSON "
            "other than text): " + ", ".join(dropped))


def _json_size(data: Any) -> int:
    """About what ``data`` adds to the answer's JSON: a string's length (results are
    mostly ASCII; the frame limit past MAX_RESULTS catches the rest), else encoded."""
    return len(data) if isinstance(data, str) else len(json.dumps(data))


def _error(exc: BaseException, tb: types.TracebackType | None) -> dict[str, str]:
    """The result's ``error``: name, value and the traceback without this module's frames
    (the exec at the start; the interrupt handler or an output writer at the end)."""
    report = traceback.TracebackException(type(exc), exc, tb)
    report.stack = traceback.StackSummary.from_list(
        [frame for frame in report.stack if frame.filename != _OWN_FILE]
    )
    try:
        value = str(exc)
    except Exception:
        value = f"<unprintable {type(exc).__name__}>"
    return {"name": type(exc).__name__, "value": value, "traceback": "".join(report.format())}


_OWN_FILE = _error.__code__.co_filename
