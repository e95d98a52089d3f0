"""Every committed job spec loads, plans and turns every row into a request; the spec and docs/driver.md's key
table list the same keys."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from jobrunner.driver.output import describe_output, read_previous_output
from jobrunner.driver.plan import plan_job
from jobrunner.driver.rows import job_sampling, read_shard_input, to_request
from jobrunner.spec import JobSpec, load_spec

REPO = Path(__file__).resolve().parents[1]
JOBS = sorted((REPO / "jobs").glob("*.yaml"))
EXPECTED_JOBS = {"example", "json_schema", "logprobs", "n_samples", "openai_batch", "nightly", "embed"}


def test_every_committed_job_is_checked_here():
    assert {p.stem for p in JOBS} >= EXPECTED_JOBS


@pytest.mark.parametrize("job", JOBS, ids=[p.stem for p in JOBS])
def test_committed_job_loads_plans_and_every_row_becomes_a_request(job, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)  # the committed specs name their inputs relative to the checkout
    spec = load_spec(job)
    assert spec.name == job.stem
    # a fresh output, and no earlier outputs to skip ids from (a checkout may hold outputs of earlier runs)
    output = spec.output.model_copy(update={"url": str(tmp_path / "out"), "skip_done_from": []})
    spec = spec.model_copy(update={"output": output})
    previous = read_previous_output(spec)
    plan = plan_job(spec, previous.header)  # lists the input, checks the required and kept columns, cuts shards
    describe_output(spec, plan, previous)  # an incremental job's shards are cut against its output
    assert plan.num_rows > 0 and plan.shards
    errors, sampling = {}, job_sampling(spec)
    for shard in plan.shards:
        table, _ = read_shard_input(spec, shard.file_url, shard.row_start, shard.row_end)
        for row in table.to_pylist():
            req = to_request(spec, shard.file_stem, row, sampling)
            if req.error:
                errors[req.row_id] = req.error
            else:
                assert req.prompt and req.params is not None
    assert errors == {}, f"{job.name}: rows that would be error rows: {list(errors.items())[:3]}"


# --- the spec against docs/driver.md's "Job spec reference" table -------------------------------------------


def spec_keys(model: type[BaseModel] = JobSpec, prefix: str = "") -> set[str]:
    """Dotted keys of the spec: every field of every section (`engine.max_num_seqs`, `name`, ...)."""
    keys = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= spec_keys(annotation, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def documented_keys(doc: str) -> set[str]:
    """Keys in the table's first column; `a.b`, `c` means a.b and a.c; `a.*` lists its keys in the meaning."""
    section = doc.split("## Job spec reference", 1)[1].split("\n## ", 1)[0]
    keys = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) < 3:
            continue
        names = re.findall(r"`([\w.*]+)`", cells[0])
        prefix = names[0].rpartition(".")[0]
        if names[0].endswith(".*"):
            names = [f"{prefix}.{n}" for n in re.findall(r"`(\w+)`", cells[2])]
        keys |= {n if "." in n or not prefix else f"{prefix}.{n}" for n in names}
    return keys


def test_every_spec_key_is_documented_and_every_documented_key_exists():
    documented = documented_keys((REPO / "docs" / "driver.md").read_text())
    keys = spec_keys()
    assert sorted(keys - documented) == [], "spec keys missing from docs/driver.md's key table"
    assert sorted(documented - keys) == [], "keys in docs/driver.md's table that the spec does not have"


def test_documented_keys_parser_reads_the_table_shapes():
    doc = ("## Job spec reference\n| key | default | meaning |\n|---|---|---|\n| `name` | required | x |\n"
           "| `sampling.*` | `max_tokens: 1` | `max_tokens`, `seed`, and below |\n"
           "| `engine.block_size`, `device` (auto) | | y |\n## Output\n| `not.a_key` | | z |\n")
    assert documented_keys(doc) == {"name", "sampling.max_tokens", "sampling.seed", "engine.block_size",
                                    "engine.device"}
