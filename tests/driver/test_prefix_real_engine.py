"""Prefix-aware sharding measured on the real engine (the tiny random Llama, one worker, a KV cache that holds
about one prefix beside the running rows): grouped shards reuse each shared prefix for all its rows and reach
the job's ideal cached-token count exactly, while plain sharding, whose shards each mix every prefix, computes
the prefixes again in every shard and caches fewer tokens. Same rows, same texts in both."""

from __future__ import annotations

import pytest

from jobrunner.driver.job import run_job
from jobrunner.io.parts import read_output
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import read_manifest_file

pytestmark = pytest.mark.timeout(600)
NUM_ROWS, NUM_GROUPS, ROWS_PER_SHARD = 48, 4, 12


def _write_prompts(path) -> None:
    """Rows of 4 shared prefixes (~180 tokens of the tiny tokenizer; the tiny model's context is 256), shuffled so
    that plain shards of 12 consecutive rows hold every prefix."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    shared = "The quick brown fox jumps over the lazy dog. Hello world! " * 4
    rows = [(f"p{i:04d}", f"{'x' * (i % NUM_GROUPS + 1)} system {i % NUM_GROUPS}: {shared}question {i}")
            for i in range(NUM_ROWS)]
    random.Random(0).shuffle(rows)
    pq.write_table(pa.table({"id": [r[0] for r in rows], "prompt": [r[1] for r in rows],
                             "topic": ["t"] * NUM_ROWS}), str(path), row_group_size=ROWS_PER_SHARD)


def _spec(model_dir, input_url: str, output_url: str, grouping: str) -> dict:
    return {"name": f"prefix-{grouping}",
            "model": {"source": str(model_dir), "dtype": "float32"},
            "input": {"url": input_url, "prompt_column": "prompt", "id_column": "id",
                      "rows_per_shard": ROWS_PER_SHARD, "prefix_grouping": grouping},
            "sampling": {"max_tokens": 2, "temperature": 0.0},
            # 4 rows at once; 24 blocks of 16 tokens: the running rows' blocks and about one more prefix
            "engine": {"max_num_seqs": 4, "num_kv_blocks": 24, "block_size": 16, "speculative": "off"},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 1, "retry_backoff_s": 0.1},
            "output": {"url": output_url, "mode": "resume", "keep_columns": ["topic"]}}


def _run(model_dir, tmp_path, grouping: str) -> tuple[dict[str, dict], dict]:
    out = tmp_path / grouping
    result = run_job(spec_from_dict(_spec(model_dir, str(tmp_path / "in.parquet"), str(out), grouping)),
                     show_progress=False)
    assert result.ok, result.summary()
    rows = {r["id"]: r for r in read_output(str(out)).to_pylist()}
    return rows, read_manifest_file(out)


def test_grouped_shards_reach_the_ideal_cache_hits_and_plain_shards_do_not(local_ray, tiny_llama_hf_dir,
                                                                            tmp_path):
    _write_prompts(tmp_path / "in.parquet")
    grouped, grouped_manifest = _run(tiny_llama_hf_dir, tmp_path, "auto")
    plain, plain_manifest = _run(tiny_llama_hf_dir, tmp_path, "off")

    assert sorted(grouped) == sorted(plain) and len(grouped) == NUM_ROWS
    assert all(r["error"] is None for r in grouped.values()) and all(r["error"] is None for r in plain.values())
    assert {i: r["generated_text"] for i, r in grouped.items()} == {i: r["generated_text"] for i, r in plain.items()}
    prompt_tokens = sum(r["num_prompt_tokens"] for r in grouped.values())
    assert prompt_tokens == sum(r["num_prompt_tokens"] for r in plain.values())

    ideal = grouped_manifest["prefix_cache"]["ideal_cached_tokens"]
    # the ideal is a property of the rows, not of how they were sharded
    assert ideal == plain_manifest["prefix_cache"]["ideal_cached_tokens"] > 0
    grouped_cached = sum(r["num_cached_tokens"] for r in grouped.values())
    plain_cached = sum(r["num_cached_tokens"] for r in plain.values())
    print(f"cached prompt tokens: grouped {grouped_cached}, plain {plain_cached}, ideal {ideal} of {prompt_tokens}")
    assert grouped_manifest["prefix_plan"]["shares_prefixes"]
    assert grouped_cached == ideal, (grouped_cached, ideal)
    # plain shards mix every prefix: each of the 4 shards computes (nearly) each prefix again
    prefix_tokens = ideal // (NUM_ROWS - NUM_GROUPS)  # cached tokens per row beyond a prefix's first row
    assert plain_cached <= ideal - (NUM_ROWS // ROWS_PER_SHARD - 1) * prefix_tokens, (plain_cached, ideal)
    assert grouped_manifest["workers"]["w0"]["num_cached_tokens"] == grouped_cached
    assert plain_manifest["workers"]["w0"]["num_cached_tokens"] == plain_cached
