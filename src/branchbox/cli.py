"""The ``branchbox`` command: run the daemon, and drive sandboxes from a shell.

Every command but ``serve`` talks to the daemon through the SDK (so
``$BRANCHBOX_URL`` and ``$BRANCHBOX_API_KEY`` apply, and a local daemon is
started when none answers), and takes ``--json`` for output a program can
read. A ``SandboxError`` ends the command with exit status 1 and one red line.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ParamSpec

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from branchbox.engine.config import DEFAULT_DATA_DIR
from branchbox.patterns import (
    Candidate,
    Outcome,
    PatternTimeout,
    best_of_n,
    reflexion,
    speculate,
)
from branchbox.sdk import CommandResult, Sandbox, SandboxError

# Piped output is not cut to 80 columns: the ids in tables are for copying whole.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False)
P = ParamSpec("P")


app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Linux sandboxes with a persistent Python REPL that fork, diff and merge.")


def command(name: str | None = None, group: typer.Typer | None = None,
            ) -> Callable[[Callable[P, None]], Callable[P, None]]:
    """``group.command`` (the top-level app by default), with SDK errors shown as one red
    line and exit status 1."""

    def register(func: Callable[P, None]) -> Callable[P, None]:
        @functools.wraps(func)
        def run(*args: P.args, **kwargs: P.kwargs) -> None:
            try:
                func(*args, **kwargs)
            except SandboxError as exc:
                fail(str(exc))

        (group or app).command(name)(run)
        return run

    return register


Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]
SandboxId = Annotated[str, typer.Argument(help="Sandbox id (sbx_...).", show_default=False)]


class Storage(StrEnum):
    auto = "auto"
    btrfs = "btrfs"
    copy = "copy"


def fail(message: str) -> None:
    err.print(f"[red]error:[/red] {escape(message)}", markup=True, soft_wrap=True)
    raise typer.Exit(1)


def emit_json(value: Any) -> None:
    """One line of JSON, for programs to read."""
    print(json.dumps(value, default=str), flush=True)


@contextmanager
def attached(sandbox_id: str) -> Iterator[Sandbox]:
    """An existing sandbox, left running afterwards."""
    sandbox = Sandbox.connect(sandbox_id)
    try:
        yield sandbox
    finally:
        sandbox.detach()


def write_through(stream: Any) -> Any:
    """An output callback that copies sandbox output to ``stream`` as it arrives."""

    def write(data: str) -> None:
        stream.write(data)
        stream.flush()

    return write


ApiKeys = Annotated[Path | None, typer.Option(
    help="File of accepted API keys, one a line (also: $BRANCHBOX_API_KEY).")]


def configured_keys(api_keys: Path | None) -> list[str]:
    """The API keys a listener accepts: ``$BRANCHBOX_API_KEY``, then the file's lines."""
    keys = [os.environ["BRANCHBOX_API_KEY"]] if os.environ.get("BRANCHBOX_API_KEY") else []
    if api_keys is not None:
        keys += [line.strip() for line in api_keys.read_text().splitlines() if line.strip()]
    return keys


