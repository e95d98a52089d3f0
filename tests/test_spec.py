"""The job spec: the example loads, unknown fields and bad values name the field, overrides, redaction."""

from __future__ import annotations

import pytest

from jobrunner.spec import JobSpec, SpecError, load_spec, parse_overrides, spec_from_dict

EXAMPLE = "jobs/example.yaml"


def _minimal(**extra) -> dict:
    data = {"name": "t", "input": {"url": "x.parquet", "prompt_column": "prompt"}, "output": {"url": "out"}}
    data.update(extra)
    return data


def test_example_spec_loads_with_contract_keys():
    spec = load_spec(EXAMPLE)
    assert spec.model.source == "smollm2-135m-instruct"
    assert spec.input.messages_column == "messages" and spec.input.id_column == "id"
    assert spec.output.mode == "resume" and spec.cost.worker_hour_usd == 0.10


def test_issue_example_keys_validate():
    spec = spec_from_dict({
        "name": "example",
        "model": {"source": "smollm2-135m-instruct", "dtype": "auto", "quantization": "none"},
        "input": {"url": "examples/data/prompts.parquet", "prompt_column": "prompt", "id_column": "id",
                  "rows_per_shard": 1000},
        "sampling": {"max_tokens": 128, "temperature": 0.0},
        "engine": {"max_num_seqs": 64, "enable_prefix_caching": True}, "cluster": {"num_workers": 1},
        "output": {"url": "./out/example", "mode": "resume"}, "cost": {"worker_hour_usd": 0.10}})
    assert spec.rows_per_shard == 1000


def test_unknown_field_is_named():
    with pytest.raises(SpecError, match=r"sampling\.max_tokenz: unknown field"):
        spec_from_dict(_minimal(sampling={"max_tokenz": 3}))
    with pytest.raises(SpecError, match=r"output\.mode"):
        spec_from_dict(_minimal(output={"url": "o", "mode": "append"}))
    with pytest.raises(SpecError, match="exactly one of prompt_column or messages_column"):
        spec_from_dict(_minimal(input={"url": "x", "prompt_column": "p", "messages_column": "m"}))
    with pytest.raises(SpecError, match=r"^<spec>: invalid job spec:\n  name: Field required"):
        spec_from_dict({"input": {"url": "x", "prompt_column": "p"}, "output": {"url": "o"}})


def test_overrides_and_env_spec(tmp_path, monkeypatch):
    assert parse_overrides(["a.b=1", "a.c=x", "d=[1, 2]"]) == {"a": {"b": 1, "c": "x"}, "d": [1, 2]}
    spec = load_spec(EXAMPLE, ["sampling.max_tokens=7", "cluster.num_workers=2"])
    assert spec.sampling.max_tokens == 7 and spec.cluster.num_workers == 2
    with pytest.raises(SpecError, match="expected key.path=value"):
        load_spec(EXAMPLE, ["nonsense"])
    monkeypatch.setenv("SPEC_IN_ENV", '{"name": "e", "input": {"url": "x", "prompt_column": "p"}, '
                                      '"output": {"url": "o"}}')
    assert load_spec("env:SPEC_IN_ENV").name == "e"
    with pytest.raises(SpecError, match="MISSING_VAR is not set"):
        load_spec("env:MISSING_VAR")
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(SpecError, match="bad.yaml: not valid YAML"):
        load_spec(tmp_path / "bad.yaml")


def test_redacted_hides_credentials():
    spec = JobSpec.model_validate(_minimal(output={"url": "s3://b/o", "storage_options": {
        "key": "AKIA", "secret": "s3cr3t", "endpoint_url": "http://x",
        "client_kwargs": {"aws_session_token": "t"}}}))
    red = spec.redacted()["output"]["storage_options"]
    assert red["key"] == red["secret"] == "***" and red["client_kwargs"]["aws_session_token"] == "***"
    assert red["endpoint_url"] == "http://x"
    assert spec.output.storage_options["secret"] == "s3cr3t"


def test_every_field_is_described():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, JobSpec.__mro__[1]):
                walk(ann)
            assert model.model_config.get("extra") == "forbid"
    walk(JobSpec)


def test_dataset_generation_keys_validate():
    spec = spec_from_dict(_minimal(
        sampling={"n": 4, "logprobs": 5, "prompt_logprobs": 0, "json_schema": '{"type": "object"}',
                  "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                  "min_tokens": 2, "logit_bias": {"7": 1.5}, "include_stop_str_in_output": True},
        output={"url": "o", "keep_columns": "*", "format": "messages"}))
    assert spec.sampling.n == 4 and spec.sampling.logit_bias == {7: 1.5} and spec.output.keep_columns == "*"
    batch = spec_from_dict({"name": "t", "input": {"url": "b.jsonl", "format": "openai_batch",
                                                   "chat_template_kwargs": {"enable_thinking": False}},
                            "output": {"url": "o"}})
    assert batch.input.format == "openai_batch" and batch.input.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(("sampling", "message"), [
    ({"n": 0}, r"sampling\.n: Input should be greater than or equal to 1"),
    ({"logprobs": 21}, r"sampling\.logprobs: Input should be less than or equal to 20"),
    ({"json_schema": "{not json"}, r"sampling\.json_schema: Value error, sampling.json_schema is not valid JSON"),
    ({"json_schema": "[1]"}, r"must be a JSON object"),
    ({"regex": "a+", "choice": ["a"]}, r"set at most one of json_schema, regex, choice"),
    ({"min_p": 1.5}, r"sampling\.min_p"),
])
def test_bad_sampling_values_are_named(sampling, message):
    with pytest.raises(SpecError, match=message):
        spec_from_dict(_minimal(sampling=sampling))


def test_openai_batch_takes_no_column_names():
    with pytest.raises(SpecError, match=r"openai_batch .* unset prompt_column, id_column"):
        spec_from_dict({"name": "t", "input": {"url": "b.jsonl", "format": "openai_batch", "prompt_column": "p",
                                               "id_column": "i"}, "output": {"url": "o"}})
    with pytest.raises(SpecError, match=r"output\.keep_columns"):
        spec_from_dict(_minimal(output={"url": "o", "keep_columns": "all"}))
