"""Run records (io/run_records.py): folded into a manifest, each run's workers priced, redone work apart."""

from __future__ import annotations

import json

import pytest

from jobrunner.io.run_records import (
    KILLED,
    cost_totals,
    fold_run_records,
    lost_worker_seconds,
    read_run_records,
    run_record_key,
    write_run_record,
)
from jobrunner.io.storage import Storage
from jobrunner.prefix_view import ideal_over_covered


def _record(index: int, status: str, workers: dict, **figures) -> dict:
    worker_seconds = sum(w["startup_s"] + w["alive_s"] for w in workers.values())
    startup = sum(w["startup_s"] for w in workers.values())
    return {"run_index": index, "status": status, "started_at": f"2026-12-06T00:0{index}:00+00:00",
            "wall_s": 10.0 + index, "worker_seconds": worker_seconds, "startup_seconds": startup,
            "workers": workers, **figures}


def test_a_stopped_run_missing_from_the_manifest_is_folded_in_and_priced(tmp_path):
    storage = Storage(str(tmp_path))
    first = _record(0, "interrupted", {"w0": {"startup_s": 20.0, "alive_s": 18.0}},
                    rows_committed=60, output_tokens_committed=3000, output_tokens_sampled=4000)
    second = _record(1, "finished", {"r1w0": {"startup_s": 22.0, "alive_s": 52.0}},
                     rows_committed=120, output_tokens_committed=6000, output_tokens_sampled=6000)
    write_run_record(storage, first)
    write_run_record(storage, second)
    assert run_record_key(1) == "_runs/run-000001.json"
    assert [r["run_index"] for r in read_run_records(storage)] == [0, 1]
    # the manifest as the second run's compactions left it: its own run only, its own worker only
    manifest = {"runs": [{"run_index": 1, "status": "finished", "wall_s": 11.0, "worker_seconds": 74.0,
                          "startup_seconds": 22.0}],
                "workers": {"r1w0": {"startup_s": 22.0, "alive_s": 52.0}}, "totals": {"rows": 180}}
    assert fold_run_records(manifest, read_run_records(storage)) == 1
    assert [r["run_index"] for r in manifest["runs"]] == [1, 0]
    assert sorted(manifest["workers"]) == ["r1w0", "w0"]
    # 38 s of the first run, 74 s of the second; the first run's 18 busy seconds made 3000 of 4000 tokens it
    # committed: a quarter of them (4.5 s) was paid for work redone by the second run
    assert manifest["totals"] == {"rows": 180, "worker_seconds": 112.0, "startup_seconds": 42.0,
                                  "lost_worker_seconds": 4.5, "num_runs": 2}
    assert manifest["wall_s"] == 21.0
    assert fold_run_records(manifest, read_run_records(storage)) == 0  # folding again changes nothing
    assert manifest["totals"]["worker_seconds"] == 112.0


def test_a_workers_longer_figures_win(tmp_path):
    manifest = {"runs": [], "workers": {"w0": {"startup_s": 5.0, "alive_s": 3.0}}}
    fold_run_records(manifest, [_record(0, "running", {"w0": {"startup_s": 5.0, "alive_s": 9.0}})])
    assert manifest["workers"]["w0"]["alive_s"] == 9.0
    fold_run_records(manifest, [_record(0, "running", {"w0": {"startup_s": 5.0, "alive_s": 4.0}})])
    assert manifest["workers"]["w0"]["alive_s"] == 9.0


@pytest.mark.parametrize(("run", "lost"), [
    ({"status": "running", "worker_seconds": 50, "startup_seconds": 10, "output_tokens_sampled": 10}, 0.0),
    ({"status": KILLED, "worker_seconds": 50, "startup_seconds": 10, "output_tokens_sampled": 400,
      "output_tokens_committed": 300}, 10.0),
    ({"status": "finished", "worker_seconds": 50, "startup_seconds": 10, "output_tokens_sampled": 400,
      "output_tokens_committed": 400}, 0.0),
    # nothing committed and no sampled count (an engine that does not count): all busy time lost
    ({"status": KILLED, "worker_seconds": 50, "startup_seconds": 10}, 40.0),
    ({"status": "finished", "worker_seconds": 50, "startup_seconds": 10, "rows_committed": 3}, 0.0),
    ({"wall_s": 3.0}, 0.0),  # a run entry written before run records
])
def test_lost_worker_seconds(run, lost):
    assert lost_worker_seconds(run) == lost


def test_cost_totals_of_an_old_manifest():
    manifest = {"runs": [{"wall_s": 3.0}], "workers": {"w0": {"startup_s": 2.5, "alive_s": 7.5}}}
    assert cost_totals(manifest) == {"worker_seconds": 10.0, "startup_seconds": 2.5, "lost_worker_seconds": 0.0,
                                     "num_runs": 1}


def test_unreadable_records_are_skipped(tmp_path):
    storage = Storage(str(tmp_path))
    storage.write_atomic("_runs/run-000000.json", b"{not json")
    storage.write_atomic("_runs/run-000001.json", json.dumps({"run_index": "x"}).encode())
    write_run_record(storage, _record(2, "finished", {}))
    assert [r["run_index"] for r in read_run_records(storage)] == [2]


@pytest.mark.parametrize(("section", "expected"), [
    # the ideal over the shards it counted, not over every row (a killed run's chains were lost)
    ({"ideal_cached_tokens": 688, "covered_prompt_tokens": 3000, "covered_cached_tokens": 600}, (3000, 600, 688)),
    # an estimate below what was achieved: the ideal is at least the hits
    ({"ideal_cached_tokens": 500, "covered_prompt_tokens": 3000, "covered_cached_tokens": 600}, (3000, 600, 600)),
    # written before covered_*: the job's totals, the ideal no lower than the hits
    ({"ideal_cached_tokens": 688}, (5129, 928, 928)),
])
def test_prefix_ideal_never_below_the_hits(section, expected):
    assert ideal_over_covered(section, {"num_prompt_tokens": 5129, "num_cached_tokens": 928}) == expected
