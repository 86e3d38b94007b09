"""The MCP tools: one argument model per tool, whose JSON schema the client is shown.

The descriptions are written for the model that calls the tools: what the tool
does, what it returns, and what to call next. Arguments are validated by the
same models before anything reaches the daemon, so a bad call is a tool error
naming the field, never a request the daemon has to refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SandboxId = Annotated[str, Field(pattern=r"^sbx_[0-9a-f]{32}$",
                                 description="A sandbox id (sbx_ + 32 hex digits).")]
Seconds = Annotated[float, Field(gt=0, le=86_400)]
Path = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^/",
                            description="An absolute path inside the sandbox.")]

# What read_file returns at most, by default and at all: tool results travel in one message.
READ_DEFAULT = 1 << 20
READ_LIMIT = 16 << 20


class Arguments(BaseModel):
    """Unknown arguments are refused, so a misspelt one is not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class OnSandbox(Arguments):
    sandbox_id: SandboxId


class CreateSandbox(Arguments):
    image: str = Field("default", min_length=1, max_length=128, description=(
        "Image to start from: 'default' (Debian with python3, numpy, pandas, matplotlib, "
        "scipy, git, gcc), 'host' (the host's root, read-only) or a saved image's name."))
    workspace: str | None = Field(None, max_length=4096, pattern=r"^/", description=(
        "A directory on the daemon's host to mount copy-on-write at the same path; "
        "`commit` later writes the sandbox's changes back into it."))
    internet: bool | None = Field(None, description=(
        "Allow outbound internet access (default: the daemon's setting, usually off)."))
    keep: bool = Field(False, description=(
        "Leave the sandbox running when this MCP session ends (otherwise it is closed)."))


class RunCode(OnSandbox):
    code: str = Field(max_length=1 << 20, description="Python source to run in the REPL.")
    timeout: Seconds | None = Field(None, description=(
        "Interrupt the code after this many seconds (the REPL keeps its state)."))


class Exec(OnSandbox):
    command: str = Field(min_length=1, max_length=1 << 16, description="A shell command line.")
    cwd: Path | None = Field(None, description="Working directory (default: the sandbox's).")
    env: dict[str, str] | None = Field(None, description="Extra environment variables.")
    timeout: Seconds | None = Field(None, description="Kill the command after this many seconds.")


class ReadFile(OnSandbox):
    path: Path
    max_bytes: int = Field(READ_DEFAULT, ge=1, le=READ_LIMIT, description=(
        "Return at most this many bytes (the result says when the file was longer)."))


class WriteFile(OnSandbox):
    path: Path
    content: str = Field(max_length=READ_LIMIT * 2, description="The file's new contents.")
    encoding: Literal["utf-8", "base64"] = Field("utf-8", description=(
        "How `content` is encoded: plain text, or base64 for binary data."))


class ListFiles(OnSandbox):
    path: Path = "/root"


class Fork(OnSandbox):
    n: int = Field(1, ge=1, le=32, description="How many children to make (1 to 32).")
    keep: bool | None = Field(None, description=(
        "Leave the children running when this MCP session ends (default: as the parent)."))


class Diff(OnSandbox):
    other_id: SandboxId = Field(description="The sandbox to compare with.")
    paths: list[Path] | None = Field(None, max_length=64, description=(
        "Directories to compare (default /root and /tmp)."))


class MergeInto(OnSandbox):
    winner_id: SandboxId = Field(description="The child whose state the sandbox takes over.")


class Checkpoint(OnSandbox):
    name: str | None = Field(None, max_length=128, description="A label to recognise it by.")


class Restore(OnSandbox):
    checkpoint_id: str = Field(pattern=r"^cp_[0-9a-f]{32}$", description=(
        "A checkpoint of this sandbox (cp_ + 32 hex digits), as `checkpoint` returned it."))


@dataclass(frozen=True)
class Tool:
    name: str
    arguments: type[Arguments]
    description: str

    def input_schema(self) -> dict[str, Any]:
        return self.arguments.model_json_schema()


TOOLS = [
    Tool("create_sandbox", CreateSandbox,
         "Start a new Linux sandbox with a persistent Python REPL and a shell. Returns its "
         "sandbox_id, which every other tool takes. Fork it to try several approaches side by "
         "side; close it when done."),
    Tool("run_code", RunCode,
         "Run Python in the sandbox's REPL; variables, imports and open files persist between "
         "calls. Returns stdout, stderr, the value of the last expression and, if the code "
         "raised, the exception with its traceback. Matplotlib figures and other images come "
         "back as images."),
    Tool("exec", Exec,
         "Run a shell command in the sandbox (bash -c). Returns stdout, stderr and the exit "
         "code; a non-zero exit code is a result, not an error."),
    Tool("read_file", ReadFile,
         "Read a file from the sandbox. Text comes back as text, images as images, other "
         "binary data as base64."),
    Tool("write_file", WriteFile,
         "Write a file in the sandbox, creating parent directories; replaces an existing file."),
    Tool("list_files", ListFiles,
         "List a directory in the sandbox: each entry's name, type and size."),
    Tool("fork", Fork,
         "Copy the sandbox n ways as it is right now (REPL memory, files, environment) in "
         "milliseconds. The sandbox itself is unchanged. Returns the children's ids: try a "
         "different approach in each, compare them with `diff`, keep the best with "
         "`merge_into`, close the rest."),
    Tool("diff", Diff,
         "Compare the files of two sandboxes (typically siblings from one fork). Returns the "
         "paths added, removed and modified in other_id relative to sandbox_id."),
    Tool("merge_into", MergeInto,
         "Make the sandbox (a fork's parent) take over the state of winner_id, one of its "
         "children: sandbox_id keeps working with the winner's memory and files, and "
         "winner_id is gone. A sibling forked earlier can no longer merge."),
    Tool("commit", OnSandbox,
         "Write the sandbox's changes to its workspace back into the host directory, "
         "atomically. Fails if a sibling committed first."),
    Tool("checkpoint", Checkpoint,
         "Save this instant of the sandbox (REPL memory, files, environment), frozen, so "
         "`restore` can go back to it later. Returns the checkpoint_id. Cheaper than a fork "
         "you do not run anything in."),
    Tool("restore", Restore,
         "Make the sandbox one of its checkpoints again: same sandbox_id, with the memory and "
         "files it had then. The checkpoint stays, so you can restore it again."),
    Tool("close", OnSandbox,
         "Destroy the sandbox and everything running in it. Closing one that is already "
         "gone is not an error."),
]
BY_NAME = {tool.name: tool for tool in TOOLS}
