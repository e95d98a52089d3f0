"""The job spec: the example loads, unknown fields and bad values name the field, overrides, redaction."""

from __future__ import annotations

import pytest

from jobrunner.redaction import redact_text
from jobrunner.spec import (
    JobSpec,
    SpecError,
    load_spec,
    load_spec_data,
    parse_overrides,
    plain_text_secrets,
    spec_from_dict,
)

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


def test_redacted_hides_every_pattern_at_every_depth():
    secret_options = {
        "account_key": "AK", "connection_string": "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=Zz==",
        "api_key": "sk-1", "password": "pw", "credentials": {"token": "t1"}, "sas_token": "sv=1&sig=abc",
        "client_kwargs": {"headers": {"Authorization": "Bearer abc", "X-Api-Key": "k2", "Accept": "json"}},
        "session": {"profile": "p"}, "nested": [{"private_key": "pk"}], "region_name": "eu-west-1",
    }
    spec = JobSpec.model_validate(_minimal(
        input={"url": "s3://AKIA:hunter2@host/in?X-Amz-Signature=sig1&X-Amz-Credential=c&part=1",
               "prompt_column": "p", "storage_options": secret_options},
        sampling={"stop_token_ids": [7, 8], "max_tokens": 9},
        engine={"factory": "m:f", "factory_options": {"api_key": "sk-2", "auth_token": "t2", "depth": 3,
                                                      "base_url": "https://u:p@api.example.com/v1?token=t3"}},
        output={"url": "abfs://c@acc.dfs.core.windows.net/o?sv=2020&sig=zz&se=1"}))
    red = spec.redacted()
    options = red["input"]["storage_options"]
    for key in ("account_key", "connection_string", "api_key", "password", "credentials", "sas_token",
                "session", "nested"):
        assert options[key] == "***" or options[key] == [{"private_key": "***"}], key
    assert options["client_kwargs"]["headers"] == {"Authorization": "***", "X-Api-Key": "***", "Accept": "json"}
    assert options["region_name"] == "eu-west-1"
    assert red["input"]["url"] == "s3://***@host/in?X-Amz-Signature=***&X-Amz-Credential=***&part=1"
    assert red["output"]["url"] == "abfs://c@acc.dfs.core.windows.net/o?sv=2020&sig=***&se=1"
    assert red["engine"]["factory_options"] == {"api_key": "***", "auth_token": "***", "depth": 3,
                                                "base_url": "https://***@api.example.com/v1?token=***"}
    assert red["sampling"]["stop_token_ids"] == [7, 8] and red["sampling"]["max_tokens"] == 9
    text = str(red)
    for secret in ("AK", "Zz==", "sk-1", "sk-2", "pw", "t1", "t2", "t3", "abc", "k2", "pk", "hunter2", "sig1"):
        assert f"'{secret}'" not in text and f"={secret}" not in text and f":{secret}@" not in text, secret


def test_redact_text_scrubs_exception_messages():
    msg = ("ClientError: GET https://b.s3.amazonaws.com/k?X-Amz-Security-Token=tok&X-Amz-Signature=s1 "
           "failed; Authorization: Bearer abc.def; conn AccountName=a;AccountKey=Zz==;EndpointSuffix=x; "
           "password: hunter2; max_tokens=5")
    assert redact_text(msg) == (
        "ClientError: GET https://b.s3.amazonaws.com/k?X-Amz-Security-Token=***&X-Amz-Signature=*** "
        "failed; Authorization: *** ***; conn AccountName=a;AccountKey=***;EndpointSuffix=x; "
        "password: ***; max_tokens=5")


def test_env_refs_resolve_where_the_spec_is_loaded(tmp_path, monkeypatch):
    path = tmp_path / "job.yaml"
    path.write_text("name: e\ninput: {url: 's3://b/in', prompt_column: p, storage_options: "
                    "{key: '${env:JR_KEY}', secret: '${env:JR_SECRET}'}}\noutput: {url: o}\n")
    monkeypatch.setenv("JR_KEY", "AKIA")
    monkeypatch.delenv("JR_SECRET", raising=False)
    with pytest.raises(SpecError, match=r"input\.storage_options\.secret: environment variable JR_SECRET"):
        load_spec(path)
    unresolved = load_spec(path, resolve_env=False)
    assert unresolved.input.storage_options == {"key": "${env:JR_KEY}", "secret": "${env:JR_SECRET}"}
    monkeypatch.setenv("JR_SECRET", "s3cr3t")
    spec = load_spec(path)
    assert spec.input.storage_options == {"key": "AKIA", "secret": "s3cr3t"}
    assert spec.redacted()["input"]["storage_options"] == {"key": "***", "secret": "***"}
    data, source = load_spec_data(path, ["sampling.max_tokens=3"])
    assert source == str(path) and data["input"]["storage_options"]["secret"] == "${env:JR_SECRET}"
    assert data["sampling"] == {"max_tokens": 3}


def test_every_field_is_described():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, JobSpec.__mro__[1]):
                walk(ann)
            assert model.model_config.get("extra") == "forbid"
    walk(JobSpec)


def test_no_declared_field_is_mistaken_for_a_secret():
    spec = load_spec(EXAMPLE, ["sampling.stop_token_ids=[1, 2]", "sampling.stop=['</s>']"])
    assert spec.redacted() == spec.model_dump(mode="json")


