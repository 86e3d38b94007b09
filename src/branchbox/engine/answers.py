"""What a sandbox's agent answered to a request, checked against the shape of its op.

The agent runs in the sandbox, in the REPL's own process, so user code can answer any
request in its place (tests/test_security_agent_input.py shows how). Frames are bounded
by the channel (runtime.channel); here the *result* of a request is held to its op's
shape before anything reads it: an answer to ``exec`` whose pid was
``"../../<other sandbox>/pause?x="`` made the SDK pause another sandbox with the
user's key, a run whose ``error`` was a string made the replay log raise (a 500 for
the whole run), an ``exists`` without its key was a KeyError in the SDK. Each op's
result keeps only the keys it has, each of its type (finite numbers, non-negative
sizes); anything else ends the request with ``errors.MalformedAnswer``. Listings are
checked entry by entry where they stream (engine.listing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from branchbox.engine import errors

Check = Callable[[Any], bool]


def _int(v: Any) -> bool:
    return type(v) is int


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _pid(v: Any) -> bool:
    return type(v) is int and 0 < v < 1 << 31


def _number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _seconds(v: Any) -> bool:
    return _number(v) and v >= 0


def _str(v: Any) -> bool:
    return type(v) is str


def _bool(v: Any) -> bool:
    return type(v) is bool


def _maybe(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _list(check: Check) -> Check:
    return lambda v: type(v) is list and all(map(check, v))


def _shape(**fields: Check) -> Check:
    """A dict whose every listed key is there and passes its check (extra keys: dropped
    by :func:`checked` at the top; tolerated below it)."""
    return lambda v: type(v) is dict and all(k in v and c(v[k]) for k, c in fields.items())


def _json(v: Any) -> bool:
    """A JSON value without NaN or infinities (a rich result of ``application/json``),
    however deep (walked without recursion: its header was decoded, so it is bounded)."""
    todo = [v]
    while todo:
        x = todo.pop()
        if type(x) is list:
            todo += x
        elif type(x) is dict:
            if not all(type(k) is str for k in x):
                return False
            todo += x.values()
        elif not (x is None or type(x) in (bool, int, str)
                  or (type(x) is float and math.isfinite(x))):
            return False
    return True


def _bundle(v: Any) -> bool:
    """Rich representations of a value, mime type -> data: text (base64 for a picture),
    or a JSON value for a JSON type."""
    return type(v) is dict and all(
        type(k) is str and (_json(x) if k == "application/json" or k.endswith("+json")
                            else type(x) is str)
        for k, x in v.items())


# A file's entry: what stat, move and mkdir answer, and each entry of a listing.
ENTRY = dict(name=_str, path=_str, type=lambda v: v in ("file", "dir", "symlink", "other"),
             size=_count, mode=_count, mtime=_number)
_ERROR = _shape(name=_str, value=_str, traceback=_str)
_COMMAND = dict(pid=_pid, cmd=_str, argv=_list(_str), running=_bool, exit_code=_maybe(_int),
                stdin=_bool, pty=_bool)

# op -> its result's keys and their checks; "optional" keys may be left out.
_RESULTS: dict[str, dict[str, Check]] = {
    "run_code": dict(text=_maybe(_str), results=_bundle,
                     figures=_list(lambda f: _bundle(f) and _str(f.get("image/png"))),
                     error=_maybe(_ERROR), truncated=_bool, timed_out=_bool,
                     duration=_seconds, warnings=_list(_str)),
    "exec": dict(exit_code=_maybe(_int), truncated=_bool, duration=_seconds,
                 command_not_found=_bool),
    "wait": dict(exit_code=_maybe(_int), stdout=_str, stderr=_str, truncated=_bool,
                 timed_out=_bool, duration=_seconds, command_not_found=_bool),
    "follow": dict(exit_code=_maybe(_int), following=_bool),
    "ps": dict(commands=_list(_shape(**_COMMAND))),
    "read": dict(size=_count),
    "write": dict(size=_count),
    "list": dict(count=_count),
    "exists": dict(exists=_bool),
    "stat": ENTRY,
    "move": ENTRY,
    "mkdir": dict(created=_bool, **ENTRY),
    "watch": dict(id=_str),
    "watch_events": dict(events=lambda v: type(v) is list),  # each checked where it is read
}
_OPTIONAL: dict[str, dict[str, Check]] = {
    "follow": dict(timed_out=_bool),
    "ps": dict(omitted=_count),
    "watch_events": dict(lost=_count),
}
# Ops whose answer carries nothing: whatever came is dropped.
_EMPTY = frozenset({"remove", "kill", "cancel", "unwatch", "input", "close_stdin", "resize"})


def checked(op: str, result: Any) -> dict:
    """``result`` (a ``done`` answer to ``op``) reduced to its op's keys, each checked;
    raises errors.MalformedAnswer if one is missing or not of its type. Ops not listed here
    (the engine's own, answered before user code runs or checked where they are used)
    pass as they came, a dict."""
    if op in _EMPTY:
        return {}
    if op == "exec" and type(result) is dict and "pid" in result:  # started in the background
        fields, optional = {"pid": _pid}, {}
    elif op == "context":
        fields = ({"contexts": _list(_shape(id=_str, cwd=_maybe(_str)))}
                  if type(result) is dict and "contexts" in result else {"id": _str})
        optional = {}
    elif op in _RESULTS:
        fields, optional = _RESULTS[op], _OPTIONAL.get(op, {})
    else:
        return result if type(result) is dict else {}
    if type(result) is not dict:
        raise errors.MalformedAnswer(f"the sandbox's agent answered {op!r} with a "
                                     f"{type(result).__name__}, not an object")
    kept = {}
    for key, check in fields.items():
        if key not in result or not check(result[key]):
            raise _malformed(op, key, result)
        kept[key] = result[key]
    for key, check in optional.items():
        if key in result:
            if not check(result[key]):
                raise _malformed(op, key, result)
            kept[key] = result[key]
    return kept


def _malformed(op: str, key: str, result: dict) -> errors.MalformedAnswer:
    found = "nothing" if key not in result else type(result[key]).__name__
    return errors.MalformedAnswer(f"the sandbox's agent answered {op!r} with a malformed "
                                  f"{key!r} ({found}); the sandbox's code may have replaced "
                                  "its agent")


def pid_in(answer: object, what: str) -> int:
    """The process id in an answer of the engine's own (a ping, a fork's hello, a
    checkpoint's): a positive int, else MalformedAnswer naming ``what``."""
    pid = answer.get("pid") if type(answer) is dict else None
    if not _pid(pid):
        raise errors.MalformedAnswer(f"the sandbox's agent answered {what} with a pid of "
                                     f"{type(pid).__name__}, not a process id")
    return pid