@command()
def serve(
    data_dir: Annotated[Path, typer.Option(help="Where sandboxes, layers and the socket live.",
                                           envvar="BRANCHBOX_DATA_DIR")]
    = DEFAULT_DATA_DIR,
    host: Annotated[str | None, typer.Option(help="Listen on TCP at this address instead of "
                                                  "the unix socket.")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default 8787).")] = None,
    storage: Annotated[Storage | None, typer.Option(
        help="Snapshot backend; default $BRANCHBOX_STORAGE, else auto (btrfs if possible).")]
    = None,
    api_keys: ApiKeys = None,
    max_upload_mb: Annotated[int, typer.Option(help="Largest file upload accepted.")] = 1024,
    internet: Annotated[bool, typer.Option(
        "--internet", help="Egress through NAT for sandboxes that do not say "
                           "(also: $BRANCHBOX_INTERNET=1).")] = False,
    host_deny: Annotated[list[str] | None, typer.Option(
        "--host-deny", metavar="PATH", help="A host path (glob, or ~/PATH for every home) "
        "image 'host' hides, beyond its default deny list; repeat for more.")] = None,
    host_deny_file: Annotated[Path | None, typer.Option(
        help="A file of such paths, one a line (# comments).")] = None,
    node: Annotated[str | None, typer.Option(
        help="This node's name in a cluster, shown by a gateway (default: the host name).",
        envvar="BRANCHBOX_NODE")] = None,
    keep: Annotated[bool, typer.Option(
        "--keep", help="On SIGINT/SIGTERM leave every sandbox running: the next daemon on "
                       "this data directory serves them again (also: $BRANCHBOX_KEEP=1).")]
    = False,
    as_json: Json = False,
) -> None:
    """Run the daemon until SIGINT or SIGTERM (which close every sandbox, unless --keep)."""
    # Imported here: the other commands need neither FastAPI nor the engine.
    from branchbox.server.serve import ServeError
    from branchbox.server.serve import serve as run_server
    from branchbox.storage.host_mask import check_pattern, read_deny_file

    if internet:  # read by EngineConfig, like the daemon's other settings
        os.environ["BRANCHBOX_INTERNET"] = "1"
    if keep:
        os.environ["BRANCHBOX_KEEP"] = "1"
    if node:
        os.environ["BRANCHBOX_NODE"] = node
    try:
        deny = [check_pattern(p) for p in host_deny or []]
        deny += read_deny_file(host_deny_file) if host_deny_file else []
    except (OSError, ValueError) as exc:
        fail(str(exc))
    if api_keys is not None:  # image 'host' shows the host's files: never the daemon's keys
        deny.append(glob.escape(str(api_keys.absolute())))
    if deny:
        os.environ["BRANCHBOX_HOST_DENY"] = os.pathsep.join(deny)
    try:
        run_server(data_dir, host, port, storage.value if storage else None,
                   api_keys=configured_keys(api_keys),
                   max_upload=max_upload_mb << 20,
                   on_listening=(lambda url: emit_json({"listening": url})) if as_json
                   else (lambda url: out.print(f"branchbox listening on {url}")))
    except ServeError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass  # the server has shut down gracefully already


@command()
def gateway(
    nodes: Annotated[str | None, typer.Option(
        metavar="URL,...", help="The node daemons' URLs (http://HOST:PORT), comma-separated.")]
    = None,
    kubernetes: Annotated[str | None, typer.Option(
        metavar="SERVICE", help="Find the nodes as the ready endpoints of this headless "
                                "Service instead (its EndpointSlices, port 'http').")] = None,
    namespace: Annotated[str, typer.Option(
        help="The Service's namespace.", envvar="POD_NAMESPACE")] = "default",
    node_key: Annotated[str | None, typer.Option(
        help="The key every node accepts (nodes trust only the gateway); also "
             "$BRANCHBOX_NODE_KEY.", envvar="BRANCHBOX_NODE_KEY", show_envvar=False)] = None,
    api_keys: ApiKeys = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
    as_json: Json = False,
) -> None:
    """Route requests by sandbox id across daemons on several nodes; creates go to the
    least-loaded node (see deploy/kubernetes for a cluster)."""
    from branchbox.gateway.nodes import static_source
    from branchbox.gateway.serve import serve_gateway

    if (nodes is None) == (kubernetes is None):
        fail("name the nodes: --nodes URL,... or --kubernetes SERVICE (one of the two)")
    keys = configured_keys(api_keys)
    if not keys or not node_key:
        fail("the gateway needs its clients' API key ($BRANCHBOX_API_KEY or --api-keys) and "
             "the nodes' key (--node-key or $BRANCHBOX_NODE_KEY)")
    on_stop = None
    if nodes is not None:
        urls = [u.strip().rstrip("/") for u in nodes.split(",") if u.strip()]
        if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
            fail(f"--nodes wants http://HOST:PORT URLs, comma-separated, not {nodes!r}")
        source = static_source(urls)
    else:
        from branchbox.gateway.discovery import DiscoveryError, KubernetesNodes
        try:
            found = KubernetesNodes(kubernetes, namespace)
        except DiscoveryError as exc:
            fail(str(exc))
        source, on_stop = found.urls, found.aclose
    try:
        serve_gateway(source, host, port, api_keys=keys, node_key=node_key, on_stop=on_stop,
                      on_listening=(lambda url: emit_json({"listening": url})) if as_json
                      else (lambda url: out.print(f"branchbox gateway listening on {url}")))
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc}")
    except KeyboardInterrupt:
        pass


