"""The benchmarks are the ``branchbox bench`` command now (``src/branchbox/bench/``);
this runs it with the given arguments, for anyone used to running this file.

    python benchmarks/bench_core.py [--quick] [--only NAME] [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import sys

from branchbox.cli import app

if __name__ == "__main__":
    app(["bench", *sys.argv[1:]])
