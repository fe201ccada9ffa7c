"""``python -m replaykit.testing.hazards``: the runner's command line (see :mod:`.runner`)."""

import sys

from .runner import main

if __name__ == "__main__":  # not when a child process imports the parent's main module
    sys.exit(main())
