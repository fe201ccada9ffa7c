"""Run round 5's scenarios with round 1's runner (one child process each, the verdict table).

    python scripts/hostile/round5/run.py [names...] [--timeout 120] [--json out.json]

The runner and harness are ``scripts/hostile/single``'s; only the scenarios module differs, so
this file puts round 5 first on the path and has the children start here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SINGLE = HERE.parent / "single"

spec = importlib.util.spec_from_file_location("single_run", SINGLE / "run.py")
single_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(single_run)  # puts single/ and the tree root on sys.path
sys.path.insert(0, str(HERE))  # round 5's scenarios.py before round 1's
single_run.__file__ = __file__  # children run this file, so they import round 5's scenarios

if __name__ == "__main__":
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the children inherit it: one core each
    sys.exit(single_run.main(sys.argv[1:]))
