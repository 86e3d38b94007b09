"""Which command lines run without bash, and the environment they get (agent.plain_command).

What bash itself would export is checked against bash in test_agent.py and
test_sdk_sandbox.py; these pin the rules on a file system the test makes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from branchbox.agent.plain_command import without_shell


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A PATH directory with an ELF binary (a copy of true), a #! script, a script
    without #! (which the kernel will not exec), and a file that is not executable."""
    where = tmp_path / "bin"
    where.mkdir()
    (where / "elf").write_bytes(Path("/bin/true").read_bytes())
    (where / "script").write_text("#!/bin/sh\nexit 0\n")
    (where / "bare").write_text("exit 0\n")
    (where / "plain").write_text("#!/bin/sh\n")
    for name in ("elf", "script", "bare"):
        (where / name).chmod(0o755)
    return where


def env_for(bin_dir: Path, **more: str) -> dict[str, str]:
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": "/root", **more}


def test_a_plain_line_is_execd_with_what_bash_adds(bin_dir: Path, tmp_path: Path) -> None:
    env = env_for(bin_dir)
    file, argv, got = without_shell("  elf -x --color=auto a/b,c:d@e%f+g\t", env,
                                    str(tmp_path))
    assert file == str(bin_dir / "elf")
    assert argv == ["elf", "-x", "--color=auto", "a/b,c:d@e%f+g"]  # argv[0] as typed
    assert got == {**env, "PWD": str(tmp_path), "SHLVL": "0", "_": file}
    assert without_shell("script", env, str(tmp_path))[2]["_"] == str(bin_dir / "script")
    # Taken, though the kernel will not run it: the exec fails, and bash runs the line.
    assert without_shell("bare", env, "/")[0] == str(bin_dir / "bare")


def test_a_command_named_by_path_keeps_its_name_in_underscore(bin_dir: Path) -> None:
    file, argv, got = without_shell("./elf 1", env_for(bin_dir), str(bin_dir))
    assert file == "./elf" and argv == ["./elf", "1"] and got["_"] == "./elf"
    assert without_shell("./plain", env_for(bin_dir), str(bin_dir)) is None


@pytest.mark.parametrize("line", [
    "elf; elf", "elf && elf", "elf | elf", "elf > out", "elf < in", "elf &", "elf $HOME",
    "elf 'a'", 'elf "a"', "elf a\\ b", "elf *", "elf a?", "elf [ab]", "elf ~", "elf {a,b}",
    "elf `x`", "elf $(x)", "elf # note", "elf\nelf", "! elf", "(elf)", "X=1 elf", "",
    "   ", "elf é",
])
def test_shell_syntax_goes_to_bash(line: str, bin_dir: Path) -> None:
    assert without_shell(line, env_for(bin_dir), "/") is None


@pytest.mark.parametrize("line", ["true", "echo hi", "cd /", "exit 3", "kill 1", "pwd",
                                  "test -e /", "time elf", "exec elf", "command elf",
                                  "if", "coproc elf"])
def test_builtins_and_keywords_go_to_bash(line: str, bin_dir: Path, tmp_path: Path) -> None:
    for name in ("true", "echo", "cd", "exit", "kill", "pwd", "test"):  # a twin on PATH
        (bin_dir / name).write_bytes((bin_dir / "elf").read_bytes())
        (bin_dir / name).chmod(0o755)
    assert without_shell(line, env_for(bin_dir), str(tmp_path)) is None


def test_files_bash_would_not_find_go_to_bash(bin_dir: Path) -> None:
    env = env_for(bin_dir)
    assert without_shell("plain", env, "/") is None  # not executable
    assert without_shell("missing-bb", env, "/") is None  # bash says "command not found"
    assert without_shell("bin", env_for(bin_dir.parent), "/") is None  # a directory


def test_the_first_executable_on_path_is_the_one(bin_dir: Path, tmp_path: Path) -> None:
    first = tmp_path / "first"
    first.mkdir()
    (first / "elf").write_text("#!/bin/sh\n")  # not executable: skipped, as bash does
    env = {"PATH": f"{first}:{bin_dir}"}
    assert without_shell("elf", env, "/")[0] == str(bin_dir / "elf")
    (first / "elf").chmod(0o755)
    assert without_shell("elf", env, "/")[0] == str(first / "elf")


