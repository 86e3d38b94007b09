"""Image specs: the Dockerfile subset ``branchbox image build`` reads.

``FROM`` (a built image's name or a Debian suite), then any of ``RUN``, ``ENV``,
``WORKDIR``, ``COPY``. Comments (``#``), blank lines and ``\\`` line continuations
as in a Dockerfile; instructions are case-insensitive. ``RUN`` takes a shell line
(run by ``/bin/sh -c``) or an exec form (a JSON list); ``ENV`` takes ``KEY=VALUE``
pairs (quoted values allowed) or ``KEY VALUE``; ``COPY`` takes sources relative to
the build context (globs allowed) and a destination, absolute or relative to the
``WORKDIR``; ENV, WORKDIR and COPY expand ``$NAME`` / ``${NAME}`` from earlier ENVs.
Anything else is a SpecError naming the line, before anything runs.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass

KINDS = ("FROM", "RUN", "ENV", "WORKDIR", "COPY")
MAX_SPEC = 256 << 10  # bytes of spec text
MAX_STEPS = 200
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SpecError(ValueError):
    """The spec cannot be built as written; the message names the line and what is wrong."""


@dataclass(frozen=True)
class Step:
    """One instruction: ``kind``, its parsed ``args`` and ``text`` (normalized, for the cache
    key: the same instruction written with other spacing hits the same cached layer)."""

    kind: str
    args: tuple[str, ...]
    text: str
    line: int


@dataclass(frozen=True)
class Spec:
    base: str  # FROM's argument
    steps: tuple[Step, ...]


def parse(text: str) -> Spec:
    """The spec in ``text``; raises SpecError."""
    if len(text.encode()) > MAX_SPEC:
        raise SpecError(f"the spec is larger than {MAX_SPEC} bytes")
    if "\0" in text:
        raise SpecError("the spec contains a NUL byte")
    steps = [_step(kind, rest, line) for kind, rest, line in _instructions(text)]
    if not steps or steps[0].kind != "FROM":
        raise SpecError("a spec starts with FROM (an image name or a Debian suite)")
    if any(s.kind == "FROM" for s in steps[1:]):
        raise SpecError(f"line {next(s.line for s in steps[1:] if s.kind == 'FROM')}: "
                        "only one FROM (multi-stage builds are not supported)")
    if len(steps) > MAX_STEPS + 1:
        raise SpecError(f"more than {MAX_STEPS} steps")
    return Spec(steps[0].args[0], tuple(steps[1:]))


def _instructions(text: str) -> list[tuple[str, str, int]]:
    """(KIND, rest of the instruction, first line number), continuations joined."""
    found: list[tuple[str, str, int]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction, as Docker allows
        if not pending:
            start = number
        if raw.rstrip().endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        pending.append(raw)
        joined = " ".join(part.strip() for part in pending).strip()
        pending = []
        kind, _, rest = joined.partition(" ")
        found.append((kind.upper(), rest.strip(), start))
    if pending:
        raise SpecError(f"line {start}: the last instruction ends with a '\\' continuation")
    return found


def _step(kind: str, rest: str, line: int) -> Step:
    where = f"line {line}: {kind}"
    if kind not in KINDS:
        raise SpecError(f"line {line}: {kind!r} is not supported (only {', '.join(KINDS)})")
    if not rest:
        raise SpecError(f"{where} needs an argument")
    if kind == "FROM":
        if len(rest.split()) != 1:
            raise SpecError(f"{where} takes one image name or Debian suite")
        return Step(kind, (rest,), f"FROM {rest}", line)
    if kind == "RUN":
        if rest.startswith("["):
            argv = _json_list(rest, where)
            return Step(kind, tuple(argv), "RUN " + json.dumps(argv), line)
        return Step(kind, ("/bin/sh", "-c", rest), f"RUN {rest}", line)
    if kind == "ENV":
        pairs = _env(rest, where)
        return Step(kind, tuple(f"{k}={v}" for k, v in pairs),
                    "ENV " + " ".join(shlex.quote(f"{k}={v}") for k, v in pairs), line)
    if kind == "WORKDIR":
        return Step(kind, (rest,), f"WORKDIR {rest}", line)
    words = _json_list(rest, where) if rest.startswith("[") else _split(rest, where)
    if len(words) < 2:
        raise SpecError(f"{where} takes one or more sources and a destination")
    if any(w.startswith("--") for w in words):
        raise SpecError(f"{where}: options (--from, --chown...) are not supported")
    for source in words[:-1]:
        normal = posixpath.normpath(source.lstrip("/"))
        if normal == ".." or normal.startswith("../"):
            raise SpecError(f"{where}: source {source!r} is outside the build context")
    return Step(kind, tuple(words), "COPY " + json.dumps(words), line)


def _json_list(rest: str, where: str) -> list[str]:
    try:
        value = json.loads(rest)
    except ValueError:
        raise SpecError(f"{where}: not a JSON list of strings") from None
    if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        raise SpecError(f"{where}: not a JSON list of strings")
    return value


def _split(rest: str, where: str) -> list[str]:
    try:
        return shlex.split(rest)
    except ValueError as exc:
        raise SpecError(f"{where}: {exc}") from None


def _env(rest: str, where: str) -> list[tuple[str, str]]:
    words = _split(rest, where)
    if "=" not in words[0]:  # ENV KEY VALUE...
        key, value = words[0], rest.split(None, 1)[1] if len(words) > 1 else ""
        pairs = [(key, value.strip())]
    else:
        pairs = []
        for word in words:
            key, eq, value = word.partition("=")
            if not eq:
                raise SpecError(f"{where}: {word!r} is not KEY=VALUE")
            pairs.append((key, value))
    for key, _ in pairs:
        if not _ENV_KEY.match(key):
            raise SpecError(f"{where}: {key!r} is not a variable name")
    return pairs


_VAR = re.compile(r"\\\$|\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand(word: str, env: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` in ``word`` replaced by ``env``'s values (empty when unset),
    ``\\$`` kept as a literal ``$``: what a Dockerfile does in ENV, WORKDIR and COPY."""
    def value(match: re.Match[str]) -> str:
        if match[0] == "\\$":
            return "$"
        return env.get(match[1] or match[2], "")

    return _VAR.sub(value, word)


def expanded(step: Step, env: dict[str, str]) -> Step:
    """``step`` with the variables of ``env`` (set by earlier steps) expanded in its
    arguments, for ENV (values), WORKDIR and COPY; RUN is left to its shell."""
    if step.kind == "ENV":
        args = tuple(k + "=" + expand(v, env) for k, v in (a.split("=", 1) for a in step.args))
    elif step.kind in ("WORKDIR", "COPY"):
        args = tuple(expand(a, env) for a in step.args)
    else:
        return step
    return Step(step.kind, args, step.text, step.line)


def workdir(current: str, arg: str) -> str:
    """The working directory after ``WORKDIR arg`` from ``current`` (a relative one is
    relative to it, as in a Dockerfile)."""
    return posixpath.normpath(posixpath.join(current, arg))