@command()
def mcp(
    http: Annotated[str | None, typer.Option(
        "--http", metavar="HOST:PORT", help="Serve streamable HTTP at http://HOST:PORT/mcp "
        "instead of stdio; clients need an API key, as for the daemon.")] = None,
    url: Annotated[str | None, typer.Option(
        help="The daemon to use (also: $BRANCHBOX_URL); default the local one, started if "
             "none runs.")] = None,
    api_keys: ApiKeys = None,
    data_dir: Annotated[Path, typer.Option(
        help="With --http and no key configured: the data directory whose generated key "
             "clients must send.", envvar="BRANCHBOX_DATA_DIR")] = DEFAULT_DATA_DIR,
) -> None:
    """Serve branchbox's sandboxes as MCP tools (create, run_code, exec, files, fork, diff,
    merge_into, commit, checkpoint, restore, close); a session's sandboxes are closed when it
    ends."""
    # Imported here: only this command needs the MCP SDK.
    import anyio

    from branchbox.mcp_server.http import parse_address, serve_http
    from branchbox.mcp_server.server import build, serve_stdio

    server = build(url)
    if http is None:
        anyio.run(serve_stdio, server)
        return
    try:
        host, port = parse_address(http)
    except ValueError as exc:
        fail(str(exc))
    keys = configured_keys(api_keys)
    if not keys:  # the key a TCP daemon of this data directory makes and accepts
        from branchbox.server.serve import API_KEY_FILE, generated_api_key

        data_dir.mkdir(parents=True, exist_ok=True)
        keys = [generated_api_key(data_dir / API_KEY_FILE)]
        err.print(f"branchbox mcp: clients must send the API key in {data_dir / API_KEY_FILE}")
    try:
        anyio.run(serve_http, server, host, port, keys,
                  lambda address: err.print(f"branchbox mcp listening on {address}"))
    except OSError as exc:
        fail(f"cannot listen on {http}: {exc}")


@command("ls")
def list_sandboxes(as_json: Json = False) -> None:
    """List the live sandboxes."""
    sandboxes = Sandbox.list_all()
    if as_json:
        emit_json(sandboxes)
        return
    table = Table("ID", "STATE", "PARENT", "IMAGE", "CHILDREN", box=None)
    for info in sandboxes:
        table.add_row(info["id"], info.get("state"), info.get("parent_id") or "-",
                      info.get("image"), str(len(info.get("children") or [])))
    out.print(table)


@command()
def create(
    image: Annotated[str, typer.Option(help="Image to start from.")] = "default",
    timeout: Annotated[float | None, typer.Option(
        help="Seconds until the server closes the sandbox.")] = None,
    memory_mb: Annotated[int | None, typer.Option(help="Memory limit in MiB.")] = None,
    as_json: Json = False,
) -> None:
    """Create a sandbox, print its id, and leave it running."""
    sandbox = Sandbox(image, timeout=timeout, memory_mb=memory_mb)
    if as_json:
        emit_json(sandbox.info())
    else:
        out.print(sandbox.id)
    sandbox.detach()


@command()
def run(
    sandbox_id: SandboxId,
    code: Annotated[str, typer.Argument(help="Python code for the sandbox's REPL.")],
    timeout: Annotated[float | None, typer.Option(help="Interrupt the code after this "
                                                       "many seconds.")] = None,
    as_json: Json = False,
) -> None:
    """Run Python in a sandbox's REPL, streaming its output; exit 1 if it raised."""
    with attached(sandbox_id) as sandbox:
        if as_json:
            execution = sandbox.run_code(code, timeout=timeout)
            emit_json(dataclasses.asdict(execution))
        else:
            execution = sandbox.run_code(code, timeout=timeout,
                                         on_stdout=write_through(sys.stdout),
                                         on_stderr=write_through(sys.stderr))
            if execution.text is not None:
                out.print(execution.text, markup=False)
            if execution.error is not None:
                sys.stderr.write(execution.error.traceback)
    if execution.error is not None:
        raise typer.Exit(1)


