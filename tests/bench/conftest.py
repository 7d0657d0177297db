"""The experiment harness lives at the repository root (``bench/experiments``), outside the package."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
