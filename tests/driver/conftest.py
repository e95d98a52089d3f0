"""Driver fixtures; puts the repo root on sys.path so `tests.driver.*` imports (here and in Ray workers). The
`local_ray` fixture is shared by the whole suite: tests/conftest.py."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