@command("exec")
def exec_command(
    sandbox_id: SandboxId,
    cmd: Annotated[list[str], typer.Argument(
        help="The command after `--`; one argument is run by bash (pipes work), several "
             "are the argv.", show_default=False)],
    cwd: Annotated[str | None, typer.Option(help="Working directory in the sandbox.")] = None,
    timeout: Annotated[float | None, typer.Option(help="Kill it after this many seconds.")]
    = None,
    as_json: Json = False,
) -> None:
    """Run a command in a sandbox, streaming its output; exit with its exit status.

    Put the command after `--`: branchbox exec ID -- ls -l /root
    """
    command: str | list[str] = cmd[0] if len(cmd) == 1 else cmd
    with attached(sandbox_id) as sandbox:
        if as_json:
            result = sandbox.exec(command, cwd=cwd, timeout=timeout)
        else:
            result = sandbox.exec(command, cwd=cwd, timeout=timeout,
                                  on_stdout=write_through(sys.stdout),
                                  on_stderr=write_through(sys.stderr))
    assert isinstance(result, CommandResult)
    if as_json:
        emit_json(dataclasses.asdict(result))
    raise typer.Exit(result.exit_code or 0)


@command()
def fork(
    sandbox_id: SandboxId,
    n: Annotated[int, typer.Option("-n", "--n", help="How many children.")] = 1,
    as_json: Json = False,
) -> None:
    """Fork a sandbox into N children (memory, files, env, cwd); print their ids."""
    with attached(sandbox_id) as sandbox:
        children = sandbox.fork(n)
        ids = [child.id for child in children]
        for child in children:
            child.detach()
    if as_json:
        emit_json({"children": ids})
    else:
        out.print("\n".join(ids))


@command()
def diff(
    a: SandboxId,
    b: Annotated[str, typer.Argument(help="The sandbox to compare with A.", show_default=False)],
    path: Annotated[list[str] | None, typer.Option(
        "--path", help="Compare under this path (repeatable; default /root and /tmp).")] = None,
    as_json: Json = False,
) -> None:
    """Show files added, removed and modified in B relative to A."""
    with attached(a) as sandbox:
        changes = sandbox.diff(b, path)
    if as_json:
        emit_json(changes)
        return
    for kind, mark, color in (("added", "+", "green"), ("removed", "-", "red"),
                              ("modified", "~", "yellow")):
        for changed in changes.get(kind, []):
            out.print(f"[{color}]{mark} {changed}[/{color}]", markup=True)


@command()
def merge(
    parent: SandboxId,
    winner: Annotated[str, typer.Argument(help="The child whose state the parent takes.",
                                          show_default=False)],
    as_json: Json = False,
) -> None:
    """Merge WINNER into PARENT: PARENT's id now drives WINNER's state; WINNER is retired."""
    with attached(parent) as target, attached(winner) as source:
        target.merge_into(source)
    if as_json:
        emit_json({"merged": winner, "into": parent})


@command()
def pause(sandbox_id: SandboxId) -> None:
    """Freeze everything in a sandbox (no CPU; its timeout stops) until `resume`."""
    with attached(sandbox_id) as sandbox:
        out.print(sandbox.pause()["state"])


@command()
def resume(sandbox_id: SandboxId) -> None:
    """Thaw a paused sandbox."""
    with attached(sandbox_id) as sandbox:
        out.print(sandbox.resume()["state"])


@command()
def checkpoint(
    sandbox_id: SandboxId,
    name: Annotated[str | None, typer.Option(help="A label for it.")] = None,
    as_json: Json = False,
) -> None:
    """Keep this instant of a sandbox (memory and files); print the checkpoint's id."""
    with attached(sandbox_id) as sandbox:
        cp = sandbox.checkpoint(name)
    if as_json:
        emit_json({"id": cp.id, "name": cp.name, "sandbox_id": sandbox_id})
    else:
        out.print(cp.id)


@command()
def restore(
    sandbox_id: SandboxId,
    checkpoint_id: Annotated[str, typer.Argument(help="Checkpoint id (cp_...).",
                                                 show_default=False)],
) -> None:
    """Make a sandbox one of its checkpoints again (same id, same address)."""
    with attached(sandbox_id) as sandbox:
        sandbox.restore(checkpoint_id)


@command("rm")
def remove(
    sandbox_ids: Annotated[list[str], typer.Argument(help="Sandbox ids.", show_default=False)],
    as_json: Json = False,
) -> None:
    """Close sandboxes (killing everything in them)."""
    for sandbox_id in sandbox_ids:
        Sandbox.connect(sandbox_id).close()
    if as_json:
        emit_json({"closed": sandbox_ids})


