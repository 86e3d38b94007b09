"""A command line that is one plain command runs without starting bash.

``exec("ls -la /tmp")`` used to start ``bash -c``, which parses the line, finds
``ls`` on PATH and, the line being one simple command, execs it in its own place:
the process that runs is ls either way, with bash's pid, fds, session and signal
dispositions. Starting bash for that costs ~0.7 ms of CPU (its libraries, its
locale), a third of an exec's round trip; this module does bash's part itself for
the lines where bash would do nothing else.

Only such lines are taken: words of plain characters separated by blanks (no
quoting, expansion, globs, redirections, operators, comments, or an assignment as
the first word), a first word that is not a bash builtin or keyword, found on a
PATH of absolute directories as an executable file that the kernel runs itself
(an ELF binary or a ``#!`` script: bash runs a file without either as a script of
its own), and no variable in the environment that changes how bash starts. The
environment gets what bash adds to it: ``PWD``, ``SHLVL`` (as bash leaves it after
its one-command exec) and ``_``. Every other line goes to bash as before, so its
error messages (not found, not executable) stay bash's.
"""

from __future__ import annotations

import os
import re

_WORDS = re.compile(r"[ \t]*([A-Za-z0-9_./:,+@%=-]+(?:[ \t]+[A-Za-z0-9_./:,+@%=-]+)*)[ \t]*")
_SHLVL = re.compile(r"\s*[+-]?[0-9]+\s*")
# bash 5.2's `compgen -b` and `compgen -k`: these never reach an exec.
_BASH_OWN = frozenset({
    ".", ":", "[", "alias", "bg", "bind", "break", "builtin", "caller", "cd", "command",
    "compgen", "complete", "compopt", "continue", "declare", "dirs", "disown", "echo",
    "enable", "eval", "exec", "exit", "export", "false", "fc", "fg", "getopts", "hash",
    "help", "history", "jobs", "kill", "let", "local", "logout", "mapfile", "popd",
    "printf", "pushd", "pwd", "read", "readarray", "readonly", "return", "set", "shift",
    "shopt", "source", "suspend", "test", "times", "trap", "true", "type", "typeset",
    "ulimit", "umask", "unalias", "unset", "wait", "if", "then", "else", "elif", "fi",
    "case", "esac", "for", "select", "while", "until", "do", "done", "in", "function",
    "time", "{", "}", "!", "[[", "]]", "coproc",
})
# Variables bash reads at its start that can make it do more than exec the command:
# run a file, trace, define exported functions (BASH_FUNC_*).
_BASH_START = ("BASH_ENV", "SHELLOPTS", "BASHOPTS")
_SHLVL_MAX = 998  # bash counts 999 + 1 as too deep, says so and resets it
_MAGIC = (b"\x7fELF", b"#!")


def without_shell(line: str, env: dict[str, str],
                  cwd: str) -> tuple[list[str], dict[str, str]] | None:
    """(argv, environment) to exec in place of ``bash -c line`` with ``env`` in ``cwd``,
    or None if bash must run the line. Looks at the file system (PATH, ``cwd``) as the
    command will see it."""
    words = _WORDS.fullmatch(line)
    if words is None:
        return None
    argv = words.group(1).split()
    name = argv[0]
    if name in _BASH_OWN or "=" in name:
        return None
    if any(key in env for key in _BASH_START) or any(k.startswith("BASH_FUNC_") for k in env):
        return None
    shlvl = _shell_level(env.get("SHLVL", ""))
    if shlvl is None:
        return None
    path = _found(name, env.get("PATH"), cwd)
    if path is None:
        return None
    return argv, {**env, "PWD": _pwd(env.get("PWD"), cwd), "SHLVL": str(shlvl), "_": path}


def _shell_level(value: str) -> int | None:
    """SHLVL as bash leaves it in a command it execs from ``-c``: the inherited level
    (0 if not a number or negative); None where bash would warn."""
    level = max(int(value), 0) if _SHLVL.fullmatch(value) else 0
    return None if level > _SHLVL_MAX else level


def _found(name: str, path_var: str | None, cwd: str) -> str | None:
    """The file bash would exec for command word ``name`` (as it names it in ``_``),
    if it is one the kernel runs itself; None otherwise, and for a PATH or working
    directory the exec could read differently (unset, or relative)."""
    if not cwd.startswith("/"):
        return None
    if "/" in name:
        return name if _executable(os.path.join(cwd, name)) == "kernel" else None
    if not path_var:
        return None
    dirs = path_var.split(":")
    if not all(d.startswith("/") for d in dirs):
        return None
    for directory in dirs:  # bash takes the first executable file, as exec does
        candidate = os.path.join(directory, name)
        kind = _executable(candidate)
        if kind is not None:
            return candidate if kind == "kernel" else None
    return None


def _executable(path: str) -> str | None:
    """None unless ``path`` is an executable regular file; "kernel" if it starts with an
    ELF header or ``#!``, else "shell" (bash would run it as a script of its own)."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return "shell"  # unreadable: let bash say what it says
    try:
        head = os.read(fd, 4)
    except OSError:
        head = b""
    finally:
        os.close(fd)
    return "kernel" if head.startswith(_MAGIC) else "shell"


def _pwd(inherited: str | None, cwd: str) -> str:
    """PWD as bash exports it: the inherited one if it is an absolute name of ``cwd``,
    else ``cwd``'s physical path."""
    if inherited and inherited.startswith("/"):
        try:
            if os.path.samestat(os.stat(inherited), os.stat(cwd)):
                return inherited
        except OSError:
            pass
    return os.path.realpath(cwd)
