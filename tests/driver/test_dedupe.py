"""`output.dedupe: prompts` (issue 47, item 8): a row whose request repeats an earlier row's (files in order,
rows in order; across shards and files) is written as a row of its own, finish_reason `duplicate` and
`dedupe_of` the first row's id, not generated; every id comes out exactly once, the manifest and the report
count them, and a resume or a second run changes nothing."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.job import run_job
from jobrunner.io.parts import read_output
from jobrunner.io.prompt_dupes import find_prompt_duplicates
from jobrunner.io.text_input import list_input
from jobrunner.reports import write_job_report
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, read_manifest_file

pytestmark = pytest.mark.timeout(600)

# two files; "q a" repeats within the first file (across its shards) and in the second; "q c" only in the second
FILES = {"a.parquet": [("a0", "q a"), ("a1", "q b"), ("a2", "q a"), ("a3", "q b"), ("a4", "q a"), ("a5", "q d")],
         "b.parquet": [("b0", "q c"), ("b1", "q a"), ("b2", "q c"), ("b3", "q e")]}
FIRST = {"a2": "a0", "a3": "a1", "a4": "a0", "b1": "a0", "b2": "b0"}


def _input(tmp_path) -> str:
    folder = tmp_path / "in"
    folder.mkdir()
    for name, rows in FILES.items():
        pq.write_table(pa.table({"id": [r[0] for r in rows], "prompt": [r[1] for r in rows],
                                 "topic": ["t"] * len(rows)}), folder / name, row_group_size=2)
    return str(folder)


def test_find_prompt_duplicates_in_file_then_row_order(tmp_path):
    from jobrunner.driver.rows import fingerprint_roles, fingerprint_salt

    spec = spec_from_dict(fake_spec(_input(tmp_path), str(tmp_path / "out"), output={"dedupe": "prompts"}))
    files = list_input(spec.input.url, {}, "auto")
    found = find_prompt_duplicates(files, {}, "auto", "id", fingerprint_roles(spec), fingerprint_salt(spec))
    got = {(f.rsplit("/", 1)[1], r): first for f, r, first in zip(*(found.table.column(c).to_pylist()
                                                                     for c in ("file", "row", "dedupe_of")),
                                                                   strict=True)}
    assert got == {("a.parquet", 2): "a0", ("a.parquet", 3): "a1", ("a.parquet", 4): "a0", ("b.parquet", 1): "a0",
                   ("b.parquet", 2): "b0"}
    assert found.describe() == {"rows": 10, "distinct_prompts": 5, "duplicate_prompts": 5}


def test_duplicates_are_written_not_generated_each_id_once(local_ray, tmp_path):
    out = tmp_path / "out"
    data = fake_spec(_input(tmp_path), str(out), output={"dedupe": "prompts"})
    data["input"]["rows_per_shard"] = 2
    spec = spec_from_dict(data)
    result = run_job(spec, show_progress=False)
    assert result.ok, result.summary()
    rows = {r["id"]: r for r in read_output(str(out)).to_pylist()}
    assert sorted(rows) == sorted(r[0] for rs in FILES.values() for r in rs)  # every id, once
    assert {i: r["dedupe_of"] for i, r in rows.items() if r["dedupe_of"] is not None} == FIRST
    for i, r in rows.items():
        if i in FIRST:
            assert (r["finish_reason"], r["error"], r["generated_text"], r["num_output_tokens"]) == \
                ("duplicate", None, None, 0)
            assert r["request_fingerprint"] == rows[FIRST[i]]["request_fingerprint"]
        else:
            assert r["finish_reason"] == "length" and r["generated_text"] == "tok0 tok1 tok2 tok3"
    manifest = read_manifest_file(out)
    assert manifest["dedupe"] == {"mode": "prompts", "rows": 10, "distinct_prompts": 5, "duplicate_prompts": 5}
    assert result.finish_reasons == {"duplicate": 5, "length": 5}  # this run's rows, as the summary counts them
    assert manifest["totals"]["num_errors"] == 0
    report = write_job_report(str(out))
    assert "error" not in report, report
    saved = json.loads((out / "_report" / "report.json").read_text())
    assert saved["rows"]["finish_reasons"] == {"duplicate": 5, "length": 5}
    assert saved["dedupe"] == manifest["dedupe"]
    from jobrunner.reports.text import dedupe_line

    assert dedupe_line(saved["dedupe"]) == ("dedupe prompts: 5 of 10 rows repeat an earlier row's prompt "
                                            "(5 distinct), not generated")
    # a rerun (resume) has nothing to do and changes nothing
    again = run_job(spec, show_progress=False)
    assert again.ok and {r["id"]: r["dedupe_of"] for r in read_output(str(out)).to_pylist()} == \
        {i: r["dedupe_of"] for i, r in rows.items()}


def test_without_dedupe_every_row_is_generated_and_there_is_no_column(local_ray, tmp_path):
    out = tmp_path / "out"
    result = run_job(spec_from_dict(fake_spec(_input(tmp_path), str(out))), show_progress=False)
    assert result.ok
    table = read_output(str(out))
    assert "dedupe_of" not in table.column_names
    assert np.all(np.array(table.column("finish_reason").to_pylist()) == "length")


def test_duplicate_outputs_are_listed_and_counted(local_ray, tmp_path):
    """output.dedupe outputs: every row generated, each with output_fingerprint; the samples whose text a
    smaller (id, sample_index) has are listed under _plan/ and counted in the manifest, also after a resume."""
    from jobrunner.io.output_dupes import OUTPUT_DUPLICATES_KEY
    from jobrunner.io.storage import Storage

    folder = tmp_path / "in"
    folder.mkdir()
    ids = [f"r{i}" for i in range(8)]
    over = [json.dumps({"max_tokens": 2 if i % 3 else 3}) for i in range(8)]  # two texts: r0, r3, r6 the longer
    pq.write_table(pa.table({"id": ids, "prompt": [f"q {i}" for i in range(8)], "topic": ["t"] * 8, "over": over}),
                   folder / "in.parquet", row_group_size=4)
    out = tmp_path / "out"
    data = fake_spec(str(folder), str(out), output={"dedupe": "outputs"})
    data["input"].update(rows_per_shard=4, sampling_column="over")
    spec = spec_from_dict(data)
    assert run_job(spec, show_progress=False).ok
    table = read_output(str(out))
    texts = dict(zip(zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist()),
                     table.column("generated_text").to_pylist(), strict=True))
    prints = dict(zip(texts, table.column("output_fingerprint").to_pylist(), strict=True))
    assert len(texts) == 8 and len(set(texts.values())) == 2 and len(set(prints.values())) == 2
    listed = pq.read_table(str(out / OUTPUT_DUPLICATES_KEY)).to_pylist()
    first = {"tok0 tok1 tok2": ("r0", 0), "tok0 tok1": ("r1", 0)}
    assert sorted((d["id"], d["sample_index"]) for d in listed) == sorted(k for k in texts if k not in first.values())
    assert all((d["dedupe_of"], d["dedupe_of_sample"]) == first[texts[(d["id"], d["sample_index"])]] for d in listed)
    expected = {"mode": "outputs", "samples": 8, "distinct_outputs": 2, "duplicate_outputs": 6}
    assert read_manifest_file(out)["dedupe"] == expected
    from jobrunner.reports.text import dedupe_line

    assert dedupe_line(write_job_report(str(out))["dedupe"]) == \
        "dedupe outputs: 6 of 8 samples repeat an earlier sample's text (2 distinct)"
    assert run_job(spec, show_progress=False).ok  # a resume with nothing to do counts the same
    assert read_manifest_file(out)["dedupe"] == expected
    assert Storage(str(out)).exists(OUTPUT_DUPLICATES_KEY)
