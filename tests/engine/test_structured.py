"""Structured output: every row parses and validates (jsonschema), regex and choice hold, bad specs are named."""

import json
import re
import sys

import jsonschema
import pytest
from tiny import CORPUS, engine_from_hf

from jobrunner.engine import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "note": {"type": "string", "maxLength": 3},  # free characters: no raw control characters may pass
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags", "note"],
    "additionalProperties": False,
}


@pytest.fixture
def engine(hf_llama, tokenizer):
    return engine_from_hf(hf_llama, tokenizer, block_size=4)


def test_every_json_row_parses_and_validates(engine):
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=i, json_schema=SCHEMA if i % 2 else
                             json.dumps(SCHEMA)) for i in range(6)]
    plain = SamplingParams(max_tokens=10, temperature=1.0, seed=0)  # an unconstrained row in the same batch
    outs = engine.generate([CORPUS[i % 5] for i in range(7)], params + [plain])
    for out in outs[:6]:
        assert out.finish_reason == "stop", out.text  # the grammar ended and forced EOS
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs[:6]}) > 1
    assert len(outs[6].output_token_ids) == 10


def test_n_samples_each_follow_the_grammar(engine):
    schema = {"type": "object", "properties": {"color": SCHEMA["properties"]["color"], "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}
    outs = engine.generate([CORPUS[2]], SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=3,
                                                       json_schema=schema, logprobs=2))
    for out in outs:
        jsonschema.validate(json.loads(out.text), schema)
        assert len(out.logprobs) == len(out.output_token_ids)


def test_grammar_end_stops_even_with_ignore_eos(engine, tokenizer):
    out = engine.generate([CORPUS[1]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                      choice=("alpha", "beta")))[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
    assert out.output_token_ids[-1] == tokenizer.eos_token_id


def test_regex_and_choice(engine):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    choices = ("yes", "no", "maybe so")
    outs = engine.generate([CORPUS[0]] * 6, [SamplingParams(max_tokens=30, temperature=1.0, seed=i, regex=pattern)
                                             for i in range(3)] +
                           [SamplingParams(max_tokens=30, temperature=1.0, seed=i, choice=choices) for i in range(3)])
    for out in outs[:3]:
        assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop"
    for out in outs[3:]:
        assert out.text in choices and out.finish_reason == "stop"


@pytest.mark.parametrize("values, message", [
    ({"json_schema": {"type": "foo"}}, "json_schema.*Unsupported type"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "json_schema"),
    ({"json_schema": {"type": "string", "not": {"const": "x"}}}, "json_schema.*'not'"),
    ({"json_schema": {"type": "object", "properties": {"not": {"type": "array", "uniqueItems": True}}}},
     "'uniqueItems' at #/properties/not"),
    ({"regex": "(("}, "regex.*parenthesis"),
])
def test_bad_spec_raises_at_add_request(engine, values, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", CORPUS[0], SamplingParams(**values))
    assert not engine.has_unfinished_requests()
    engine.add_request("bad", CORPUS[0], SamplingParams(max_tokens=2))  # the id was not taken


@pytest.mark.parametrize("values, message", [
    ({"json_schema": "{not json"}, "json_schema.*not valid JSON"),
    ({"json_schema": [1]}, "json_schema"),
    ({"regex": "a", "choice": ["a"]}, "regex/choice"),
    ({"choice": []}, "choice"),
    ({"choice": ["a"], "min_tokens": 2}, "min_tokens"),
])
def test_bad_spec_values_are_named(values, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(values)


def test_without_xgrammar_a_structured_request_is_a_clear_error(engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if the optional extra were not installed
    with pytest.raises(ValueError, match="needs xgrammar"):
        engine.add_request("s", CORPUS[0], SamplingParams(choice=["a", "b"]))
    out = engine.generate([CORPUS[0]], SamplingParams(max_tokens=2, temperature=0))[0]
    assert out.error is None  # unconstrained requests are unaffected


def test_grammar_reports_a_rejected_token(tokenizer):
    from jobrunner.engine.sampling.structured import GrammarCompiler

    grammar = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).factory(
        SamplingParams(choice=["fox"]))()
    z = tokenizer.convert_tokens_to_ids("z")
    assert grammar.accept(z) is False and not grammar.is_terminated
    for token in tokenizer("fox", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]:
        assert grammar.accept(token) is True
    assert grammar.is_terminated
