"""Prefix-grouped jobs on a local Ray with the fake engine: the same rows as plain sharding, resume mid-job,
and an output planned before prefix grouping resumed with its plain shards."""

from __future__ import annotations

import json
import os

import pytest

from jobrunner.driver.job import run_job
from jobrunner.io.parts import read_output
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, read_manifest_file
from tests.driver.prefix_data import group_of, write_prefix_prompts

pytestmark = pytest.mark.timeout(600)
COMPARED = ("id", "generated_text", "finish_reason", "error", "num_prompt_tokens", "num_output_tokens", "topic")


def _rows(url: str) -> list[tuple]:
    table = read_output(url)
    return sorted(zip(*(table.column(c).to_pylist() for c in COMPARED), strict=True))


def _spec(tmp_path, out: str, **input_fields):
    return spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / out), input=input_fields))


def test_grouped_job_writes_the_rows_of_plain_sharding_and_resumes_old_and_new_manifests(local_ray, tmp_path):
    rows = write_prefix_prompts(tmp_path / "in.parquet", 48, 3)
    grouped, plain = _spec(tmp_path, "grouped"), _spec(tmp_path, "plain", prefix_grouping="off")
    assert run_job(grouped, show_progress=False).ok and run_job(plain, show_progress=False).ok
    assert _rows(str(tmp_path / "grouped")) == _rows(str(tmp_path / "plain"))  # ids once, same content
    manifest = read_manifest_file(tmp_path / "grouped")
    assert manifest["prefix_plan"]["files_grouped"] == 1 and manifest["prefix_plan"]["shares_prefixes"]
    assert (tmp_path / "grouped" / manifest["prefix_plan"]["order"]).exists()
    assert manifest["prefix_cache"]["ideal_cached_tokens"] > 0
    assert read_manifest_file(tmp_path / "plain")["prefix_plan"]["grouping"] == "off"
    by_id = {r[0]: r[1] for r in rows}
    table = read_output(str(tmp_path / "grouped"))
    shard_groups: dict[str, set] = {}
    for rid, shard in zip(table.column("id").to_pylist(), table.column("shard_id").to_pylist(), strict=True):
        shard_groups.setdefault(shard, set()).add(group_of(by_id[rid]))
    assert all(len(g) == 1 for g in shard_groups.values())  # each shard holds one prefix

    # Resume mid-job: lose one committed part, mark another shard pending; exactly those two run again.
    out = tmp_path / "grouped"
    shard_ids = sorted(manifest["shards"])
    os.remove(out / manifest["shards"][shard_ids[0]]["part"])
    manifest["shards"][shard_ids[1]]["status"] = "pending"
    (out / "_manifest.json").write_text(json.dumps(manifest))
    assert run_job(grouped, show_progress=False).ok
    after = read_manifest_file(out)
    assert {s for s, e in after["shards"].items() if e["worker_id"].startswith("r1")} == set(shard_ids[:2])
    assert _rows(str(out)) == _rows(str(tmp_path / "plain"))

    # An output planned before prefix grouping existed (no `prefix_plan` in its manifest) resumes with its
    # plain shards, although the spec's default is now `auto` (every shard committed: no worker needed).
    old = tmp_path / "plain"
    manifest = read_manifest_file(old)
    del manifest["prefix_plan"]
    (old / "_manifest.json").write_text(json.dumps(manifest))
    assert run_job(_spec(tmp_path, "plain"), show_progress=False).ok
    after = read_manifest_file(old)
    assert sorted(after["shards"]) == sorted(manifest["shards"]) and after["prefix_plan"]["grouping"] == "off"
    assert after["run_count"] == 2 and _rows(str(old)) == _rows(str(out))