# ------------------------------------------------------------------ patterns on a directory

Directory = Annotated[Path, typer.Option(
    "-C", "--directory", help="The directory the candidates branch and the winner is "
                              "committed into (default: the current one).")]
PatternTimeoutOption = Annotated[float | None, typer.Option(
    "--timeout", help="Stop every candidate after this many seconds in all; the directory "
                      "is then left unchanged.")]
PatternImage = Annotated[str, typer.Option(
    "--image", help="Image of the branches: 'host' (the default) runs the directory's own "
                    "toolchain, venv and tools as on the host; or any image name.")]
Cmd = Annotated[list[str], typer.Argument(
    help="The command after `--`: one argument is run by bash (quote it for `&&` and "
         "pipes), several are the argv.", show_default=False)]
SCORE_FILE = "/tmp/.branchbox-score"
# An environment variable holds at most 128 KiB; feedback keeps the end, where errors are.
FEEDBACK_LIMIT = 64 << 10


def shell_line(cmd: list[str]) -> str:
    return cmd[0] if len(cmd) == 1 else shlex.join(cmd)


def bash(child: Sandbox, root: str, script: str, *args: str, **env: str) -> CommandResult:
    """``script`` run by bash (``$1``... are ``args``) in the workspace directory of ``child``."""
    result = child.exec(["bash", "-c", script, "bash", *args], cwd=root, env=env)
    assert isinstance(result, CommandResult)
    return result


def exited_zero(child: Sandbox, result: CommandResult) -> bool:
    return result.exit_code == 0


def letters(index: int) -> str:
    """a, b, ... z, aa, ab ...: the names of speculate's candidates (fix-a, fix-b...)."""
    name = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        name = chr(ord("a") + rest) + name
    return name


def branch_out(root: str, as_json: bool, label: Callable[[int], str],
               pattern: Callable[[Sandbox], Outcome], image: str = "host") -> None:
    """Run ``pattern`` in a sandbox whose workspace is the directory ``root``, commit its
    winner there, and report every candidate; exit 1 when nothing was committed."""
    committed: dict | None = None
    timed_out = False
    with Sandbox(image, workspace=root, cwd=root) as sandbox:
        try:
            outcome = pattern(sandbox)
        except PatternTimeout as exc:
            outcome, timed_out = exc.outcome, True
        if outcome.winner is not None:
            committed = sandbox.commit()
    if as_json:
        emit_json({"directory": root, "timed_out": timed_out, "committed": committed,
                   "winner": None if outcome.winner is None else label(outcome.winner.index),
                   "candidates": [candidate_json(c, label(c.index))
                                  for c in outcome.candidates]})
    else:
        report(outcome, label, root, committed)
        if committed is None:
            err.print(f"{'timed out' if timed_out else 'no candidate succeeded'}; "
                      f"{escape(root)} is unchanged")
    if committed is None:
        raise typer.Exit(1)


def candidate_json(candidate: Candidate, name: str) -> dict[str, Any]:
    result = candidate.result
    return {"name": name, "sandbox_id": candidate.sandbox_id, "status": candidate.status,
            "score": candidate.score, "duration": candidate.duration,
            "error": None if candidate.error is None else str(candidate.error),
            "feedback": candidate.feedback,
            **(dataclasses.asdict(result) if isinstance(result, CommandResult) else {})}


def verdict(candidate: Candidate, pattern: str) -> str:
    """How a candidate ended, in a few words."""
    result = candidate.result
    if candidate.status in ("aborted", "timed_out"):
        return candidate.status.replace("_", " ")
    if candidate.error is not None:
        return f"error: {candidate.error}"
    if isinstance(result, CommandResult) and result.exit_code != 0:
        return f"failed (exit {result.exit_code})"
    # Only best_of_n ranks by score; the others score a success 1.0.
    return f"score {candidate.score:g}" if pattern == "best_of_n" else "success"


