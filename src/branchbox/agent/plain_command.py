"""A command line that is one plain command runs without starting bash.

``exec("ls -la /tmp")`` used to start ``bash -c``, which parses the line, finds
``ls`` on PATH and, the line being one simple command, execs it in its own place:
the process that runs is ls either way, with bash's pid, fds, session and signal
dispositions. Starting bash for that costs ~0.7 ms of CPU (its libraries, its
locale), a third of an exec's round trip; this module does bash's part itself for
the lines where bash would do nothing else.

Only such lines are taken: words of plain characters separated by blanks (no
quoting, expansion, globs, redirections, operators, comments, or an assignment as
the first word), a first word that is not a bash builtin or keyword and names an
executable file (by path, or the first on a PATH of absolute directories, as bash
looks), and an environment with nothing bash reads, rewrites or drops at its start
(its own variables, a prompt, a locale it would warn about...). The environment gets
what bash adds: ``PWD``, ``SHLVL`` (as bash leaves it after its one-command exec) and
``_``. The caller execs exactly that file, and runs the line under bash after all
if that exec fails (a script without ``#!``, a missing interpreter, a foreign
binary: bash then runs it or says why, as before). Every other line goes to bash.
"""

from __future__ import annotations

import os
import re

_WORDS = re.compile(r"[ \t]*([A-Za-z0-9_./:,+@%=-]+(?:[ \t]+[A-Za-z0-9_./:,+@%=-]+)*)[ \t]*")
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
# Variables bash sets, rewrites or drops at its start (its own, prompts, IFS...), or that
# make it do more than exec the command (run a file, trace, exported functions, POSIX
# mode's PWD, Debian's ~/.bashrc for SSH sessions); and every BASH* name.
_BASH_READS = frozenset({
    "RANDOM", "SRANDOM", "SECONDS", "EPOCHSECONDS", "EPOCHREALTIME", "LINENO", "HISTCMD",
    "PPID", "COMP_WORDBREAKS", "IFS", "PS1", "PS2", "PS4", "OPTIND", "OPTERR",
    "POSIXLY_CORRECT", "SHELLOPTS", "SSH_CLIENT", "SSH2_CLIENT",
})
_QUIET_LC_ALL = ("", "C", "POSIX", "C.UTF-8", "C.utf8")  # any other may make bash warn
_SHLVL = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+[ \t]*")  # as bash's legal_number reads it
_SHLVL_MAX = 998  # bash counts 999 + 1 as too deep, says so and resets it


def without_shell(line: str, env: dict[str, str],
                  cwd: str | None) -> tuple[str, list[str], dict[str, str]] | None:
    """(file, argv, environment) to exec in place of ``bash -c line`` with ``env`` in
    ``cwd`` (None: this process's), or None if bash must run the line. Looks at the
    file system (PATH, ``cwd``) as the command will see it."""
    words = _WORDS.fullmatch(line)
    if words is None:
        return None
    try:
        cwd = cwd or os.getcwd()
    except OSError:  # this process's directory is gone: bash's start says what it says
        return None
    argv = words.group(1).split()
    name = argv[0]
    if name in _BASH_OWN or "=" in name or not cwd.startswith("/") or _bash_reads(env, cwd):
        return None
    shlvl = _shell_level(env.get("SHLVL", ""))
    if shlvl is None:
        return None
    path = _found(name, env.get("PATH"), cwd)
    if path is None:
        return None
    return path, argv, {**env, "PWD": _pwd(env.get("PWD"), cwd), "SHLVL": str(shlvl),
                        "_": path}


def _bash_reads(env: dict[str, str], cwd: str) -> bool:
    """Whether bash, starting with ``env`` in ``cwd``, would change the environment it
    passes on in ways other than PWD, SHLVL and ``_``, or say something."""
    if any(key.startswith("BASH") or key in _BASH_READS for key in env):
        return True
    if env.get("LC_ALL", "") not in _QUIET_LC_ALL:
        return True
    oldpwd = env.get("OLDPWD")  # bash drops one that is not a directory
    return oldpwd is not None and not (oldpwd and os.path.isdir(os.path.join(cwd, oldpwd)))


def _shell_level(value: str) -> int | None:
    """SHLVL as bash leaves it in a command it execs from ``-c``: the inherited level
    (0 if not a number or negative); None where bash would warn."""
    level = max(int(value), 0) if _SHLVL.fullmatch(value) else 0
    return None if level > _SHLVL_MAX else level


def _found(name: str, path_var: str | None, cwd: str) -> str | None:
    """The file bash would exec for command word ``name``, as it names it in ``_``;
    None if there is none, or for a PATH it could read differently (unset, or with
    relative entries)."""
    if "/" in name:
        return name if _executable(os.path.join(cwd, name)) else None
    if not path_var:
        return None
    dirs = path_var.split(":")
    if not all(d.startswith("/") for d in dirs):
        return None
    for directory in dirs:  # bash takes the first executable file
        candidate = os.path.join(directory, name)
        if _executable(candidate):
            return candidate
    return None


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


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
