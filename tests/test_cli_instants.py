"""The CLI's pause, resume, checkpoint and restore against a served daemon; ``ls`` shows
the state."""

from __future__ import annotations

import os

from served import ServedDaemon
from typer.testing import CliRunner

from branchbox import Sandbox
from branchbox.cli import app

KEY = "cli-instants-key"


def test_pause_resume_checkpoint_restore_from_the_command_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != "BRANCHBOX_API_KEY"}
    daemon = ServedDaemon("cli13", {**env, "BRANCHBOX_API_KEY": KEY})
    cli_env = {"BRANCHBOX_URL": daemon.url, "BRANCHBOX_API_KEY": KEY}
    runner = CliRunner()

    def cli(*args: str) -> str:
        result = runner.invoke(app, list(args), env=cli_env)
        assert result.exit_code == 0, result.output
        return result.output

    try:
        sb = Sandbox(url=daemon.url, api_key=KEY)
        sb.run_code("v = 'first'")
        assert cli("pause", sb.id).strip() == "paused"
        assert any(sb.id in line and "paused" in line for line in cli("ls").splitlines())
        assert cli("resume", sb.id).strip() == "ready"
        cp = cli("checkpoint", sb.id, "--name", "first").strip()
        assert cp.startswith("cp_")
        sb.run_code("v = 'second'")
        cli("restore", sb.id, cp)
        assert sb.run_code("v").text == "'first'"
        refused = runner.invoke(app, ["restore", sb.id, "cp_unknown"], env=cli_env)
        assert refused.exit_code == 1 and "not found" in refused.output
        sb.close()
    finally:
        daemon.stop()
