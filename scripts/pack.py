"""`replaykit-workflow pack` from a checkout (the package root imports no torch). See --help."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replaykit.workflow import archive  # noqa: E402 - after the checkout is on the path

if __name__ == "__main__":
    sys.exit(archive.main(["--repo", str(ROOT), *sys.argv[1:]], prog="scripts/pack.py"))
