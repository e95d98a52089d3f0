"""Job and worker metrics for the Ray dashboard and Prometheus, through Ray's metrics API (`ray.util.metrics`).

Ray exports every series on each node's metrics-export port (`ray start --metrics-export-port`, or
`ray.init(_metrics_export_port=...)`), prefixed `ray_` (counters also get `_total`), where the Ray
dashboard's Grafana and any Prometheus scrape them. Every series carries `JobName` (the spec's name); worker
series also `Worker` (the jobrunner worker id), so a query can show one worker or sum a job:

Worker series (tags JobName, Worker): counters jobrunner_rows_done, jobrunner_rows_failed,
jobrunner_prompt_tokens, jobrunner_output_tokens; gauges jobrunner_output_tokens_per_s, jobrunner_queue_depth
(requests in the engine not finished), jobrunner_kv_cache_usage (0..1), jobrunner_prefix_cache_hit_rate; a
histogram jobrunner_shard_seconds. Job series (tag JobName), set by the driver: jobrunner_job_rows_done,
_rows_planned, _rows_failed, _output_tokens_per_s, _workers. The table with meanings is in docs/driver.md.

A worker samples its engine every `JOBRUNNER_METRICS_INTERVAL_S` seconds (default 2) on a daemon thread; the
driver sets the job gauges when it refreshes progress. Metrics never fail a job: a metrics error is logged once.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from jobrunner.kernels.switches import switch
from jobrunner.redaction import redacting_logger

log = redacting_logger(__name__)
WORKER_TAGS = ("JobName", "Worker")  # not "WorkerId": Ray sets that tag itself (its own worker id)
JOB_TAGS = ("JobName",)
SHARD_SECONDS_BOUNDARIES = [1, 5, 15, 30, 60, 120, 300, 600, 1200, 3600]
_instruments: dict[str, Any] = {}
_lock = threading.Lock()


def _metric(kind: str, name: str, description: str, tags: tuple[str, ...]) -> Any:
    """One instrument per process and name (Ray keeps a registry; creating a name twice only warns)."""
    from ray.util import metrics

    with _lock:
        if name not in _instruments:
            if kind == "histogram":
                _instruments[name] = metrics.Histogram(name, description, SHARD_SECONDS_BOUNDARIES, tags)
            else:
                _instruments[name] = getattr(metrics, kind.capitalize())(name, description, tags)
        return _instruments[name]


def interval_s() -> float:
    """Seconds between a worker's samples ($JOBRUNNER_METRICS_INTERVAL_S, default 2)."""
    try:
        return max(0.1, switch("JOBRUNNER_METRICS_INTERVAL_S"))
    except ValueError:
        return 2.0


