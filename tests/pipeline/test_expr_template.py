"""The pure parts of pipelines: the filter evaluator (never eval), templates, the handoff rules, stage specs."""

from __future__ import annotations

import json

import pytest

from jobrunner.pipeline.expr import FilterError, FilterSyntaxError, parse_filter
from jobrunner.pipeline.handoff import Handoff, NextRequest, first_json_object, parse_output_column
from jobrunner.pipeline.template import TemplateError, TemplateSyntaxError, parse_template
from jobrunner.spec import SpecError, spec_from_dict


@pytest.mark.parametrize(("text", "row", "kept"), [
    ("json_valid and score >= 7", {"json_valid": True, "score": 7}, True),
    ("json_valid and score >= 7", {"json_valid": True, "score": 6.5}, False),
    ("json_valid and score >= 7", {"json_valid": True, "score": None}, False),  # order with null: false
    ("score == null", {"score": None}, True),
    ("score is None or score < 0", {"score": 3}, False),
    ("score is not None", {}, False),  # an absent column is null
    ("not (topic in ['a', 'b'])", {"topic": "c"}, True),
    ("topic not in ('a', 'b')", {"topic": "a"}, False),
    ("'cat' in text", {"text": "a cat sat"}, True),
    ("1 < n <= 3", {"n": 3}, True),
    ("1 < n <= 3", {"n": 4}, False),
    ("n * 2 + 1 == 7 and n / 0 == null", {"n": 3}, True),  # division by zero is null, not a crash
    ("-n > -5 and true", {"n": 3}, True),
    ("generate.finish_reason != 'length' or false", {"generate.finish_reason": "stop"}, True),
    ("ok", {"ok": 0}, False),
])
def test_filter_semantics(text, row, kept):
    assert parse_filter(text).keeps(row, "r1") is kept


def test_filter_columns_are_the_names_it_reads():
    assert parse_filter("json_valid and score >= 7 or a.b == null").columns == ("json_valid", "score", "a.b")


@pytest.mark.parametrize("text", ["__import__('os').system('x')", "score.bit_length()", "(lambda: 1)()",
                                  "[x for x in y]", "a if b else c", "x[0]", "f'{x}'", "a := 1", "x ** 2",
                                  "{1: 2}", "b'x' == y", "", "score >="])
def test_filter_refuses_anything_but_the_whitelist(text):
    with pytest.raises(FilterSyntaxError):
        parse_filter(text)


def test_filter_row_error_names_the_column_and_the_row():
    with pytest.raises(FilterError, match=r"row p016: cannot compare column 'topic' \(the string 't1'\) with 3"):
        parse_filter("topic > 3").keeps({"topic": "t1"}, "p016")
    with pytest.raises(FilterError, match="column 'n' is the string 'x', not a number"):
        parse_filter("n + 1 > 2").keeps({"n": "x"}, "r")


def test_template_fills_columns_and_names_a_null_or_missing_one():
    t = parse_template('Rate as {{"score": n}}: {prompt} -> {generate.generated_text} ({n}, {ok}, {tags})')
    assert t.columns == ("prompt", "generate.generated_text", "n", "ok", "tags")
    row = {"prompt": "Q", "generate.generated_text": "A", "n": 3, "ok": True, "tags": ["x"]}
    assert t.render(row) == 'Rate as {"score": n}: Q -> A (3, true, ["x"])'
    with pytest.raises(TemplateError, match="template column 'prompt' is null"):
        t.render({**row, "prompt": None})
    with pytest.raises(TemplateError, match="template column 'n' is missing"):
        t.render({k: v for k, v in row.items() if k != "n"})
    for bad in ("a { b", "x }", "{1x}", "{a b}"):
        with pytest.raises(TemplateSyntaxError, match="stages.1.input.prompt"):
            parse_template(bad, "stages.1.input.prompt")


def test_first_json_object_and_output_columns():
    assert first_json_object('Sure. {"bad": } then {"score": 8, "why": {"a": 1}} and {"x": 2}') == \
        {"score": 8, "why": {"a": 1}}
    assert first_json_object("no json [1, 2]") is None and first_json_object(None) is None
    assert parse_output_column("s", "json.why.a") == ("why", "a")
    with pytest.raises(ValueError, match="output_columns.s"):
        parse_output_column("s", "regex:x")


def test_handoff_carries_renames_and_builds_the_next_request():
    nxt = NextRequest(prompt=parse_template("Judge: {prompt} -> {generated_text}"),
                      output_names=frozenset({"generated_text", "finish_reason", "error"}), stage="judge")
    rule = Handoff(stage="gen", output_columns={"score": ("score",)}, filter=parse_filter("score >= 5"), next=nxt)
    row = rule.enrich({"id": "r1", "prompt": "Q", "generated_text": 'ok {"score": 6}', "finish_reason": "stop",
                       "error": None, "ttft_s": 0.1, "topic": "t"})
    assert (row["score"], row["json_valid"]) == (6, True)
    assert rule.decide(row) == ("kept", None)
    assert rule.decide({**row, "error": "boom"}) == ("error", None)
    assert rule.decide({**row, "score": "high"})[0] == "filter_error"
    out = rule.next_row(row)
    assert out["_stage_prompt"] == 'Judge: Q -> ok {"score": 6}' and out["error"] is None
    assert out["gen.generated_text"] == 'ok {"score": 6}' and "generated_text" not in out  # renamed on clash
    assert out["topic"] == "t" and "ttft_s" not in out  # metrics are not carried
    bad = rule.next_row({**row, "prompt": None})
    assert bad["error"] == "stage judge: template column 'prompt' is null in row r1" and bad["_stage_prompt"] is None


