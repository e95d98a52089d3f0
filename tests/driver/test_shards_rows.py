"""Shard planning and row -> request conversion (no Ray)."""

from __future__ import annotations

import pytest

from jobrunner.driver.rows import job_sampling, to_request
from jobrunner.driver.shards import plan_shards
from jobrunner.io.reader import ROW_ERROR, ROW_INDEX, InputFile
from jobrunner.spec import spec_from_dict


def _file(name: str, groups: tuple[int, ...]) -> InputFile:
    return InputFile(url=f"file:///d/{name}.parquet", stem=name, num_rows=sum(groups),
                     row_group_num_rows=groups)


def test_plan_is_stable_and_covers_every_row():
    files = [_file("a", (10, 10, 10)), _file("b", (100,)), _file("c", (5, 50, 5))]
    shards = plan_shards(files, 25)
    assert shards == plan_shards(files, 25)
    assert [(s.file_stem, s.row_start, s.row_end) for s in shards] == [
        ("a", 0, 20), ("a", 20, 30), ("b", 0, 25), ("b", 25, 50), ("b", 50, 75), ("b", 75, 100),
        ("c", 0, 5), ("c", 5, 30), ("c", 30, 55), ("c", 55, 60)]
    assert len({s.shard_id for s in shards}) == len(shards)
    assert plan_shards(files, 26)[0].shard_id == shards[0].shard_id  # same range, same id
    assert plan_shards(files, 5)[0].shard_id != shards[0].shard_id


def _spec(**inp):
    base = {"url": "x", "prompt_column": "prompt", "id_column": "id", "sampling_column": "params"}
    return spec_from_dict({"name": "t", "input": {**base, **inp}, "output": {"url": "o"},
                           "sampling": {"max_tokens": 5}})


def _request(spec, stem, row):
    return to_request(spec, stem, row, job_sampling(spec))


def test_rows_become_requests_or_error_rows():
    spec = _spec()
    ok = _request(spec, "f", {ROW_INDEX: 0, "id": "a", "prompt": "hi there", "params": '{"max_tokens": 2}'})
    assert ok.error is None and ok.prompt == "hi there" and ok.params.max_tokens == 2
    default = _request(spec, "f", {ROW_INDEX: 1, "id": "b", "prompt": "x", "params": None})
    assert default.params.max_tokens == 5
    null = _request(spec, "f", {ROW_INDEX: 2, "id": "c", "prompt": None, "params": None})
    assert "prompt column 'prompt' is null or empty" in null.error
    bad = _request(spec, "f", {ROW_INDEX: 3, "id": "d", "prompt": "x", "params": '{"max_tokens": -1}'})
    assert bad.error == ("bad sampling override in column 'params': sampling parameter 'max_tokens' must be an "
                         "integer >= 1, got -1")
    unknown = _request(spec, "f", {ROW_INDEX: 4, "id": "e", "prompt": "x", "params": '{"nope": 1}'})
    assert unknown.error.startswith("bad sampling override in column 'params': unknown sampling parameter(s): "
                                    "nope; known: choice, frequency_penalty, ")
    no_id = _request(spec, "f", {ROW_INDEX: 5, "id": None, "prompt": "x", "params": None})
    assert no_id.row_id == "f:5" and "id column 'id' is null" in no_id.error
    msgs = _request(spec_from_dict({"name": "t", "input": {"url": "x", "messages_column": "m"},
                                      "output": {"url": "o"}}), "f",
                      {ROW_INDEX: 7, "m": [{"role": "user", "content": "hello"}]})
    assert msgs.row_id == "f:7" and msgs.prompt == [{"role": "user", "content": "hello"}]



def test_a_jobs_sampling_is_built_once_and_a_rows_overrides_replace_only_what_they_name():
    spec = _spec(url="x")
    spec = spec_from_dict({**spec.model_dump(mode="json"), "sampling": {"max_tokens": 5, "regex": "[ab]+",
                                                                      "stop": ["."]}})
    base = job_sampling(spec)
    plain = to_request(spec, "f", {ROW_INDEX: 0, "id": "a", "prompt": "x", "params": None}, base)
    assert plain.params is base  # no override: the job's own object, not a copy per row
    row = to_request(spec, "f", {ROW_INDEX: 1, "id": "b", "prompt": "x",
                                 "params": '{"choice": ["yes", "no"], "temperature": 0.5}'}, base)
    # the row's constraint replaces the job's regex; what it does not name stays the job's
    assert (row.params.choice, row.params.regex, row.params.temperature) == (("yes", "no"), None, 0.5)
    assert (row.params.max_tokens, row.params.stop) == (5, (".",))
    assert (base.regex, base.choice, base.temperature) == ("[ab]+", None, 0.0)