class WorkerMetrics:
    """A worker's series: engine gauges sampled on a thread, row counters from progress and shard results."""

    def __init__(self, job_name: str, worker_id: str, runner: Any) -> None:
        self.tags = {"JobName": job_name, "Worker": worker_id}
        self.runner = runner
        self.rows_seen = 0  # rows done reported so far (running shards' rows + returned shards' rows)
        self.rows_returned = 0
        self.last: dict[str, float] = {}
        self.last_t = time.monotonic()
        self._stop = threading.Event()
        self._failed = False

    @classmethod
    def start(cls, job_name: str, worker_id: str, runner: Any) -> WorkerMetrics:
        """Create the series and start sampling."""
        metrics = cls(job_name, worker_id, runner)
        threading.Thread(target=metrics._run, name=f"metrics-{worker_id}", daemon=True).start()
        return metrics

    def on_shard(self, result: Any) -> None:
        """A shard (piece) returned by the worker: its error rows and its time."""
        self._safely(self._on_shard, result)

    def stop(self) -> None:
        """Take a last sample and stop the thread."""
        self._stop.set()
        self._safely(self.sample)

    def _on_shard(self, result: Any) -> None:
        self.rows_returned += int(result.rows)
        if result.num_errors:
            _metric("counter", "jobrunner_rows_failed", "Error rows", WORKER_TAGS).inc(result.num_errors, self.tags)
        _metric("histogram", "jobrunner_shard_seconds", "Seconds per shard", WORKER_TAGS).observe(
            float(result.seconds), self.tags)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(interval_s()):
            self._safely(self.sample)

    def sample(self) -> None:
        """Read the engine's stats and the running shards' progress; update every worker series."""
        stats = self.runner.stats()
        live_rows = sum(done[0] for done in self.runner.progress()["shards"].values())  # rows (ShardProgress)
        now = time.monotonic()
        self._count_up("jobrunner_rows_done", "Rows finished", self.rows_returned + live_rows, "rows")
        tokens_in = _first(stats, "num_prompt_tokens", "num_prefill_tokens")
        tokens_out = _first(stats, "num_output_tokens", "num_decode_tokens")
        self._count_up("jobrunner_prompt_tokens", "Prompt tokens", tokens_in, "in")
        self._count_up("jobrunner_output_tokens", "Output tokens", tokens_out, "out")
        decoded = _first(stats, "num_decode_tokens", "num_output_tokens")
        rate = max(decoded - self.last.get("decoded", 0.0), 0.0) / max(now - self.last_t, 1e-6)
        self.last["decoded"], self.last_t = decoded, now
        self._gauge("jobrunner_output_tokens_per_s", "Output tokens per second", rate)
        self._gauge("jobrunner_queue_depth", "Requests in the engine, not finished",
                    float(self.runner.engine.num_unfinished_requests))
        blocks = _first(stats, "kv_num_blocks")
        self._gauge("jobrunner_kv_cache_usage", "Share of KV blocks in use",
                    _first(stats, "kv_blocks_used") / blocks if blocks else 0.0)
        self._gauge("jobrunner_prefix_cache_hit_rate", "Cached / prompt tokens",
                    _first(stats, "prefix_cache_hit_rate") or (_first(stats, "num_cached_tokens") / tokens_in
                                                               if tokens_in else 0.0))

    def _count_up(self, name: str, description: str, value: float, key: str) -> None:
        """Counters only go up: add what `value` gained since the last sample."""
        gained = value - self.last.get(key, 0.0)
        if gained > 0:
            _metric("counter", name, description, WORKER_TAGS).inc(gained, self.tags)
            self.last[key] = value

    def _gauge(self, name: str, description: str, value: float) -> None:
        _metric("gauge", name, description, WORKER_TAGS).set(float(value), self.tags)

    def _safely(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - metrics never fail a worker
            if not self._failed:
                log.warning("jobrunner metrics for %s: %s", self.tags, exc)
            self._failed = True


class JobMetrics:
    """The driver's job-level gauges (tag JobName)."""

    def __init__(self, job_name: str, rows_total: int) -> None:
        self.tags = {"JobName": job_name}
        self.rows_total = rows_total
        self.started = time.monotonic()
        self._failed = False

    def update(self, rows_done: int, rows_failed: int, output_tokens: int, num_workers: int) -> None:
        """Set the job gauges (rows done include rows still in flight; tokens are this run's)."""
        try:
            elapsed = max(time.monotonic() - self.started, 1e-6)
            for name, description, value in (
                    ("jobrunner_job_rows_done", "Rows done (committed + in flight)", rows_done),
                    ("jobrunner_job_rows_planned", "Rows planned", self.rows_total),
                    ("jobrunner_job_rows_failed", "Error rows committed", rows_failed),
                    ("jobrunner_job_output_tokens_per_s", "Output tokens/s of this run", output_tokens / elapsed),
                    ("jobrunner_job_workers", "Workers held by the driver", num_workers)):
                _metric("gauge", name, description, JOB_TAGS).set(float(value), self.tags)
        except Exception as exc:  # noqa: BLE001 - metrics never fail a job
            if not self._failed:
                log.warning("jobrunner job metrics: %s", exc)
            self._failed = True


def _first(stats: dict[str, Any], *keys: str) -> float:
    """The first of `keys` that `stats` holds as a number, else 0."""
    for key in keys:
        value = stats.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.0
