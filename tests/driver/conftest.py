"""Driver fixtures; puts the repo root on sys.path so `tests.driver.*` imports (here and in Ray workers)."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="module")
def local_ray():
    """A small local Ray for the module (2 CPUs, no dashboard)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    # address="local": always a new instance, even while another test's cluster (same machine) has written
    # /tmp/ray/ray_current_cluster, which a bare ray.init() would try to join.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()