def report(outcome: Outcome, label: Callable[[int], str], root: str,
           committed: dict | None) -> None:
    """``fix-b: success, committed into /dir (3 files changed)``, then one line per way the
    others ended: ``fix-a, fix-c: aborted``."""
    winner, pattern = outcome.winner, outcome.pattern
    if winner is not None and committed is not None:
        out.print(f"{label(winner.index)}: {verdict(winner, pattern)}, committed into "
                  f"{escape(root)} ({len(committed['changed'])} files changed)")
    groups: dict[str, list[str]] = {}
    for candidate in outcome.candidates:
        if candidate is not winner:
            groups.setdefault(verdict(candidate, pattern), []).append(label(candidate.index))
    for text, names in groups.items():
        out.print(f"{', '.join(names)}: {escape(text)}")


@command("speculate")
def speculate_command(
    cmd: Annotated[list[str], typer.Option(
        "-c", "--cmd", help="A candidate command, run by bash in the directory (repeat: "
                            "one candidate each).", show_default=False)],
    directory: Directory = Path("."),
    timeout: PatternTimeoutOption = None,
    image: PatternImage = "host",
    as_json: Json = False,
) -> None:
    """Race commands in branches of a directory; the first that exits 0 is committed into it.

    The others are killed and their changes discarded. Candidates are named fix-a, fix-b...
    in the order given.
    """
    root = str(directory.resolve())
    candidates = [lambda child, index, script=c: bash(child, root, script) for c in cmd]
    branch_out(root, as_json, lambda i: f"fix-{letters(i)}", lambda sb: speculate(
        sb, candidates, success=exited_zero, timeout=timeout), image)


@command("best-of-n")
def best_of_n_command(
    cmd: Cmd,
    n: Annotated[int, typer.Option("-n", "--n", help="How many attempts.")] = 3,
    directory: Directory = Path("."),
    timeout: PatternTimeoutOption = None,
    image: PatternImage = "host",
    as_json: Json = False,
) -> None:
    """Run a command N times at once in branches of a directory; commit the best-scoring one.

    Each attempt gets its number (0..N-1) in $BRANCHBOX_ATTEMPT and prints its score to fd 3
    (the last line counts, e.g. `echo 0.9 >&3`). The highest score wins, ties to the lowest
    attempt; an attempt that exits non-zero cannot win. Put the command after `--`.
    """
    root = str(directory.resolve())

    def attempt(child: Sandbox, index: int) -> CommandResult:
        return bash(child, root, 'bash -c "$1" 3>"$2"', shell_line(cmd), SCORE_FILE,
                    BRANCHBOX_ATTEMPT=str(index))

    def score(child: Sandbox, result: CommandResult) -> float | None:
        if result.exit_code != 0:
            return None  # cannot win; its output stays in the record
        lines = child.files.read(SCORE_FILE).decode(errors="replace").split()
        if not lines:
            raise ValueError("the command printed no score to fd 3 (e.g. `echo 0.9 >&3`)")
        return float(lines[-1])

    branch_out(root, as_json, lambda i: f"attempt-{i}",
               lambda sb: best_of_n(sb, n, task=attempt, score=score, timeout=timeout), image)


@command("reflexion")
def reflexion_command(
    cmd: Cmd,
    retries: Annotated[int, typer.Option(help="Attempts after the first.")] = 3,
    critique: Annotated[str | None, typer.Option(
        help="Run by bash in a failed attempt's branch; its output is the next attempt's "
             "feedback (default: the failed command's own output).")] = None,
    directory: Directory = Path("."),
    timeout: PatternTimeoutOption = None,
    image: PatternImage = "host",
    as_json: Json = False,
) -> None:
    """Retry a command in fresh branches of a directory until it exits 0; commit that one.

    Each attempt gets its number in $BRANCHBOX_ATTEMPT and the previous attempt's critique in
    $BRANCHBOX_FEEDBACK (empty at first; at most its last 64 KiB). Put the command after `--`.
    """
    root = str(directory.resolve())

    def attempt(child: Sandbox, index: int, feedback: str | None) -> CommandResult:
        return bash(child, root, shell_line(cmd), BRANCHBOX_ATTEMPT=str(index),
                    BRANCHBOX_FEEDBACK=feedback or "")

    def review(child: Sandbox, result: CommandResult) -> str:
        said = result if critique is None else bash(child, root, critique)
        return (said.stdout + said.stderr).rstrip()[-FEEDBACK_LIMIT:]

    branch_out(root, as_json, lambda i: f"attempt-{i}", lambda sb: reflexion(
        sb, task=attempt, success=exited_zero, critique=review, retries=retries,
        timeout=timeout), image)


