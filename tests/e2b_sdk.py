"""A virtualenv with E2B's published SDKs, pinned, apart from the project's own.

The SDKs are kept out of the ``test`` extra on purpose: they bring a pinned HTTP
stack of their own (a Rust HTTP client, connectrpc, protobuf, h2) that the
daemon's environment should not have to agree with, and a test of "the SDK
unchanged" is most honest when the SDK's environment is its own. The virtualenv
is made once, at ``.venv-e2b`` beside the project's ``.venv``, by the host's pip
(its configured index); a different pin makes a new one.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PINS = ("e2b==2.63.0", "e2b-code-interpreter==2.11.5")
VENV = Path(__file__).resolve().parent.parent / ".venv-e2b"


def sdk_python() -> Path:
    """The virtualenv's python, made (under a lock, for concurrent runs) if missing or
    pinned differently; the test fails with pip's output if the SDKs cannot be installed."""
    python = VENV / "bin" / "python"
    stamp = VENV / "pins.txt"
    wanted = "\n".join(PINS) + "\n"
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{VENV}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists() and stamp.exists() and stamp.read_text() == wanted:
            return python
        shutil.rmtree(VENV, ignore_errors=True)
        for step in ([sys.executable, "-m", "venv", str(VENV)],
                     [str(python), "-m", "pip", "install", "--quiet",
                      "--disable-pip-version-check", *PINS]):
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.fail("could not make the virtualenv of E2B's SDKs "
                            f"({' '.join(step)}):\n{done.stdout}\n{done.stderr}")
        stamp.write_text(wanted)
    return python
