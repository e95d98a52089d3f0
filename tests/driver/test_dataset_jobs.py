"""Dataset-generation jobs end to end on the real engine (tiny random Llama), real local Ray, local disk and
the S3 server: n samples per row, top logprobs (checked against transformers), JSON-schema output validated
with jsonschema, messages output, keep_columns '*', JSONL / CSV / OpenAI batch input, OpenAI result files
parsed by the openai package, and per-row errors that leave the rest of the shard intact."""

from __future__ import annotations

import json

import fsspec
import jsonschema
import pyarrow.dataset as pads
import pytest
import torch
import yaml
from click.testing import CliRunner
from openai.types import Completion
from openai.types.chat import ChatCompletion
from transformers import AutoTokenizer

from jobrunner.cli import main
from jobrunner.driver.job import run_job
from jobrunner.io.parts import read_output
from jobrunner.io.reader import InputError
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import new_bucket, read_manifest_file

pytestmark = pytest.mark.timeout(600)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def _spec(model_dir, input_section: dict, output_url: str, sampling: dict | None = None,
          output: dict | None = None, storage_options: dict | None = None) -> dict:
    opts = storage_options or {}
    return {"name": "dataset-job", "model": {"source": str(model_dir), "dtype": "float32"},
            "input": {"rows_per_shard": 4, "storage_options": opts, **input_section},
            "sampling": {"max_tokens": 4, "temperature": 0.0, **(sampling or {})},
            "engine": {"max_num_seqs": 8, "num_kv_blocks": 64},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 1, "retry_backoff_s": 0.1},
            # these jobs hold deliberate error rows (bad n, logprobs, schema, body fields): no error budget
            "output": {"url": output_url, "mode": "overwrite", "storage_options": opts, "max_error_rate": 1.0,
                       **(output or {})}}


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


JSONL_ROWS = [
    {"id": "r0", "messages": _chat("hello world"), "topic": "a", "params": None},
    {"id": "r1", "messages": _chat("the quick fox"), "topic": "b",
     "params": {"n": 3, "temperature": 1.0, "seed": 5}},
    {"id": "r2", "messages": _chat("bad n"), "topic": "c", "params": {"n": 0}},
    {"id": "r3", "messages": _chat("bad logprobs"), "topic": "d", "params": {"logprobs": 50}},
    {"id": "r4", "messages": _chat("bad schema"), "topic": "e", "params": {"json_schema": '{"type": "nonsense"}'}},
    {"id": "r5", "messages": _chat("json please"), "topic": "f",
     "params": {"n": 1, "json_schema": json.dumps(SCHEMA), "max_tokens": 24}},
    {"id": "r6", "messages": _chat("capital of France"), "topic": "g", "params": {"n": 1}},
]


def test_jsonl_n_samples_logprobs_messages_keep_all(local_ray, tmp_path, tiny_llama_hf_dir):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in JSONL_ROWS))
    spec = _spec(tiny_llama_hf_dir, {"url": str(path), "messages_column": "messages", "id_column": "id",
                                     "sampling_column": "params"}, str(tmp_path / "out"),
                 sampling={"n": 2, "logprobs": 3}, output={"keep_columns": "*", "format": "messages"})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml"), "--no-progress"])
    assert result.exit_code == 0, result.output
    rows = read_output(str(tmp_path / "out")).to_pylist()
    by_id: dict[str, list[dict]] = {}
    for row in rows:
        by_id.setdefault(row["id"], []).append(row)
    assert {k: sorted(r["sample_index"] for r in v) for k, v in by_id.items()} == {
        "r0": [0, 1], "r1": [0, 1, 2], "r2": [0], "r3": [0], "r4": [0], "r5": [0], "r6": [0]}
    _check_errors(by_id)
    _check_samples(by_id)
    _check_logprobs_against_transformers(tiny_llama_hf_dir, by_id["r6"][0])
    assert json.loads(by_id["r5"][0]["generated_text"]) is not None
    jsonschema.validate(json.loads(by_id["r5"][0]["generated_text"]), SCHEMA)
    manifest = read_manifest_file(tmp_path / "out")
    ok_rows = [r for r in rows if r["error"] is None]
    once = sum(r["num_prompt_tokens"] for r in ok_rows if not r["prompt_shared"])
    assert manifest["totals"]["rows"] == 10 and manifest["totals"]["num_errors"] == 3
    assert manifest["totals"]["num_prompt_tokens"] == once
    assert manifest["totals"]["num_cached_tokens"] == sum(
        r["num_cached_tokens"] for r in ok_rows if not r["prompt_shared"])
    report = json.loads((tmp_path / "out" / "_report" / "report.json").read_text())
    report = report[0] if isinstance(report, list) else report
    assert report["tokens"]["input"] == once


