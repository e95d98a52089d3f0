"""Connecting to Ray: join the cluster at an address, or start a local instance for one job."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ray

from jobrunner.models.sources import cache_root
from jobrunner.redaction import redacting_logger
from jobrunner.spec import JobSpec

# Ray logs "Token authentication is enabled for this Ray cluster ..." on every ray.init that starts a local
# instance or joins one with a token: a nightly log would carry it every night. It is let through once per
# machine (a marker in jobrunner's cache); the warning that authentication is *disabled* always passes.
_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"
_TOKEN_NOTICE = "Token authentication is enabled"
_TOKEN_MARKER = "ray-token-notice-shown"


class TokenNoticeOnce(logging.Filter):
    """Pass Ray's token-authentication-enabled notice the first time on this machine, then drop it."""

    def __init__(self, marker: Path) -> None:
        super().__init__()
        self.marker = marker

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_TOKEN_NOTICE):
            return True
        if self.marker.exists():
            return False
        try:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text("Ray's token authentication notice was shown on this machine\n")
        except OSError:
            pass  # a read-only cache: the notice shows every time, as Ray would
        return True


def fold_token_notice(marker: Path | None = None) -> None:
    """Install :class:`TokenNoticeOnce` on Ray's authentication logger (once per process)."""
    logger = redacting_logger(_TOKEN_LOGGER)  # Ray's logger, its records also scrubbed like ours
    if not any(isinstance(f, TokenNoticeOnce) for f in logger.filters):
        logger.addFilter(TokenNoticeOnce(marker or cache_root() / _TOKEN_MARKER))


def group_fit_problem(spec: JobSpec, node: dict[str, float]) -> str | None:
    """Why one placement-group worker (tensor-parallel ranks, or vLLM over TP x PP GPUs: driver/rank_group.py)
    can never be placed on a node with ``node``'s resources (STRICT_PACK: all its bundles on one node); None if
    it fits, or if the worker needs no placement group."""
    from jobrunner.driver.engine_factory import is_rank_group
    from jobrunner.driver.rank_group import rank_placement, vllm_placement

    placement = rank_placement(spec) if is_rank_group(spec) else vllm_placement(spec)
    if placement is None:
        return None
    need = {k: sum(b.get(k, 0.0) for b in placement.bundles) for k in ("CPU", "GPU")}
    short = {k: v for k, v in need.items() if v > node.get(k, 0.0) + 1e-9}
    if not short:
        return None
    e = spec.engine
    return (f"engine.tensor_parallel_size={e.tensor_parallel_size} x pipeline_parallel_size="
            f"{e.pipeline_parallel_size}: one worker's placement group needs "
            + ", ".join(f"{v:g} {k}" for k, v in short.items())
            + " on one node; this machine's local Ray has "
            + ", ".join(f"{node.get(k, 0.0):g} {k}" for k in short))


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
    fold_token_notice()
    if address:
        ray.init(address=address, **quiet)
    else:
        # address="local": always a new instance for this job, never a cluster some other process started on
        # this machine (a bare ray.init() would join the one recorded in /tmp/ray and refuse num_cpus)
        ray.init(address="local", num_cpus=_local_num_cpus(spec), include_dashboard=False, **quiet)
    _no_color_reset_at_exit()
    try:
        problem = None if address else group_fit_problem(spec, ray.cluster_resources())
        if problem is not None:  # a local Ray never grows: waiting for worker_start_timeout_s would be for nothing
            raise RuntimeError(problem)
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
