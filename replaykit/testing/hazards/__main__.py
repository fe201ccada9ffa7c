"""``python -m replaykit.testing.hazards``: the runner's command line (see :mod:`.runner`)."""

import sys

from .runner import main

sys.exit(main())
