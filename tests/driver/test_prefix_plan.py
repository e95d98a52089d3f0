"""Prefix-aware planning without Ray: grouping, balance, the spill path, plain files, dealing, the ideal."""

from __future__ import annotations

import numpy as np
import pytest

from jobrunner.driver import prefix_plan, prefix_stats
from jobrunner.driver.plan import plan_job
from jobrunner.driver.prefix_dealing import LaneTasks
from jobrunner.driver.prefix_rows import PrefixChains, admission_order
from jobrunner.driver.prefix_stats import add_chains, prefix_summary
from jobrunner.driver.rows import RowRequest
from jobrunner.driver.shards import plan_shards
from jobrunner.driver.tasks import Task
from jobrunner.io import prefix_keys
from jobrunner.io.prefix_keys import KeySorter
from jobrunner.spec import spec_from_dict
from tests.driver.prefix_data import group_of, write_prefix_prompts


def _spec(tmp_path, **input_fields):
    inp = {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt", "id_column": "id",
           "rows_per_shard": 16, **input_fields}
    return spec_from_dict({"name": "p", "input": inp, "output": {"url": str(tmp_path / "out")}})


def _shard_groups(plan, rows):
    order = np.fromfile(plan.prefix.order_local, "<i8")
    out = []
    for shard in plan.shards:
        positions = order[shard.order_offset + shard.row_start:shard.order_offset + shard.row_end]
        out.append([group_of(rows[r][1]) for r in positions.tolist()])
    return order, out


def test_groups_stay_together_and_shards_stay_balanced(tmp_path):
    rows = write_prefix_prompts(tmp_path / "in.parquet", 200, 5)  # 5 groups of 40 rows, shuffled
    plan = plan_job(_spec(tmp_path))
    assert plan.prefix.files_grouped == 1 and plan.prefix.shares_prefixes
    order, groups = _shard_groups(plan, rows)
    assert sorted(order.tolist()) == list(range(200))  # every row in exactly one shard
    assert all(8 <= len(g) <= 24 for g in groups)  # rows_per_shard 16: between 1/2 and 3/2 of it
    assert all(len(set(g)) == 1 for g in groups)  # no shard mixes prefixes
    # a group of 40 is split only as balance needs (40 rows > 24): into 2 shards, adjacent in plan order
    first_shard = {}
    for index, g in enumerate(groups):
        first_shard.setdefault(g[0], []).append(index)
    assert all(len(s) == 2 and s[1] == s[0] + 1 for s in first_shard.values())
    # a shard of a grouped file names the row order; its id differs from a plain range's id
    shard = plan.shards[0]
    assert shard.order_key == plan.prefix.order_key and shard.order_key.startswith("_plan/rows-")
    assert set(plan.shards.columns.shard_id).isdisjoint(set(plan_shards(plan.files, 16).columns.shard_id))


def test_spill_path_gives_the_same_plan(tmp_path, monkeypatch):
    write_prefix_prompts(tmp_path / "in.parquet", 120, 4)
    spec = _spec(tmp_path)
    memory = plan_job(spec)
    monkeypatch.setattr(prefix_keys, "MERGE_BLOCK", 5)
    monkeypatch.setattr(prefix_plan, "SCAN_ROWS", 1)  # keys added a row group (16 rows) at a time
    spilled_table, spilled = prefix_plan.plan_prefix_shards(spec, memory.files, spill_records=7)
    assert spilled.spilled_runs >= 120 // 16 and memory.prefix.spilled_runs == 0
    assert spilled_table == memory.shards
    assert np.array_equal(np.fromfile(spilled.order_local, "<i8"), np.fromfile(memory.prefix.order_local, "<i8"))


def test_key_sorter_merges_runs_in_key_then_row_order(monkeypatch):
    monkeypatch.setattr(prefix_keys, "MERGE_BLOCK", 3)
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 6, 100).astype(np.uint64)  # many ties: the row breaks them
    sorter = KeySorter(spill_records=8)
    for start in range(0, 100, 10):
        sorter.add(keys[start:start + 10], np.arange(start, start + 10))
    assert sorter.num_runs > 5
    merged = np.concatenate(list(sorter.sorted_blocks()))
    assert merged["row"].tolist() == np.lexsort((np.arange(100), keys)).tolist()


