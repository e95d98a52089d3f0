"""Driver test helpers: make `tests.driver.fake_engine` importable here and in Ray workers."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
