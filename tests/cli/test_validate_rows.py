"""`jobrunner validate` refuses the rows a worker would write as error rows (issue 47): per-row sampling values
against the engine's (OpenAI's) ranges, schemas that are not JSON or that the grammar refuses, an OpenAI batch
line naming another model, chat rows for a base model without a chat template; each named by row id and field,
from the same code the worker runs (driver/rows.py: to_request, engine/sampling/structured.py)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from jobrunner.cli import main

BAD_ROWS = {  # row id -> its sampling column (None: the job's settings)
    "ok": None,
    "toplp": {"top_logprobs": 3},
    "negtemp": {"temperature": -1},
    "hot": {"temperature": 5},
    "notjson": {"json_schema": "{not json"},
    "objekt": {"json_schema": {"type": "objekt"}},
    "badregex": {"regex": "a(b"},
}


def _spec(tmp_path: Path, model: str, **inp) -> Path:
    spec = {"name": "rows", "model": {"source": model}, "input": inp, "sampling": {"max_tokens": 4},
            "output": {"url": str(tmp_path / "out")}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _sampling_rows(tmp_path: Path, model: str) -> Path:
    data = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": list(BAD_ROWS), "prompt": ["Say hi"] * len(BAD_ROWS),
                             "sampling": [None if v is None else json.dumps(v) for v in BAD_ROWS.values()]}), data)
    return _spec(tmp_path, model, url=str(data), prompt_column="prompt", id_column="id",
                 sampling_column="sampling")


def _batch(tmp_path: Path, model: str, bodies: dict[str, dict], **inp) -> Path:
    data = tmp_path / "batch.jsonl"
    data.write_text("".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"messages": [{"role": "user", "content": "hi"}], **body}}) + "\n"
                            for cid, body in bodies.items()))
    return _spec(tmp_path, model, url=str(data), format="openai_batch", **inp)


@pytest.fixture(scope="module")
def base_model_dir(tiny_llama_hf_dir: Path, tmp_path_factory) -> Path:
    """The tiny model with its chat template taken out (a base model, as the alias gemma3-270m is)."""
    out = tmp_path_factory.mktemp("base_model") / "tiny_base"
    shutil.copytree(tiny_llama_hf_dir, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_each_bad_row_value_is_refused_naming_row_and_field(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    started = time.perf_counter()
    result = CliRunner().invoke(main, ["validate", str(_sampling_rows(tmp_path, str(tiny_llama_hf_dir)))])
    elapsed = time.perf_counter() - started
    assert result.exit_code == 1, result.output
    assert "rows checked as a worker reads them (all 7 rows, " in result.output
    error = result.output[result.output.index("Error: "):].splitlines()
    assert error[0] == "Error: 6 row(s) would be error rows (all 7 rows read); fix them or the settings named:"
    over = "bad sampling override in column 'sampling': "
    assert error[1:] == [
        f"  row 'toplp': {over}unknown sampling parameter 'top_logprobs': write logprobs: K (the sampled token and "
        "its top K alternatives; logprobs: true is K 0)",
        f"  row 'negtemp': {over}sampling parameter 'temperature' must be a number in [0, 2], got -1",
        f"  row 'hot': {over}sampling parameter 'temperature' must be a number in [0, 2], got 5",
        f"  row 'notjson': {over}sampling parameter 'json_schema' is not valid JSON: Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1)",
        "  row 'objekt': bad sampling settings: sampling parameter 'json_schema' is invalid or unsupported: "
        "Unsupported type \"objekt\"",
        "  row 'badregex': bad sampling settings: sampling parameter 'regex' is invalid or unsupported: Regex "
        "parsing error at position 4: The parenthesis is not closed."]
    assert elapsed < 60  # no worker: the rows are read and checked in this process


def test_the_worker_refuses_the_same_rows(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    """The rows validate refuses are error rows in a worker with the same reason (the engine's grammar check)."""
    from jobrunner.driver.rows import job_sampling, to_request
    from jobrunner.engine import LLMEngine
    from jobrunner.io.reader import ROW_INDEX
    from jobrunner.spec import load_spec

    spec = load_spec(_sampling_rows(tmp_path, str(tiny_llama_hf_dir)))
    sampling = job_sampling(spec)
    engine = LLMEngine.from_source(str(tiny_llama_hf_dir), dtype="float32")
    row = {ROW_INDEX: 0, "id": "objekt", "prompt": "Say hi", "sampling": json.dumps(BAD_ROWS["objekt"])}
    req = to_request(spec, "rows", row, sampling)
    assert req.error is None  # the grammar is the engine's to build: validate asks the same function
    with pytest.raises(ValueError, match="sampling parameter 'json_schema' is invalid or unsupported: "
                                         "Unsupported type \"objekt\""):
        engine.add_request("objekt", "Say hi", req.params)


def test_an_openai_line_for_another_model_is_refused_or_served_with_a_warning(tiny_llama_hf_dir: Path,
                                                                              tmp_path: Path) -> None:
    model = str(tiny_llama_hf_dir)
    bodies = {"other": {"model": "gpt-4o-mini"}, "same": {"model": model}, "short": {"model": tiny_llama_hf_dir.name},
              "none": {}, "hot": {"temperature": 5},
              "objekt": {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}}
    result = CliRunner().invoke(main, ["validate", str(_batch(tmp_path, model, bodies))])
    assert result.exit_code == 1, result.output
    assert "request lines: each line's custom_id, method, url and body read" in result.output
    error = result.output[result.output.index("Error: "):].splitlines()
    assert error == [
        "Error: 3 row(s) would be error rows (all 6 rows read); fix them or the settings named:",
        f"  row 'other': body.model 'gpt-4o-mini' is not the job's model {model!r}: name the job's model or none in "
        "the line, or set input.openai_model_mismatch: warn to serve it with the job's model",
        "  row 'hot': bad sampling settings: sampling parameter 'temperature' must be a number in [0, 2], got 5",
        "  row 'objekt': bad sampling settings: sampling parameter 'json_schema' is invalid or unsupported: "
        "Unsupported type \"objekt\""]
    warn = _batch(tmp_path, model, {"other": {"model": "gpt-4o-mini"}, "none": {}}, openai_model_mismatch="warn")
    result = CliRunner().invoke(main, ["validate", str(warn)])
    assert result.exit_code == 0, result.output
    assert (f"WARNING: 1 line(s) name another model than {model!r} in body.model (ids 'other'); they are served "
            "by the job's model (input.openai_model_mismatch: warn)") in result.output


def test_the_worker_serves_or_refuses_an_other_model_line_as_set(tmp_path: Path) -> None:
    from jobrunner.driver.rows import job_sampling, to_request
    from jobrunner.io.reader import ROW_INDEX
    from jobrunner.spec import spec_from_dict

    row = {ROW_INDEX: 0, "custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
           "body": json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})}
    for mode, error in (("error", "body.model 'gpt-4o-mini' is not the job's model 'smollm2-135m-instruct'"),
                        ("warn", None)):
        spec = spec_from_dict({"name": "t", "input": {"url": "b.jsonl", "format": "openai_batch",
                                                      "openai_model_mismatch": mode}, "output": {"url": "o"}})
        req = to_request(spec, "b", row, job_sampling(spec))
        if error is None:
            assert req.error is None and req.prompt == [{"role": "user", "content": "hi"}]
        else:
            assert req.error.startswith(error) and req.prompt is None


