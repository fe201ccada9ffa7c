"""``python -m replaykit.workflow COMMAND ...``: see ``replaykit.workflow.cli``."""

import sys

from replaykit.workflow.cli import main

sys.exit(main())