def _check_errors(by_id: dict[str, list[dict]]) -> None:
    errors = {k: v[0]["error"] for k, v in by_id.items() if v[0]["finish_reason"] == "error"}
    assert set(errors) == {"r2", "r3", "r4"}
    assert "bad sampling override in column 'params'" in errors["r2"] and "'n'" in errors["r2"]
    assert "'logprobs'" in errors["r3"]
    assert errors["r4"].startswith("engine rejected the request") and "schema" in errors["r4"].lower()
    assert all(by_id[k][0]["generated_text"] is None and by_id[k][0]["messages"] is None for k in errors)


def _check_samples(by_id: dict[str, list[dict]]) -> None:
    for key in ("r0", "r1", "r5", "r6"):
        samples = sorted(by_id[key], key=lambda r: r["sample_index"])
        assert [r["prompt_shared"] for r in samples] == [False] + [True] * (len(samples) - 1)
        assert len({r["num_prompt_tokens"] for r in samples}) == 1
        source = next(r for r in JSONL_ROWS if r["id"] == key)
        for r in samples:
            kept_params = {k: v for k, v in (r["params"] or {}).items() if v is not None}  # a struct column
            assert r["topic"] == source["topic"] and kept_params == (source["params"] or {})
            assert r["messages"] == source["messages"] + [{"role": "assistant", "content": r["generated_text"]}]
            assert r["finish_reason"] in ("stop", "length") and r["error"] is None
    greedy = sorted(by_id["r0"], key=lambda r: r["sample_index"])
    assert greedy[0]["generated_text"] == greedy[1]["generated_text"]  # temperature 0: the same answer twice
    for r in by_id["r0"] + by_id["r6"]:
        assert len(r["logprobs"]) == r["num_output_tokens"] > 0
        for entry in r["logprobs"]:
            top = entry["top_logprobs"]
            assert len(top) == 3 and top == sorted(top, key=lambda t: -t["logprob"])
            assert (entry["token_id"], entry["logprob"]) == (top[0]["token_id"], top[0]["logprob"])  # greedy
        assert r["prompt_logprobs"] is None


def _check_logprobs_against_transformers(model_dir, row: dict) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt_ids = tokenizer.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    assert len(prompt_ids) == row["num_prompt_tokens"]
    output_ids = [e["token_id"] for e in row["logprobs"]]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)[len(prompt_ids) - 1:-1]
    for step, entry in enumerate(row["logprobs"]):
        values, ids = logprobs[step].topk(3)
        assert [t["token_id"] for t in entry["top_logprobs"]] == ids.tolist()
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(values.tolist(), abs=1e-4)
        assert entry["token"] == tokenizer.decode([entry["token_id"]])


