"""Per-row seeds (issue 47, symptom 9): with `sampling.seed`, identical prompts in different rows give different
samples (each row's seed is a hash of the job's seed and its id: the same on every retry, resume and worker);
`sampling.seed_per_row: false` keeps one seed for all; `sampling.seed_column` seeds rows outright; a seed a row
asks for itself is kept; the resume check tells the rules apart."""

from __future__ import annotations

import json

import pytest

from jobrunner.driver.resume_check import spec_differences
from jobrunner.driver.row_seeds import row_seed, seed_rule
from jobrunner.driver.rows import job_sampling, request_columns, to_request
from jobrunner.io.reader import ROW_INDEX
from jobrunner.spec import SpecError, spec_from_dict


def _spec(sampling: dict, **inp):
    base = {"url": "x", "prompt_column": "prompt", "id_column": "id"}
    return spec_from_dict({"name": "t", "input": {**base, **inp}, "output": {"url": "o"},
                           "sampling": {"max_tokens": 8, "temperature": 1.0, **sampling}})


def _seeds(spec, rows: list[dict]) -> list[int | None]:
    sampling = job_sampling(spec)
    reqs = [to_request(spec, "f", {ROW_INDEX: i, **row}, sampling) for i, row in enumerate(rows)]
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    return [r.params.seed for r in reqs]


ROWS = [{"id": "a", "prompt": "same"}, {"id": "b", "prompt": "same"}, {"id": "c", "prompt": "other"}]


def test_the_job_seed_is_derived_per_row_from_the_row_id():
    seeds = _seeds(_spec({"seed": 7}), ROWS)
    assert seeds == [row_seed(7, "a"), row_seed(7, "b"), row_seed(7, "c")] and len(set(seeds)) == 3
    assert row_seed(7, "a") == 1787129864792978318  # stable across processes and versions (blake2b, not hash())
    assert _seeds(_spec({"seed": 7}), ROWS[:1]) == seeds[:1]  # a row's seed depends on nothing else
    assert _seeds(_spec({"seed": 8}), ROWS[:1]) != seeds[:1]


def test_one_seed_for_every_row_when_asked_and_none_without_a_seed():
    assert _seeds(_spec({"seed": 7, "seed_per_row": False}), ROWS) == [7, 7, 7]
    assert _seeds(_spec({}), ROWS) == [None, None, None]  # unseeded: the engine's own stream, as before


def test_a_seed_column_is_used_as_written_and_a_null_takes_the_job_rule():
    spec = _spec({"seed": 7, "seed_column": "s"})
    assert "s" in request_columns(spec)
    rows = [{**ROWS[0], "s": 11}, {**ROWS[1], "s": None}, {**ROWS[2], "s": 12.0}]
    assert _seeds(spec, rows) == [11, row_seed(7, "b"), 12]
    bad = to_request(spec, "f", {ROW_INDEX: 0, **ROWS[0], "s": "eleven"}, job_sampling(spec))
    assert bad.error == "sampling.seed_column 's': row 'a' has 'eleven', not an integer seed in 0..2**63-1"
    assert to_request(spec, "f", {ROW_INDEX: 0, **ROWS[0], "s": -1}, job_sampling(spec)).error.startswith(
        "sampling.seed_column 's': row 'a' has -1")


def test_a_seed_the_row_asks_for_is_kept():
    spec = _spec({"seed": 7}, sampling_column="over")
    rows = [{**ROWS[0], "over": json.dumps({"seed": 3})}, {**ROWS[1], "over": json.dumps({"max_tokens": 2})}]
    assert _seeds(spec, rows) == [3, row_seed(7, "b")]


def test_seed_settings_are_checked_where_the_spec_is():
    with pytest.raises(SpecError, match="sampling.seed_per_row"):
        _spec({"seed": 7, "seed_per_row": "sometimes"})
    with pytest.raises(SpecError, match="seed_column does not apply to input.format openai_batch"):
        spec_from_dict({"name": "t", "input": {"url": "x.jsonl", "format": "openai_batch"},
                        "output": {"url": "o"}, "sampling": {"seed_column": "s"}})


def test_resume_tells_the_seed_rules_apart():
    """An output written before seed_per_row existed, with a seed, seeded every row alike: resuming it with
    the new default would mix two rules in one output, so the check names the field; without a seed the
    setting changes nothing and an old output resumes."""
    old_seeded = {"sampling": {"seed": 7, "max_tokens": 8}}
    new = _spec({"seed": 7, "max_tokens": 8}).redacted()
    assert seed_rule(old_seeded["sampling"]) == "job" and seed_rule(new["sampling"]) == "per row"
    assert ("sampling.seed_per_row", "job", "per row") in spec_differences(old_seeded, new)
    kept = _spec({"seed": 7, "max_tokens": 8, "seed_per_row": False}).redacted()
    assert [d for d in spec_differences(old_seeded, kept) if "seed" in d[0]] == []
    unseeded_old = {"sampling": {"max_tokens": 8}}
    assert [d for d in spec_differences(unseeded_old, _spec({"max_tokens": 8}).redacted())
            if "seed" in d[0]] == []


# ---- on the real engine -----------------------------------------------------------------------------------
def _job(model_dir, tmp_path, name: str, sampling: dict, rows_per_shard: int = 12, max_num_seqs: int = 4):
    from jobrunner.driver.job import run_job
    from jobrunner.io.parts import read_output

    spec = {"name": name, "model": {"source": str(model_dir), "dtype": "float32"},
            "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt", "id_column": "id",
                      "rows_per_shard": rows_per_shard},
            "sampling": {"max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True, **sampling},
            "engine": {"max_num_seqs": max_num_seqs, "deterministic": True, "speculative": "off"},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 1, "retry_backoff_s": 0.1},
            "output": {"url": str(tmp_path / name), "mode": "overwrite"}}
    result = run_job(spec_from_dict(spec), show_progress=False)
    assert result.ok, result.summary()
    return {r["id"]: r["generated_text"] for r in read_output(str(tmp_path / name)).to_pylist()}


@pytest.mark.timeout(600)
def test_identical_prompts_differ_per_row_and_each_row_is_reproducible(local_ray, tiny_llama_hf_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = [f"prompt number {i % 4}" for i in range(12)]  # 4 prompts, 3 rows each
    pq.write_table(pa.table({"id": [f"r{i:02d}" for i in range(12)], "prompt": prompts}), tmp_path / "in.parquet")
    per_row = _job(tiny_llama_hf_dir, tmp_path, "per-row", {})
    groups = [{per_row[f"r{i:02d}"] for i in range(g, 12, 4)} for g in range(4)]
    assert [len(g) for g in groups] == [3, 3, 3, 3]  # no two rows of one prompt alike
    # the same rows in other shards and batches (a retry, a resume on another worker): the same texts
    assert _job(tiny_llama_hf_dir, tmp_path, "per-row-again", {}, rows_per_shard=4, max_num_seqs=2) == per_row
