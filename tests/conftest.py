"""Puts the repository root on sys.path, so every test can import `tests.*` (tests/tiny_hf.py) and
`devtools.*` (devtools/torchrun.py, the launcher) whatever pytest's import mode and however pytest was
started."""
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:
    sys.path.insert(0, REPO)
