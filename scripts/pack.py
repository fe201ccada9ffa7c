"""`replaykit-workflow pack` without importing torch or replaykit: archive.py is loaded by path. See --help."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("replaykit_archive", ROOT / "replaykit" / "workflow" / "archive.py")
archive = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
spec.loader.exec_module(archive)

if __name__ == "__main__":
    sys.exit(archive.main(["--repo", str(ROOT), *sys.argv[1:]], prog="scripts/pack.py"))
