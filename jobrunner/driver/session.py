"""Connecting to Ray: join the cluster at an address, or start a local instance for one job."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager

import ray

from jobrunner.spec import JobSpec


def _local_num_cpus(spec: JobSpec) -> int:
    need = spec.cluster.num_workers * spec.cluster.num_cpus_per_worker
    return max(math.ceil(need), os.cpu_count() or 1)


@contextmanager
def ray_session(spec: JobSpec, address: str | None = None) -> Iterator[bool]:
    """Ray for the length of a job; yields whether it is a cluster that outlives this process (joined at an
    address, or already initialised) rather than a local Ray started for this job.

    Already initialised (tests, notebooks): use it as is. An address (argument, spec, or RAY_ADDRESS as set
    inside a submitted Ray job): join that cluster. Otherwise start a local Ray sized for the spec.
    """
    if ray.is_initialized():
        yield True
        return
    address = address or spec.cluster.address or os.environ.get("RAY_ADDRESS")
    quiet = dict(logging_level=logging.WARNING, log_to_driver=True)
    if address:
        ray.init(address=address, **quiet)
    else:
        # address="local": always a new instance for this job, never a cluster some other process started on
        # this machine (a bare ray.init() would join the one recorded in /tmp/ray and refuse num_cpus)
        ray.init(address="local", num_cpus=_local_num_cpus(spec), include_dashboard=False, **quiet)
    _no_color_reset_at_exit()
    try:
        yield bool(address)
    finally:
        ray.shutdown()


def _no_color_reset_at_exit() -> None:
    """Ray's bundled colorama (``colorama.init`` in Ray's CLI logger) writes ``\x1b[0m`` to a terminal at
    exit; nothing of ours colours the terminal, so that stray code is dropped."""
    import atexit
    import sys

    initialise = sys.modules.get("colorama.initialise")
    if initialise is not None and hasattr(initialise, "reset_all"):
        atexit.unregister(initialise.reset_all)
