"""`replaykit-workflow verify` (= `python -m replaykit.workflow verify`); this path keeps working. See --help."""

import sys
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # this tree's replaykit, installed or not
from replaykit.workflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["verify", *sys.argv[1:]]))