def test_plain_files_keep_their_plain_plan(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # no shared prefixes: the plan is exactly the row-range plan (4000 short prompts: 16-bit hashes collide)
    pq.write_table(pa.table({"id": [f"i{i}" for i in range(4000)], "prompt": [f"say {i}" for i in range(4000)]}),
                   tmp_path / "in.parquet", row_group_size=500)
    plan = plan_job(_spec(tmp_path))
    assert plan.prefix.files_grouped == 0 and plan.shards == plan_shards(plan.files, 16)
    # prefixes already contiguous in the file: plain ranges too, but dealt in runs (shares_prefixes)
    heads = [f"{'x' * (i // 25 + 1)} " + "same words here " * 30 + str(i) for i in range(50)]
    pq.write_table(pa.table({"id": [f"i{i}" for i in range(50)], "prompt": heads}), tmp_path / "in.parquet")
    plan = plan_job(_spec(tmp_path))
    assert plan.prefix.files_grouped == 0 and plan.prefix.shares_prefixes
    assert plan.shards == plan_shards(plan.files, 16)
    write_prefix_prompts(tmp_path / "in.parquet", 60, 3)
    off = plan_job(_spec(tmp_path, prefix_grouping="off"))
    assert off.prefix.grouping == "off" and off.shards == plan_shards(off.files, 16)


def test_prefix_column_groups_by_its_value(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = [f"g{i % 3}" for i in range(48)]
    pq.write_table(pa.table({"id": [f"i{i}" for i in range(48)], "prompt": [f"different {i}" for i in range(48)],
                             "prefix": values}), tmp_path / "in.parquet", row_group_size=8)
    plan = plan_job(_spec(tmp_path, prefix_column="prefix", prefix_chars=64))
    order = np.fromfile(plan.prefix.order_local, "<i8")
    for shard in plan.shards:
        assert len({values[r] for r in order[shard.row_start:shard.row_end].tolist()}) == 1
    with pytest.raises(ValueError, match="input.prefix_column"):
        plan_job(_spec(tmp_path, prefix_column="nope"))


def test_lanes_deal_contiguous_runs_and_steal_the_back_half():
    lanes = LaneTasks(list(range(10)), lambda row: Task(str(row), 0, 1), num_lanes=2)
    taken = {"w0": [], "w1": []}
    for owner in ("w0", "w1", "w0", "w1"):
        taken[owner].append(int(lanes.pop(owner).shard_id))
    assert taken == {"w0": [0, 1], "w1": [5, 6]}
    for _ in range(3):  # w1 runs out of its lane (7, 8, 9) ...
        taken["w1"].append(int(lanes.pop("w1").shard_id))
    taken["w1"].append(int(lanes.pop("w1").shard_id))  # ... then steals the back half of w0's (2, 3 | 4)
    assert taken["w1"] == [5, 6, 7, 8, 9, 4]
    assert int(lanes.pop("w0").shard_id) == 2
    assert int(lanes.pop("w9").shard_id) == 3  # a new worker steals what is left
    assert len(lanes) == 0 and len(lanes.drain()) == 0


def test_lanes_drain_returns_every_row_not_handed_out():
    lanes = LaneTasks(np.arange(7), lambda row: Task(str(row), 0, 1), num_lanes=3)
    handed = [int(lanes.pop(w).shard_id) for w in ("a", "b", "c")]
    assert sorted(handed + lanes.drain().tolist()) == list(range(7))


def test_admission_order_puts_shared_prefixes_together(tmp_path):
    reqs = [RowRequest("a", 0, prompt="B x"), RowRequest("b", 1, prompt="A y"), RowRequest("c", 2, prompt="B w"),
            RowRequest("d", 3, prompt=[{"role": "user", "content": "A z"}])]
    spec = _spec(tmp_path)
    assert [r.row_id for r in admission_order(spec, reqs)] == ["b", "c", "a", "d"]
    off = _spec(tmp_path, prefix_grouping="off")
    assert [r.row_id for r in admission_order(off, reqs)] == ["a", "b", "c", "d"]


def test_ideal_counts_every_shared_chain_once_per_job():
    block = 4
    prefix = list(range(8))  # two full blocks shared
    first, second = PrefixChains(), PrefixChains()
    for tail in (100, 101, 102):
        first.add(prefix + [tail, tail + 1], block)  # 10 tokens: (10 - 1) // 4 = 2 cacheable blocks
    second.add(prefix + [200], block)  # one prompt of the prefix in this shard: still counted
    second.add([9, 9, 9, 9, 9], block)  # alone: nothing shared
    manifest = {"totals": {"num_prompt_tokens": 100, "num_cached_tokens": 12}}
    # each shard's commit record: the prompt and cached tokens the ideal then covers (30 + 35 + 35, 8 + 2 + 2)
    add_chains(manifest, first.summary(), block, {"num_prompt_tokens": 30, "num_cached_tokens": 8})
    assert manifest["prefix_cache"]["ideal_cached_tokens"] == 2 * 2 * block  # 2 of 3 prompts hit 2 blocks
    retried = {"num_prompt_tokens": 35, "num_cached_tokens": 2}
    add_chains(manifest, second.summary(), block, retried)
    add_chains(manifest, second.summary(), block, retried)  # a shard counted again: its chains are not new
    assert manifest["prefix_cache"]["covered_prompt_tokens"] == 100
    # the job: 4 prompts share the 2 blocks, computed once: 3 hits of 2 blocks (+ the retried shard's 3 blocks)
    assert manifest["prefix_cache"]["ideal_cached_tokens"] == (3 * 2 + 3) * block
    summary = prefix_summary(manifest)
    assert summary["ideal_hit_rate"] == pytest.approx(0.36) and summary["of_ideal"] == pytest.approx(12 / 36)
    assert not summary["ideal_is_estimate"]


def test_distinct_chains_past_the_exact_limit_are_estimated(monkeypatch):
    monkeypatch.setattr(prefix_stats, "EXACT_CHAINS", 100)
    rng = np.random.default_rng(1)
    hashes = rng.integers(0, 2**63, 20_000, dtype=np.uint64)
    manifest: dict = {}
    for piece in np.array_split(hashes, 10):
        add_chains(manifest, (len(piece) * 2, piece), 16)  # each chain held by 2 prompts
    section = manifest["prefix_cache"]
    assert section["complete"] is False and section["exact_chains"] is None
    assert section["distinct_chains"] == pytest.approx(20_000, rel=0.03)
    assert section["ideal_cached_tokens"] == pytest.approx(20_000 * 16, rel=0.03)


def test_an_old_manifest_is_resumed_with_plain_shards(tmp_path):
    spec = _spec(tmp_path)
    assert prefix_plan.effective_grouping(spec, {"format_version": 3, "job_name": "p"}) == "off"
    assert prefix_plan.effective_grouping(spec, {"format_version": 3, "prefix_plan": {}}) == "auto"
    assert prefix_plan.effective_grouping(spec, None) == "auto"  # a new output
