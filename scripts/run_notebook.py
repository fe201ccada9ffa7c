"""`replaykit-workflow run` (= `python -m replaykit.workflow run`); this path keeps working. See --help."""

import sys
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # this tree's replaykit, installed or not
from replaykit.workflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