def test_handoff_appends_messages_to_the_conversation():
    nxt = NextRequest(messages=(("user", parse_template("Shorter, please ({score}).")),), stage="rewrite")
    first = Handoff(stage="gen", next=nxt, base_prompt_column="prompt")
    out = first.next_row({"id": "r", "prompt": "Q", "generated_text": "A", "score": 7})
    chat = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
            {"role": "user", "content": "Shorter, please (7)."}]
    assert json.loads(out["_stage_messages"]) == chat and json.loads(out["conversation"]) == chat
    later = Handoff(stage="rewrite", next=nxt)  # a later stage continues the carried conversation
    again = later.next_row({"id": "r", "conversation": out["conversation"], "generated_text": "B", "score": 1})
    assert [m["content"] for m in json.loads(again["_stage_messages"])][-3:] == ["Shorter, please (7).", "B",
                                                                                   "Shorter, please (1)."]


def _pipeline(**judge) -> dict:
    return {"name": "p", "input": {"url": "in.parquet", "prompt_column": "prompt", "id_column": "id"},
            "sampling": {"max_tokens": 16, "seed_column": "seed"}, "engine": {"max_num_seqs": 4},
            "output": {"url": "/tmp/out-p", "mode": "incremental"},
            "stages": [{"name": "gen"}, {"name": "judge", "sampling": {"max_tokens": 8},
                                         "input": {"prompt": "{generated_text}"}, **judge}]}


def test_stage_specs_merge_the_job_sections_and_read_the_previous_stage():
    gen, judge = spec_from_dict(_pipeline(engine={"max_num_seqs": 2}, task="generate",
                                          cost={"usd_per_m_output": 2.0})).stage_specs()
    assert (gen.cost.usd_per_m_output, judge.cost.usd_per_m_output) == (None, 2.0)
    assert (gen.name, gen.output.url, gen.output.keep_columns, gen.output.mode) == \
        ("p.gen", "/tmp/out-p/stages/gen", "*", "incremental")
    assert (gen.sampling.max_tokens, gen.sampling.seed_column, gen.engine.max_num_seqs) == (16, "seed", 4)
    assert (judge.input.url, judge.input.prompt_column, judge.input.id_column) == \
        ("/tmp/out-p/stages/judge/_input/", "_stage_prompt", "id")
    assert (judge.output.url, judge.output.mode, judge.output.keep_columns) == ("/tmp/out-p/stages/judge", "resume",
                                                                                "*")
    # merged over the job's; the job's seed_column names an input column the judge's input does not have
    assert (judge.sampling.max_tokens, judge.sampling.seed_column, judge.engine.max_num_seqs) == (8, None, 2)


@pytest.mark.parametrize(("change", "message"), [
    ({"filter": "os.system('x')"}, "Call is not allowed"),
    ({"input": {"prompt": "{a b}"}}, "is not a column name"),
    ({"input": {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}}, "set one of prompt"),
    ({"input": None}, r"stages\[1\] \(judge\): set input.prompt or input.messages"),
    ({"name": "gen"}, "names must be unique"),
    ({"name": "Judge-1"}, "String should match pattern"),
    ({"engine": {"max_num_seqs": 0}}, r"stages\[1\] \(judge\): engine.max_num_seqs"),
    ({"output_columns": {"s": "score"}}, "json.<key>"),
])
def test_bad_stages_are_refused_naming_the_stage(change, message):
    data = _pipeline()
    data["stages"][1] = {k: v for k, v in {**data["stages"][1], **change}.items() if v is not None}
    with pytest.raises(SpecError, match=message):
        spec_from_dict(data)


def test_only_the_last_stage_may_sample_several_rows_per_id():
    data = _pipeline()
    data["stages"][0]["sampling"] = {"n": 2}
    with pytest.raises(SpecError, match=r"stages\[0\] \(gen\): sampling.n > 1 gives several rows per id"):
        spec_from_dict(data)
    data["stages"][0]["sampling"], data["stages"][1]["sampling"] = {}, {"n": 2}
    assert spec_from_dict(data).stage_specs()[1].sampling.n == 2


def test_the_first_stage_reads_the_jobs_input():
    data = _pipeline()
    data["stages"][0]["input"] = {"prompt": "{prompt}"}
    with pytest.raises(SpecError, match=r"stages\[0\] \(gen\): the first stage reads the job's input"):
        spec_from_dict(data)


def test_embed_and_score_stages_read_the_built_columns():
    data = _pipeline()
    data["stages"].append({"name": "embed_it", "task": "embed", "input": {"prompt": "{generated_text}"}})
    data["stages"].append({"name": "loglik", "task": "score",
                           "input": {"prompt": "{prompt}", "completion": "{generated_text}"}})
    gen, judge, embed, score = spec_from_dict(data).stage_specs()
    assert (embed.task, embed.input.prompt_column, embed.sampling.n) == ("embed", "_stage_prompt", 1)
    assert (score.task, score.input.prompt_column, score.input.completion_column) == \
        ("score", "_stage_prompt", "_stage_completion")
    rule = Handoff(stage="embed_it", next=NextRequest(prompt=parse_template("{prompt}"),
                                                      completion=parse_template("{generated_text}"),
                                                      stage="loglik"))
    out = rule.next_row({"id": "r", "prompt": "P", "generated_text": "G", "embedding": [0.5, 0.25]})
    assert out["embed_it.embedding"] == [0.5, 0.25] and out["embed_it.generated_text"] == "G"
    assert (out["_stage_prompt"], out["_stage_completion"]) == ("P", "G")
