"""`replaykit-workflow bisect` (= `python -m replaykit.workflow bisect`); this path keeps working. See --help."""
# (Not named bisect.py: scripts/ comes first on sys.path and would shadow the standard library's bisect.)

import sys
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # this tree's replaykit, installed or not
from replaykit.workflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["bisect", *sys.argv[1:]]))
