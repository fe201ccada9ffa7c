"""Jupyter started from this folder saves notebooks without outputs (they are tracked files)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replaykit.workflow.nbclean import pre_save_hook

c = get_config()  # noqa: F821 - provided by Jupyter when it loads this file
c.FileContentsManager.pre_save_hook = pre_save_hook
