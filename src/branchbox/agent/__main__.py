"""``python3 -m bbagent <fd>``: run the agent on control socket ``fd``."""

from __future__ import annotations

import sys

from .main import run

if __name__ == "__main__":
    run(int(sys.argv[1]))