def test_sampling_is_user_data_not_secrets():
    data = _minimal(sampling={"stop": ["password: "]})
    assert plain_text_secrets(data) == []
    assert JobSpec.model_validate(data).redacted()["sampling"]["stop"] == ["password: "]
    assert plain_text_secrets(_minimal(engine={"factory_options": {"token": "t"}})) == ["engine.factory_options.token"]


def test_dataset_generation_keys_validate():
    spec = spec_from_dict(_minimal(
        sampling={"n": 4, "logprobs": 5, "prompt_logprobs": 0, "min_p": 0.1, "presence_penalty": 0.5,
                  "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                  "min_tokens": 2, "logit_bias": {"7": 1.5}, "include_stop_str_in_output": True},
        output={"url": "o", "keep_columns": "*", "format": "messages"}))
    assert spec.sampling.n == 4 and spec.sampling.logit_bias == {7: 1.5} and spec.output.keep_columns == "*"
    schema = spec_from_dict(_minimal(sampling={"json_schema": '{"type": "object"}', "n": 2}))
    assert schema.sampling.json_schema == '{"type": "object"}'  # kept as written; the engine parses it per job
    batch = spec_from_dict({"name": "t", "input": {"url": "b.jsonl", "format": "openai_batch",
                                                   "chat_template_kwargs": {"enable_thinking": False}},
                            "output": {"url": "o"}})
    assert batch.input.format == "openai_batch" and batch.input.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(("sampling", "message"), [
    ({"n": 0}, r"sampling\.n: Input should be greater than or equal to 1"),
    ({"logprobs": 21}, r"sampling\.logprobs: Input should be less than or equal to 20"),
    # the engine's own checks (SamplingParams), run once on the whole section when the spec is read
    ({"json_schema": "{not json"}, r"sampling: sampling parameter 'json_schema' is not valid JSON"),
    ({"json_schema": "[1]"}, r"'json_schema' must be a JSON schema object \(a mapping or its JSON text\), got \[1\]"),
    ({"regex": "a+", "choice": ["a"]}, r"'regex/choice' must be used alone \(at most one of json_schema, regex"),
    ({"choice": []}, r"'choice' must be a non-empty list of non-empty strings, got \(\)"),
    ({"min_tokens": 200}, r"'min_tokens' must be an integer in 0\.\.max_tokens \(128\), got 200"),
    ({"json_schema": '{"type": "object"}', "min_tokens": 2}, r"'min_tokens' must be 0 with json_schema, got 2"),
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


def test_lora_adapter_keys():
    spec = spec_from_dict(_minimal(model={"adapters": {"sql": "org/sql-lora", "chat": "s3://b/chat"}},
                                   input={"url": "x.parquet", "prompt_column": "p", "adapter_column": "lora"}))
    assert spec.model.adapters == {"sql": "org/sql-lora", "chat": "s3://b/chat"}
    assert spec.input.adapter_column == "lora"
    adapter_input = {"url": "x.parquet", "prompt_column": "p", "adapter_column": "lora"}
    with pytest.raises(SpecError, match="input.adapter_column.*model.adapters"):
        spec_from_dict(_minimal(input=adapter_input))
    with pytest.raises(SpecError, match="engine.deterministic is not supported with model.adapters"):
        spec_from_dict(_minimal(model={"adapters": {"a": "d"}}, engine={"deterministic": True}))
    with pytest.raises(SpecError, match="adapter name ' a'"):
        spec_from_dict(_minimal(model={"adapters": {" a": "d"}}))
    with pytest.raises(SpecError, match="adapter_column"):
        spec_from_dict(_minimal(model={"adapters": {"a": "d"}},
                                input={"url": "x.jsonl", "format": "openai_batch", "adapter_column": "lora"}))


@pytest.mark.parametrize("extra, message", [
    ({"input": {"url": "x", "prompt_column": "p", "completion_column": "c"}},
     r"input\.completion_column is scored by task: score"),
    ({"task": "embed", "input": {"url": "x", "prompt_column": "p", "sampling_column": "s"}},
     r"task embed generates no text: input\.sampling_column do not apply"),
    ({"task": "score", "sampling": {"n": 2}}, r"task score generates no text: sampling\.n > 1"),
    ({"task": "score", "input": {"url": "b.jsonl", "format": "openai_batch"}}, r"task embed \(/v1/embeddings\)"),
    ({"task": "embed", "embed": {"pooling": "max"}}, r"embed\.pooling"),
    ({"task": "classify"}, r"task"),
])
def test_embed_and_score_settings_are_checked(extra, message):
    with pytest.raises(SpecError, match=message):
        spec_from_dict(_minimal(**extra))


def test_embed_and_score_specs_validate():
    spec = spec_from_dict(_minimal(task="embed", embed={"pooling": "mean", "normalize": True}))
    assert (spec.task, spec.embed.pooling, spec.embed.normalize) == ("embed", "mean", True)
    assert spec_from_dict(_minimal()).embed.normalize == "auto"
    spec = spec_from_dict(_minimal(task="score", input={"url": "x", "prompt_column": "p", "completion_column": "c"}))
    assert spec.input.completion_column == "c"
