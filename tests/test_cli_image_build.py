"""``branchbox image build`` end to end: the real CLI against a real daemon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sdk_sandbox import cli, connected, daemon  # noqa: F401 - fixtures, shared

pytestmark = pytest.mark.usefixtures("connected")


def test_image_build_shows_steps_and_a_failing_steps_output(tmp_path: Path) -> None:
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "note.txt").write_text("from the context\n")
    spec = tmp_path / "Spec"
    spec.write_text("FROM default\nCOPY note.txt /srv/\nRUN cat /srv/note.txt\n")
    built = cli("image", "build", "cli-built", "-f", str(spec), "--context",
                str(tmp_path / "ctx"))
    assert built.returncode == 0, built.stderr
    assert "step 2/3: COPY" in built.stderr and "from the context" in built.stderr
    assert built.stdout.startswith("built cli-built in ")
    again = cli("image", "build", "cli-built-2", "-f", str(spec), "--context",
                str(tmp_path / "ctx"))
    assert "step 3/3: RUN cat /srv/note.txt (cached)" in again.stderr

    spec.write_text("FROM default\nRUN echo 'the cause is here'; exit 7\n")
    failed = cli("image", "build", "cli-failed", "-f", str(spec))
    assert failed.returncode == 1
    assert "error: step 2/2 RUN echo 'the cause is here'; exit 7: exited with status 7" in (
        failed.stderr)
    assert failed.stderr.count("the cause is here") >= 2  # as it ran, and in the error
    names = [i["name"] for i in json.loads(cli("image", "ls", "--json").stdout)]
    assert "cli-failed" not in names and {"cli-built", "cli-built-2"} <= set(names)
    for name in ("cli-built", "cli-built-2"):
        assert cli("image", "rm", name).returncode == 0