BATCH = [
    {"custom_id": "chat-n", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "x", "messages": _chat("hello world"), "max_tokens": 3, "n": 2, "temperature": 0.9,
              "seed": 1, "logprobs": True, "top_logprobs": 2}},
    {"custom_id": "json", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": _chat("json please"), "max_completion_tokens": 24, "chat_template_kwargs": {"tag": "A: "},
              "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}},
    {"custom_id": "text", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "The quick brown", "max_tokens": 3, "logprobs": 1}},
    {"custom_id": "unknown-field", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": _chat("x"), "tools": [{"type": "function"}]}},
    {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    {"custom_id": "bad-n", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": _chat("x"), "n": 0}},
    {"custom_id": "too-long", "method": "POST", "url": "/v1/completions", "body": {"prompt": "word " * 300, "n": 2}},
]


TAG_TEMPLATE = "{% for m in messages %}{{ tag }}{{ m['content'] }}{% endfor %}"


def test_openai_batch_in_and_out_on_s3(local_ray, s3_server, tiny_llama_hf_dir):
    bucket = new_bucket(s3_server)
    opts = s3_server["storage_options"]
    fs = fsspec.filesystem("s3", **opts)
    lines = [json.dumps(r) for r in BATCH[:3]] + ["{this is not json"] + [json.dumps(r) for r in BATCH[3:]]
    fs.pipe_file(f"{bucket}/in/batch.jsonl", ("\n".join(lines) + "\n").encode())
    spec = spec_from_dict(_spec(tiny_llama_hf_dir, {"url": f"s3://{bucket}/in/batch.jsonl",
                                                    "format": "openai_batch", "chat_template": TAG_TEMPLATE,
                                                    "chat_template_kwargs": {"tag": "Q: "},
                                                    "openai_model_mismatch": "warn"},  # chat-n names model x
                                f"s3://{bucket}/out", storage_options=opts, output={"keep_columns": "*"}))
    result = run_job(spec, show_progress=False)
    assert result.ok, result.summary()
    outputs = [json.loads(x) for x in fs.cat_file(f"{bucket}/out/_openai/output.jsonl").decode().splitlines()]
    errors = [json.loads(x) for x in fs.cat_file(f"{bucket}/out/_openai/errors.jsonl").decode().splitlines()]
    assert [o["custom_id"] for o in outputs] == ["chat-n", "json", "text"]
    # in input order; the line that is not JSON shows no custom_id: null, its message names the line
    assert [e["custom_id"] for e in errors] == [None, "unknown-field", "bad-url", "bad-n", "too-long"]
    chat = ChatCompletion.model_validate(outputs[0]["response"]["body"])
    assert chat.model == str(tiny_llama_hf_dir)  # model x asked, the job's model answered (warn: served)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in chat.choices)
    assert all(len(t.top_logprobs) == 2 for c in chat.choices for t in c.logprobs.content)
    jsonschema.validate(json.loads(ChatCompletion.model_validate(outputs[1]["response"]["body"])
                                   .choices[0].message.content), SCHEMA)
    # The spec's chat template and its variables; a request's own chat_template_kwargs win for that request.
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_hf_dir)
    assert chat.usage.prompt_tokens == len(tokenizer.encode("Q: hello world", add_special_tokens=False))
    assert outputs[1]["response"]["body"]["usage"]["prompt_tokens"] == len(
        tokenizer.encode("A: json please", add_special_tokens=False))
    text = Completion.model_validate(outputs[2]["response"]["body"])
    assert text.object == "text_completion" and len(text.choices[0].logprobs.tokens) == text.usage.completion_tokens
    by_id = {e["custom_id"]: e["response"] for e in errors}
    assert by_id["unknown-field"]["status_code"] == 400
    assert "body.tools[0] must be {type: function" in by_id["unknown-field"]["body"]["error"]["message"]
    assert "url '/v1/embeddings'" in by_id["bad-url"]["body"]["error"]["message"]
    assert "line 4 is not valid JSON" in by_id[None]["body"]["error"]["message"]
    assert "'n'" in by_id["bad-n"]["body"]["error"]["message"]
    assert by_id["too-long"]["status_code"] == 400 and "prompt has" in by_id["too-long"]["body"]["error"]["message"]
    # A resumed run (everything committed: no worker starts) writes the same result lines again.
    again = run_job(spec.model_copy(update={"output": spec.output.model_copy(update={"mode": "resume"})}),
                    show_progress=False)
    assert again.ok
    rerun = [json.loads(x) for x in fs.cat_file(f"{bucket}/out/_openai/output.jsonl").decode().splitlines()]
    assert [_without_created(o) for o in rerun] == [_without_created(o) for o in outputs]
    # Parquet readers of the output URL see only the parts (one row per sample) with the kept request columns.
    table = pads.dataset(f"{bucket}/out", filesystem=fs, format="parquet").to_table()
    assert table.num_rows == 10 and {"custom_id", "url", "body"} <= set(table.column_names)


def _without_created(line: dict) -> dict:
    body = {k: v for k, v in line["response"]["body"].items() if k != "created"}
    return {**line, "response": {**line["response"], "body": body}}


def test_csv_input_and_kept_column_clash(local_ray, tmp_path, tiny_llama_hf_dir):
    (tmp_path / "p.csv").write_text('key,prompt,error\nk1,"Hello, world",x\nk2,,y\nk3,The quick brown fox,z\n')
    base = _spec(tiny_llama_hf_dir, {"url": str(tmp_path / "p.csv"), "prompt_column": "prompt",
                                     "id_column": "key"}, str(tmp_path / "out"), output={"keep_columns": "*"})
    with pytest.raises(InputError, match=r"input column\(s\) 'error' have the name of an output column"):
        run_job(spec_from_dict(base), show_progress=False)
    assert not (tmp_path / "out").exists()  # refused before anything was written
    base["output"]["keep_columns"] = ["key"]
    result = run_job(spec_from_dict(base), show_progress=False)
    assert result.ok, result.summary()
    rows = {r["id"]: r for r in read_output(str(tmp_path / "out")).to_pylist()}
    assert set(rows) == {"k1", "k2", "k3"} and rows["k1"]["key"] == "k1"
    assert rows["k2"]["error"] == "prompt column 'prompt' is null or empty"
    assert rows["k1"]["num_output_tokens"] > 0 and rows["k3"]["generated_text"] is not None


def test_validate_openai_batch_file_and_duplicate_custom_ids(tmp_path):
    lines = [json.dumps(r) for r in BATCH[:3]] + [json.dumps({**BATCH[2], "body": {"prompt": "again"}})]
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "c.jsonl").write_text("\n".join(lines[:3]) + "\n")
    job = {"name": "v", "input": {"url": str(tmp_path / "b.jsonl"), "format": "openai_batch",
                                  "openai_model_mismatch": "warn"},  # BATCH's chat-n names model x
           "output": {"url": str(tmp_path / "out")}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    runner = CliRunner()
    ok = runner.invoke(main, ["validate", str(tmp_path / "job.yaml"), "--set", f"input.url={tmp_path / 'c.jsonl'}"])
    assert ok.exit_code == 0 and "1 file(s), 3 rows, 1 shard(s)" in ok.output, ok.output
    dup = runner.invoke(main, ["validate", str(tmp_path / "job.yaml")])  # every run and validate look
    assert dup.exit_code == 1 and "the batch repeats a custom_id: 'text' at " in dup.output, dup.output
    assert "b.jsonl line 3 and again at " in dup.output and "b.jsonl line 4" in dup.output
