"""Whole jobs (fake engine, local Ray) over imperfect inputs: bad text lines are row errors naming the line,
repeated ids are refused before any work, OpenAI result files are written even over the error budget."""

from __future__ import annotations

import json

import pytest

from jobrunner.driver.job import run_job
from jobrunner.driver.plan import plan_job
from jobrunner.io.parts import read_output
from jobrunner.io.reader import InputError
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, write_prompts

pytestmark = pytest.mark.timeout(600)


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _request(custom_id: str, text: str, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"messages": _chat(text), "max_tokens": 2}})


def _batch_spec(tmp_path, lines: list[str], **output) -> dict:
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    spec = fake_spec(str(tmp_path / "batch.jsonl"), str(tmp_path / "out"), output={"keep_columns": [], **output})
    spec["input"] = {"url": str(tmp_path / "batch.jsonl"), "format": "openai_batch", "rows_per_shard": 4}
    return spec


def test_openai_result_files_are_written_over_the_error_budget(local_ray, tmp_path):
    lines = [_request(f"r{i}", f"question {i}") for i in range(11)]
    lines[4] = _request("r4", "x", url="/v1/embeddings")
    lines[8] = '{"custom_id": "r8", "method": "POST", "body": {"messages": '  # cut short: not JSON
    result = run_job(spec_from_dict(_batch_spec(tmp_path, lines)), show_progress=False)
    assert result.over_error_budget and not result.ok  # 2 of 11 rows: above the default 0.1
    out = tmp_path / "out" / "_openai"
    outputs = [json.loads(x) for x in (out / "output.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == [f"r{i}" for i in range(11) if i not in (4, 8)]
    assert [e["custom_id"] for e in errors] == ["r4", "r8"]  # the cut line keeps its custom_id
    assert errors[1]["response"]["body"]["error"]["message"].startswith("line 9 is not valid JSON")
    assert not (tmp_path / "out" / "_SUCCESS").exists()


def test_an_unreadable_custom_id_is_null_in_the_error_file(local_ray, tmp_path):
    lines = [_request("a", "one"), "{not json at all", _request("b", "two")]
    result = run_job(spec_from_dict(_batch_spec(tmp_path, lines, max_error_rate=0.5)), show_progress=False)
    assert result.ok, result.summary()
    errors = [json.loads(x) for x in (tmp_path / "out" / "_openai" / "errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == [None]
    assert errors[0]["response"]["body"]["error"]["message"].startswith("line 2 is not valid JSON")


def test_bad_jsonl_lines_are_row_errors_and_the_rest_runs(local_ray, tmp_path):
    good = [json.dumps({"id": f"k{i}", "messages": _chat(f"question {i}")}).encode() for i in range(8)]
    good[2] = json.dumps({"id": "k2", "messages": "not a list"}).encode()
    good[5] = b'{"id": "k5", "messages": [{"role": "user", "content": "bad \xff byte"}]}'
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(good) + b"\n")
    spec = fake_spec(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), output={"keep_columns": [],
                                                                               "max_error_rate": 0.5})
    spec["input"].update(prompt_column=None, messages_column="messages", rows_per_shard=4)
    result = run_job(spec_from_dict(spec), show_progress=False)
    assert result.ok, result.summary()
    rows = {r["id"]: r for r in read_output(str(tmp_path / "out")).to_pylist()}
    assert sorted(rows) == [f"k{i}" for i in range(8)]
    assert rows["k2"]["error"] == "line 3: field 'messages' is a string where most lines have a list"
    assert rows["k5"]["error"].startswith("line 6: field 'messages' is not valid UTF-8")
    assert all(rows[f"k{i}"]["error"] is None and rows[f"k{i}"]["num_output_tokens"] == 4
               for i in (0, 1, 3, 4, 6, 7))


def test_repeated_ids_are_refused_before_any_work(tmp_path):
    write_prompts(tmp_path / "in" / "a.parquet", 8)
    write_prompts(tmp_path / "in" / "b.parquet", 3)
    spec = spec_from_dict(fake_spec(str(tmp_path / "in"), str(tmp_path / "out")))
    with pytest.raises(InputError, match=r"input.id_column 'id' has duplicate ids: 'p000' at .*/in/a\.parquet row 0 "
                                         r"and again at .*/in/b\.parquet row 0; 'p001' .*; 'p002' at "):
        run_job(spec, show_progress=False)
    assert not (tmp_path / "out").exists()


def test_a_batch_repeating_a_custom_id_is_refused(tmp_path):
    lines = [_request("a", "one"), "", _request("b", "two"), _request("a", "three")]
    with pytest.raises(InputError, match=r"the batch repeats a custom_id: 'a' at .*batch\.jsonl line 1 and again "
                                         r"at .*batch\.jsonl line 4\. .*OpenAI refuses such a file"):
        plan_job(spec_from_dict(_batch_spec(tmp_path, lines)))


def test_a_shared_system_prompt_reaches_every_row_and_a_bad_column_is_refused_before_work(local_ray, tmp_path):
    """input.system_prompt on a prompt column: every output chat starts with it (a row's own column value
    overrides it); a system_prompt_column that is not a string column stops the job at planning."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["one", "two", "three"],
                             "sys": [None, "Answer in Welsh.", None]}), tmp_path / "in.parquet")
    spec = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"),
                     input={"system_prompt": "Answer in French.", "system_prompt_column": "sys"},
                     output={"format": "messages", "keep_columns": []})
    result = run_job(spec_from_dict(spec), show_progress=False)
    assert result.ok, result.summary()
    rows = {r["id"]: r for r in read_output(str(tmp_path / "out")).to_pylist()}
    assert [m["content"] for m in rows["a"]["messages"][:2]] == ["Answer in French.", "one"]
    assert [m["content"] for m in rows["b"]["messages"][:2]] == ["Answer in Welsh.", "two"]
    assert [m["role"] for m in rows["c"]["messages"]] == ["system", "user", "assistant"]
    assert rows["a"]["num_prompt_tokens"] == 4  # the fake engine counts words: "Answer in French. one"
    pq.write_table(pa.table({"id": ["a"], "prompt": ["one"], "sys": [3]}), tmp_path / "bad.parquet")
    spec["input"]["url"] = str(tmp_path / "bad.parquet")
    with pytest.raises(InputError, match=r"column 'sys' \(input.system_prompt_column\) has type int64; "
                                         r"expected a string column"):
        plan_job(spec_from_dict(spec))
