"""`jobrunner status` figures from a manifest, commit records and a lease written to disk the way the driver
writes them (a run in progress, a run whose driver died, old and new lease formats)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from jobrunner.cli import main
from jobrunner.io.report_reader import read_output_state
from jobrunner.reports import status as status_module
from jobrunner.reports.status import job_status

# "now" for every figure, in whole seconds as the manifest and the lease write their times; `jobrunner status`
# reads the same instant through a fake clock, so ages, rates and ETAs are exact.
NOW_S = 1_800_000_000.0


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(status_module, "time", SimpleNamespace(time=lambda: NOW_S))
    return NOW_S


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).isoformat(timespec="seconds")


def _output(root: Path, now: float, lease: dict | None) -> str:
    """8 shards of 10 rows (n=2 samples): 2 committed in the manifest, 1 more as a commit record."""
    shards = {f"s{i}": {"status": "pending", "row_start": 10 * i, "row_end": 10 * i + 10, "rows": 0}
              for i in range(8)}
    for i in (0, 1):
        shards[f"s{i}"] = {**shards[f"s{i}"], "status": "committed", "rows": 20, "num_errors": 2 * i,
                           "num_prompt_tokens": 300, "num_cached_tokens": 60, "num_output_tokens": 400,
                           "worker_id": "r1w0", "error_kinds": {"prompt too long": 2 * i}}
    manifest = {"format_version": 2, "job_name": "nightly", "run_count": 2, "spec": {"sampling": {"n": 2}},
                "model": {"source": "m", "dtype": "bfloat16"}, "started_at": _iso(now - 3600),
                "current_run": {"run_index": 1, "started_at": _iso(now - 40), "rows_at_start": 20,
                                "output_tokens_at_start": 400},
                "shards": shards, "workers": {"w0": {"device": "cpu"}}, "totals": {}}
    root.mkdir(parents=True)
    (root / "_manifest.json").write_text(json.dumps(manifest))
    (root / "_commits").mkdir()
    record = {"shard_id": "s2", **shards["s2"], "status": "committed", "rows": 20, "num_errors": 1,
              "num_output_tokens": 400, "worker_id": "r1w1", "error_kinds": {"engine rejected": 1}}
    (root / "_commits" / "s2.json").write_text(json.dumps(record))
    if lease is not None:
        (root / "_lease.json").write_text(json.dumps(lease))
    return str(root)


def test_a_running_output(tmp_path: Path, frozen_clock: float) -> None:
    now = frozen_clock
    lease = {"run_id": "abc123", "host": "head-1", "pid": 4242, "job_name": "nightly", "generation": 7,
             "heartbeat_at": _iso(now - 5), "expires_at": _iso(now + 55), "expires_at_s": now + 55, "ttl_s": 60}
    status = job_status(read_output_state(_output(tmp_path / "out", now, lease)), now_s=now)
    assert status["state"] == "running" and status["rows"]["total"] == 160 and status["rows"]["done"] == 60
    assert status["rows"]["errors"] == 3 and status["rows"]["error_share"] == 3 / 60
    assert status["rows"]["top_error_kinds"] == {"prompt too long": 2, "engine rejected": 1}
    assert status["counts"] == {"prompts_done": 30, "prompts_total": 80, "samples_done": 60, "samples_total": 160,
                                "n": 2}
    # this run: 20 prompts (40 rows) and 800 output tokens in 40 s; 50 prompts left at 0.5 prompts/s
    assert status["speed"] == {"basis": "this run so far (committed shards)", "elapsed_s": 40.0, "prompts_per_s": 0.5,
                               "tokens_per_s": 20.0, "tokens_window_s": None, "tokens_kind": "out", "eta_s": 100.0}
    assert status["workers"]["ids"] == ["r1w0", "r1w1"] and status["commit_records_pending"] == 1
    assert status["lease"]["generation"] == 7 and status["lease"]["heartbeat_age_s"] == 5.0
    assert status["lease"]["expires_in_s"] == 55.0 and not status["lease"]["expired"]
    result = CliRunner().invoke(main, ["status", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "done     prompts 30/80 · samples 60/160 committed (37%)\n" in result.output
    assert "errors   3 error rows (5.0% of the rows written)" in result.output
    assert "speed    20.0 out tok/s, 0.50 prompts/s (this run so far (committed shards), 40 s)" in result.output
    assert "ETA      1m40s\n" in result.output
    assert f"run abc123 on head-1 (pid 4242), generation 7, last heartbeat {_iso(now - 5)} (5 s ago)" in result.output
    assert "error    2 x prompt too long" in result.output


def test_a_running_drivers_heartbeat_counts_rows_inside_running_shards(tmp_path: Path,
                                                                        frozen_clock: float) -> None:
    # the driver's last heartbeat (10 s ago): 100 rows done (40 of them in shards still running), 2,000 output
    # tokens this run; committed shards alone say 60 rows
    now = frozen_clock
    progress = {"phase": "running", "run_index": 1, "rows_done": 100, "rows_total": 160,
                "output_tokens_this_run": 2000, "workers": 2, "at": _iso(now - 10)}
    lease = {"run_id": "abc123", "host": "head-1", "pid": 4242, "generation": 7, "heartbeat_at": _iso(now - 10),
             "ttl_s": 60, "progress": progress}
    status = job_status(read_output_state(_output(tmp_path / "out", now, lease)), now_s=now)
    assert (status["rows"]["done"], status["rows"]["total"], status["tokens"]["output"]) == (100, 160, 2400)
    # an older driver's heartbeat (rows only): 50 prompts; this run 40 prompts and 2,000 tokens in the 30 s from
    # its start to the heartbeat; 30 prompts left
    assert status["speed"] == {"basis": "this run so far (the driver's count)", "elapsed_s": 30.0,
                               "prompts_per_s": 40 / 30, "tokens_per_s": 2000 / 30, "tokens_window_s": None,
                               "tokens_kind": "out", "eta_s": 22.5}
    text = CliRunner().invoke(main, ["status", str(tmp_path / "out")]).output
    assert ("prompts 50/80 · samples 100/160 (62%) [the driver's count, 10 s ago: committed rows and rows "
            "finished in running shards]") in text
    assert "2 in run 2: r1w0, r1w1" in text and ", run 2" in text  # one run number: 1-based everywhere
    starting = {**progress, "phase": "starting workers", "rows_done": 60, "output_tokens_this_run": 0}
    (tmp_path / "out" / "_lease.json").write_text(json.dumps({**lease, "progress": starting}))
    text = CliRunner().invoke(main, ["status", str(tmp_path / "out")]).output
    assert "state    running (starting workers)" in text


def test_a_released_lease_has_one_expiry_verdict(tmp_path: Path, frozen_clock: float) -> None:
    now = frozen_clock
    lease = {"run_id": "abc", "host": "h", "pid": 1, "generation": 3, "heartbeat_at": _iso(now - 5), "ttl_s": 120,
             "state": "released"}
    status = job_status(read_output_state(_output(tmp_path / "out", now, lease)), now_s=now)
    assert status["lease"]["expired"] and status["lease"]["expires_in_s"] is None


def test_a_dead_drivers_lease_is_stale_and_an_old_lease_format_still_reads(tmp_path: Path,
                                                                          frozen_clock: float) -> None:
    now = frozen_clock
    old = {"run_id": "zzz", "host": "h", "pid": 1, "heartbeat_at": _iso(now - 600)}  # no expiry, no generation
    status = job_status(read_output_state(_output(tmp_path / "out", now, old)), now_s=now)
    assert status["state"] == "stale" and status["lease"]["expired"] and status["lease"]["generation"] is None
    assert status["speed"]["eta_s"] is None
    result = CliRunner().invoke(main, ["status", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["state"] == "stale"
    text = CliRunner().invoke(main, ["status", str(tmp_path / "out")]).output
    assert "stale: the lease expired" in text and f"last heartbeat {_iso(now - 600)} (600 s ago), n/a" in text


def test_status_shows_the_counts_and_eta_of_the_drivers_log(tmp_path: Path, frozen_clock: float) -> None:
    """The heartbeat carries what the driver's log line said (progress_view.py): status prints the same
    counts, and the ETA the driver gave less the time since."""
    now = frozen_clock
    counts = {"prompts_done": 13, "prompts_total": 80, "samples_done": 26, "samples_total": 160, "n": 2}
    progress = {"phase": "running", "run_index": 1, "counts": counts, "tokens_this_run": 900, "tokens_kind": "out",
                "eta_s": 50.0, "tokens_per_s": 41.5, "rows_done": 26, "rows_total": 160, "output_tokens_this_run": 900,
                "workers": 1, "at": _iso(now - 12)}
    lease = {"run_id": "abc123", "host": "head-1", "pid": 4242, "generation": 7, "heartbeat_at": _iso(now - 12),
             "ttl_s": 60, "progress": progress}
    status = job_status(read_output_state(_output(tmp_path / "out", now, lease)), now_s=now)
    # the committed shards hold more than the heartbeat had seen: counts never go back
    assert status["counts"] == {"prompts_done": 30, "prompts_total": 80, "samples_done": 60, "samples_total": 160,
                                "n": 2}
    assert status["speed"]["eta_s"] == 38.0 and status["counts_basis"] == "the driver's count"
    text = CliRunner().invoke(main, ["status", str(tmp_path / "out")]).output
    assert "prompts 30/80 · samples 60/160 (37%) [the driver's count, 12 s ago" in text
    assert "ETA      38s (the driver's estimate, less the time since)" in text
    assert ("speed    41.5 out tok/s (the driver's, over its last 30 s), 0.71 prompts/s (this run so far (the driver's "
            "count), 28 s)") in text


def test_a_stopped_embed_output_counts_committed_rows_and_input_tokens(tmp_path: Path, frozen_clock: float) -> None:
    now = frozen_clock
    root = Path(_output(tmp_path / "out", now, None))
    manifest = json.loads((root / "_manifest.json").read_text())
    manifest.update(spec={"task": "embed", "sampling": {"n": 2}}, wall_s=10.0)  # n is generation's only
    for shard in ("s0", "s1"):
        manifest["shards"][shard]["rows"] = 10  # one row (an embedding) per prompt
    (root / "_manifest.json").write_text(json.dumps(manifest))
    record = json.loads((root / "_commits" / "s2.json").read_text())
    (root / "_commits" / "s2.json").write_text(json.dumps({**record, "rows": 10}))
    status = job_status(read_output_state(str(root)), now_s=now)
    assert status["state"] == "incomplete" and status["counts"]["n"] == 1
    assert status["speed"]["tokens_kind"] == "in" and status["speed"]["tokens_per_s"] == 60.0  # 600 prompt tokens
    text = CliRunner().invoke(main, ["status", str(root)]).output
    assert "done     rows 30/80 committed (37%)\n" in text
    assert "60.0 in tok/s, 3.00 rows/s (whole job (its runs' wall time), 10 s)" in text
    assert "compacted" not in text and "compaction" not in text


def _tp_manifest(now: float) -> dict:
    """A finished TP = 2 job on one worker of two ranks (the record driver/manifest.record_worker writes)."""
    ranks = [{"rank": r, "node": "vm", "pid": 100 + r, "device": "cpu", "cores": [r], "weights_bytes": 2_500_000}
             for r in (0, 1)]
    return {"format_version": 2, "job_name": "tp", "run_count": 1, "spec": {"sampling": {"n": 1}},
            "model": {"source": "m", "dtype": "float32", "tensor_parallel_size": 2, "tensor_parallel_rank": 0,
                      "rank_weights_bytes": 2_500_000, "rank_kv_bytes": 4_194_304},
            "started_at": _iso(now - 60), "finished_at": _iso(now - 10),
            "shards": {"s0": {"status": "committed", "row_start": 0, "row_end": 4, "rows": 4, "worker_id": "w0",
                              "num_output_tokens": 32}},
            "workers": {"w0": {"device": "cpu", "node": "vm", "tensor_parallel_size": 2, "ranks": ranks}},
            "totals": {}}


def test_status_shows_a_tensor_parallel_workers_ranks(tmp_path: Path, frozen_clock: float) -> None:
    root = tmp_path / "out"
    root.mkdir()
    (root / "_manifest.json").write_text(json.dumps(_tp_manifest(frozen_clock)))
    status = job_status(read_output_state(str(root)), now_s=frozen_clock)
    assert status["workers"]["ranks"] == {"w0": {"count": 2, "devices": {"cpu": 2}, "cores": [[0], [1]],
                                                 "weights_bytes": [2_500_000, 2_500_000]}}
    result = CliRunner().invoke(main, ["status", str(root)])
    assert result.exit_code == 0, result.output
    assert "1 in run 1: w0 (2 ranks x cpu, cores [0] [1]) on vm\n" in result.output