def test_kept_columns_star_and_clashes():
    from jobrunner.driver.rows import kept_columns

    def spec(keep, fmt="parquet", **inp):
        return spec_from_dict({"name": "t", "input": {"url": "x", "messages_column": "messages", "id_column": "id",
                                                      **inp}, "output": {"url": "o", "keep_columns": keep,
                                                                         "format": fmt}})

    cols = ["id", "messages", "topic", "_private", ROW_INDEX]
    assert kept_columns(spec("*"), cols) == ["messages", "topic"]  # `id` is the output id itself
    assert kept_columns(spec("*", "messages"), cols) == ["topic"]  # the output messages extend the input's
    assert kept_columns(spec(["topic"]), cols) == ["topic"]
    with pytest.raises(ValueError, match=r"input column\(s\) 'error', 'sample_index' have the name of an output"):
        kept_columns(spec("*"), ["id", "error", "sample_index", "messages"])
    with pytest.raises(ValueError, match=r"'id' have the name of an output column"):
        kept_columns(spec(["id"]), cols)
    with pytest.raises(ValueError, match=r"'messages' have the name"):
        kept_columns(spec(["messages"], "messages"), cols)
    with pytest.raises(ValueError, match=r"'id' have the name"):
        kept_columns(spec("*", id_column="key"), ["key", "id", "messages"])


def test_openai_batch_rows_become_requests_or_error_rows():
    import json

    spec = spec_from_dict({"name": "t", "input": {"url": "b.jsonl", "format": "openai_batch"},
                           "sampling": {"max_tokens": 5}, "output": {"url": "o"}})
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    ok = _request(spec, "b", {ROW_INDEX: 0, "custom_id": "r0", "method": "POST", "url": "/v1/chat/completions",
                                "body": json.dumps(body), ROW_ERROR: None})
    assert ok.error is None and ok.row_id == "r0" and ok.endpoint == "chat"
    assert ok.prompt == body["messages"]
    bad_line = _request(spec, "b", {ROW_INDEX: 1, "custom_id": None, "method": None, "url": None,
                                      "body": "{x", ROW_ERROR: "line 2 is not valid JSON"})
    assert bad_line.row_id == "b:1" and bad_line.error == "line 2 is not valid JSON"
    no_id = _request(spec, "b", {ROW_INDEX: 2, "custom_id": None, "method": "POST",
                                   "url": "/v1/chat/completions", "body": json.dumps(body), ROW_ERROR: None})
    assert no_id.error == "id column 'custom_id' is null (row b:2)"
    unknown = _request(spec, "b", {ROW_INDEX: 3, "custom_id": "r3", "method": "POST",
                                     "url": "/v1/chat/completions", "body": json.dumps({**body, "functions": []}),
                                     ROW_ERROR: None})
    assert unknown.error == "body field(s) functions not supported for /v1/chat/completions"


def test_a_shared_system_prompt_leads_every_chat_row_unless_the_row_brings_its_own():
    system = {"role": "system", "content": "You answer in French."}
    msgs = _spec(prompt_column=None, messages_column="m", sampling_column=None, id_column=None,
                 system_prompt=system["content"])
    user = [{"role": "user", "content": "hello"}]
    assert _request(msgs, "f", {ROW_INDEX: 0, "m": user}).prompt == [system, *user]
    own = [{"role": "system", "content": "Be terse."}, *user]
    assert _request(msgs, "f", {ROW_INDEX: 1, "m": own}).prompt == own  # the row's own system message wins
    text = _spec(sampling_column=None, system_prompt=system["content"])
    row = _request(text, "f", {ROW_INDEX: 2, "id": "a", "prompt": "hello"})
    assert row.prompt == [system, *user]  # a raw prompt becomes a two-message chat
    assert _request(_spec(sampling_column=None), "f", {ROW_INDEX: 3, "id": "b", "prompt": "hello"}).prompt == "hello"


def test_a_system_prompt_column_overrides_the_shared_one_per_row():
    spec = _spec(sampling_column=None, system_prompt="shared", system_prompt_column="sys")
    rows = [{ROW_INDEX: i, "id": str(i), "prompt": "q", "sys": value} for i, value in
            enumerate(["own", None, "  ", 7])]
    got = [_request(spec, "f", row) for row in rows]
    assert [r.prompt[0]["content"] for r in got[:3]] == ["own", "shared", "shared"]
    assert got[3].prompt is None and got[3].error == "system prompt column 'sys' holds int, not a string"
    only_column = _spec(sampling_column=None, system_prompt_column="sys")
    assert _request(only_column, "f", {ROW_INDEX: 0, "id": "a", "prompt": "q", "sys": None}).prompt == "q"


def test_openai_batch_files_refuse_a_system_prompt_setting():
    with pytest.raises(ValueError, match="unset system_prompt"):
        spec_from_dict({"name": "t", "input": {"url": "x", "format": "openai_batch", "system_prompt": "s"},
                        "output": {"url": "o"}})