def test_chat_rows_for_a_model_without_a_chat_template_are_refused_in_one_line(base_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    data = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"id": ["m1"], "messages": [json.dumps([{"role": "user", "content": "hi"}])]}), data)
    job = _spec(tmp_path, str(base_model_dir), url=str(data), messages_column="messages", id_column="id")
    expected = (f"Error: input.messages_column makes every row a chat, but model.source {str(base_model_dir)!r} is a "
                "base model without a chat template: give it raw text (input.prompt_column, no system prompt or "
                "tools), set input.chat_template, or use an instruction-tuned model\n")
    for command in ("validate", "run"):  # before any worker (run would start Ray after the model check)
        result = CliRunner().invoke(main, [command, str(job)])
        assert (result.exit_code, result.output) == (1, expected)
    raw = _spec(tmp_path, str(base_model_dir), url=str(data), messages_column="messages", id_column="id",
                chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert CliRunner().invoke(main, ["validate", str(raw)]).exit_code == 0
    lines = CliRunner().invoke(main, ["validate", str(_batch(tmp_path, str(base_model_dir), {"c1": {}}))])
    assert lines.exit_code == 1
    assert lines.output.endswith(f"  row 'c1': a chat (chat) row, but model.source {str(base_model_dir)!r} is a "
                                 "base model without a chat template: give it raw text (input.prompt_column, no "
                                 "system prompt or tools), set input.chat_template, or use an instruction-tuned "
                                 "model\n")


def test_the_alias_gemma3_is_known_as_a_base_model() -> None:
    from jobrunner.models.chat_template import has_chat_template

    assert has_chat_template("gemma3-270m") is False
    assert has_chat_template("some-org/not-fetched") is None


def test_a_job_schema_the_grammar_refuses_stops_run_before_any_worker(tiny_llama_hf_dir: Path,
                                                                      tmp_path: Path) -> None:
    job = _sampling_rows(tmp_path, str(tiny_llama_hf_dir))
    result = CliRunner().invoke(main, ["run", str(job), "--set", "sampling.json_schema={type: objekt}"])
    assert (result.exit_code, result.output) == (1, "Error: sampling: sampling parameter 'json_schema' is invalid or "
                                                    "unsupported: Unsupported type \"objekt\"\n")


def test_a_row_without_a_prompt_is_warned_about_not_refused(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    """A null prompt is the row's data, like a bad line: an error row in the run, a WARNING in validate."""
    data = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["hi", None, "there"]}), data)
    job = _spec(tmp_path, str(tiny_llama_hf_dir), url=str(data), prompt_column="prompt", id_column="id")
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 0, result.output
    assert ("WARNING: 1 row(s) have no usable prompt and will be error rows (ids 'b'); row 'b': prompt column "
            "'prompt' is null or empty") in result.output.splitlines()
    assert "prompt lengths (all 3 rows read): longest prompt " in result.output


def test_run_refuses_chat_lines_for_a_base_model_before_any_worker(base_model_dir: Path, tmp_path: Path) -> None:
    job = _batch(tmp_path, str(base_model_dir), {"c1": {}, "c2": {}})
    result = CliRunner().invoke(main, ["run", str(job)])
    assert (result.exit_code, result.output) == (1, (
        f"Error: 2 of the first 2 request lines are /v1/chat/completions (custom_id 'c1', ...), but model.source "
        f"{str(base_model_dir)!r} is a base model without a chat template: give it raw text (input.prompt_column, "
        "no system prompt or tools), set input.chat_template, or use an instruction-tuned model; send them as "
        "/v1/completions prompts\n"))