image_app = typer.Typer(no_args_is_help=True, help="Images sandboxes start from.")
app.add_typer(image_app, name="image")


@command("ls", image_app)
def image_list(as_json: Json = False) -> None:
    """List the images: built-in ones and those saved from sandboxes."""
    images = Sandbox.list_images()
    if as_json:
        emit_json(images)
        return
    table = Table("NAME", "KIND", "SIZE", "FROM", "USED BY", box=None)
    for info in images:
        size = info.get("size_bytes")
        table.add_row(info["name"], info["kind"] if info.get("built") else "built-in (not built)",
                      "-" if size is None else f"{size / 1e6:.0f} MB",
                      info.get("from_image") or "-", str(len(info.get("users") or [])))
    out.print(table)


@command("build", image_app)
def image_build(
    name: Annotated[str, typer.Argument(help="Name of the new image.", show_default=False)],
    file: Annotated[Path, typer.Option("-f", "--file", help="The spec: a Dockerfile subset "
                                       "(FROM, RUN, ENV, WORKDIR, COPY).",
                                       show_default=False)],
    context: Annotated[Path | None, typer.Option(
        help="Directory COPY takes files from (default: none).")] = None,
    internet: Annotated[bool | None, typer.Option(
        "--internet/--no-internet", help="Egress for RUN steps (default: the server's).",
        show_default=False)] = None,
    as_json: Json = False,
) -> None:
    """Build an image from a spec, one cached layer per step; a failing step shows its
    output and leaves no image."""
    from branchbox.build_progress import BuildProgress

    try:
        spec = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read the spec {file}: {exc}")
    with BuildProgress(err) as shown:
        info = Sandbox.build_image(name, spec, context, internet=internet,
                                   on_event=None if as_json else shown.on_event)
        shown.done()
    if as_json:
        emit_json(info)
    else:
        out.print(f"built {info['name']} in {info.get('build_seconds')} s "
                  f"({(info.get('size_bytes') or 0) / 1e6:.0f} MB of its own)")


@command("save", image_app)
def image_save(sandbox_id: SandboxId,
               name: Annotated[str, typer.Argument(help="Name of the new image.")],
               as_json: Json = False) -> None:
    """Save a sandbox's filesystem (not its memory) as an image."""
    with attached(sandbox_id) as sandbox:
        info = sandbox.save_image(name)
    if as_json:
        emit_json(info)
    else:
        out.print(f"saved {info['name']} ({(info.get('size_bytes') or 0) / 1e6:.0f} MB of its own)")


@command("rm", image_app)
def image_remove(name: Annotated[str, typer.Argument(help="Image to delete.")]) -> None:
    """Delete a saved or built image (refused while a sandbox or another image uses it)."""
    Sandbox.remove_image(name)


@command()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="Fewer runs and smaller sizes "
                                                        "(under a minute).")] = False,
    only: Annotated[list[str] | None, typer.Option(
        "--only", help="Run only this suite (repeatable).", show_default=False)] = None,
    json_file: Annotated[Path | None, typer.Option(
        "--json", help="Also write the results as JSON to this file ('-' for stdout).",
        show_default=False)] = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="Draw fork latency against n and parent memory into this PNG.",
        show_default=False)] = None,
) -> None:
    """Measure create, run_code, fork, merge, diff, memory... beside what users do without
    fork, against a private daemon; print tables with p50/p90/max and ratios."""
    # Imported here: only this command needs the suites (and matplotlib, for --plot).
    from branchbox.bench import SUITES, run_suites
    from branchbox.bench.report import as_json, show, write_json
    from branchbox.bench.report import plot as draw

    unknown = sorted(set(only or ()) - SUITES.keys())
    if unknown:
        fail(f"unknown suite {', '.join(unknown)}; the suites are: {', '.join(SUITES)}")
    results = run_suites(only or list(SUITES), quick, err)
    show(results, err if json_file == Path("-") else out)
    if json_file == Path("-"):
        emit_json(as_json(results))
    elif json_file is not None:
        write_json(results, json_file)
        err.print(f"wrote {json_file}")
    if plot is not None:
        err.print(f"wrote {plot}" if draw(results, plot) else "no fork rows to plot")
    if any(suite.error for suite in results.suites):
        raise typer.Exit(1)