@pytest.mark.parametrize("path", ["", "relative:/bin", "/bin::/usr/bin", None])
def test_a_path_exec_could_read_otherwise_goes_to_bash(path: str | None, bin_dir: Path) -> None:
    env = {} if path is None else {"PATH": path}
    assert without_shell("elf", env, str(bin_dir)) is None
    assert without_shell("elf", env_for(bin_dir), "relative/dir") is None


@pytest.mark.parametrize(("var", "value"), [
    ("BASH_ENV", "x"), ("BASHOPTS", "x"), ("BASH_FUNC_f%%", "x"), ("BASH", "x"),
    ("BASH_VERSION", "x"), ("SHELLOPTS", "x"), ("IFS", "x"), ("PS1", "x"), ("PS4", "x"),
    ("RANDOM", "1"), ("PPID", "1"), ("OPTIND", "x"), ("POSIXLY_CORRECT", "y"),
    ("SSH_CLIENT", "x"), ("LC_ALL", "xx_XX.UTF-8"), ("OLDPWD", ""), ("OLDPWD", "/etc/passwd"),
    ("OLDPWD", "missing"),
])
def test_variables_bash_reads_at_its_start_go_to_bash(var: str, value: str,
                                                      bin_dir: Path) -> None:
    """bash would set, rewrite or drop them (or warn, or run more than the command)."""
    assert without_shell("elf", env_for(bin_dir, **{var: value}), "/") is None


@pytest.mark.parametrize(("var", "value"), [
    ("LC_ALL", "C"), ("LC_ALL", "C.UTF-8"), ("LC_ALL", ""), ("OLDPWD", "/"), ("OLDPWD", "bin"),
    ("LANG", "xx_XX.UTF-8"), ("ENV", "/x"), ("HOME", "/root"),
])
def test_variables_bash_passes_on_as_they_are(var: str, value: str, bin_dir: Path) -> None:
    got = without_shell("elf", env_for(bin_dir, **{var: value}), str(bin_dir.parent))
    assert got is not None and got[2][var] == value


@pytest.mark.parametrize(("given", "exported"), [
    ("5", "5"), (" 7 ", "7"), ("+3", "3"), ("abc", "0"), ("-3", "0"), ("", "0"),
    ("1_0", "0"), ("998", "998"), ("999", None), ("100000", None), ("\n\r\v\f 5\t", "5"),
    ("5\n", "0"), ("5\r", "0"), ("5\xa0", "0"), ("\xa05", "0"), ("\u0665", "0"),
])
def test_shlvl_as_bash_leaves_it(given: str, exported: str | None, bin_dir: Path) -> None:
    plain = without_shell("elf", env_for(bin_dir, SHLVL=given), "/")
    assert (plain and plain[2]["SHLVL"]) == exported  # None: bash warns, so bash runs


def test_pwd_is_kept_when_it_names_the_directory(bin_dir: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(bin_dir)
    env = env_for(bin_dir)
    assert without_shell("elf", {**env, "PWD": str(link)}, str(link))[2]["PWD"] == str(link)
    assert without_shell("elf", env, str(link))[2]["PWD"] == str(bin_dir)  # physical
    elsewhere = without_shell("elf", {**env, "PWD": "/"}, str(bin_dir))
    assert elsewhere[2]["PWD"] == str(bin_dir)
    dotted = f"{tmp_path}/../{tmp_path.name}/bin"
    assert without_shell("elf", {**env, "PWD": dotted}, str(bin_dir))[2]["PWD"] == dotted
    assert os.path.samefile(dotted, bin_dir)


def test_a_working_directory_that_is_gone_leaves_the_line_to_bash(bin_dir: Path,
                                                                  tmp_path: Path) -> None:
    """No cwd given and this process's own removed: nothing to look up from."""
    gone = tmp_path / "gone"
    gone.mkdir()
    here = os.getcwd()
    os.chdir(gone)
    try:
        gone.rmdir()
        assert without_shell("elf", env_for(bin_dir), None) is None
        assert without_shell("elf", env_for(bin_dir), "/") is not None
    finally:
        os.chdir(here)
