"""``python -m branchbox``: the same as the ``branchbox`` command."""

from branchbox.cli import app

app(prog_name="branchbox")
