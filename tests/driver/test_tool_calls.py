"""Tool calls: tools into the chat template, calls parsed back into OpenAI's tool_calls (hermes, llama3_json),
malformed calls kept as text with a warning, tool_choice forced through structured output; the OpenAI batch
path end to end through the openai package's own types."""

from __future__ import annotations

import json

import pytest

from jobrunner.driver.openai_batch import parse_request, result_lines
from jobrunner.driver.rows import RowRequest, has_tools, job_output_schema, job_sampling, output_row, to_request
from jobrunner.driver.tool_calls import (
    choose_tool_parser,
    forced_call_schema,
    openai_tool_calls,
    parse_forced_call,
    parse_tool_calls,
)
from jobrunner.engine import SamplingParams
from jobrunner.engine.request import RequestMetrics, RequestOutput
from jobrunner.io.reader import ROW_INDEX
from jobrunner.spec import SpecError, spec_from_dict
from tests.engine.tiny import engine_from_hf, make_hf_model, make_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
# Qwen / Hermes convention: the tools in the system turn, calls between <tool_call> tags
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools; reply with <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call>\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_hermes_calls_and_the_text_around_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    parsed = parse_tool_calls("hermes", text)
    assert parsed.content == "Let me check." and parsed.warning is None
    assert parsed.calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                            {"name": "get_time", "arguments": "{}"}]
    bad = parse_tool_calls("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>')
    assert bad.calls == [] and bad.content.startswith("<tool_call>")
    assert bad.warning.startswith("tool call 1 is not valid JSON") and "kept as text" in bad.warning
    assert parse_tool_calls("hermes", "just words").calls == []


def test_llama3_json_calls():
    one = parse_tool_calls("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert one.content is None and one.calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    two = parse_tool_calls("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_time", '
                                          '"parameters": {}}')
    assert [c["name"] for c in two.calls] == ["get_time", "get_time"]
    assert parse_tool_calls("llama3_json", "The weather is fine.").calls == []  # an ordinary answer
    assert parse_tool_calls("llama3_json", '{"parameters": {}}').warning.startswith("tool call 1 has no function")


def test_auto_reads_the_template_and_ids_are_stable():
    hermes = make_tokenizer()
    hermes.chat_template = HERMES_TEMPLATE
    assert choose_tool_parser("auto", hermes) == "hermes"
    assert choose_tool_parser("auto", None, "...Environment: ipython...") == "llama3_json"
    assert choose_tool_parser("auto", make_tokenizer()) is None and choose_tool_parser("none", hermes) is None
    calls = [{"name": "get_time", "arguments": "{}"}]
    first = openai_tool_calls(calls, "row-1", 0)
    assert first == openai_tool_calls(calls, "row-1", 0) != openai_tool_calls(calls, "row-1", 1)
    assert first[0]["id"].startswith("call_") and first[0]["type"] == "function"


def test_tool_choice_forces_a_call_through_a_schema():
    named = forced_call_schema([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named["properties"]["name"] == {"const": "get_weather"}
    assert named["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert len(forced_call_schema([WEATHER, TIME], "required")["anyOf"]) == 2
    assert forced_call_schema([WEATHER], "auto") is None
    with pytest.raises(ValueError, match="names function 'nope', which is not among the tools"):
        forced_call_schema([WEATHER], {"type": "function", "function": {"name": "nope"}})
    assert parse_forced_call('{"name": "get_time", "arguments": {}}').calls == [{"name": "get_time",
                                                                                  "arguments": "{}"}]


def _spec(**inp):
    base = {"url": "x", "prompt_column": "prompt", "id_column": "id"}
    return spec_from_dict({"name": "t", "input": {**base, **inp}, "output": {"url": "o"},
                           "sampling": {"max_tokens": 8}})


def test_rows_with_tools_become_chats_with_the_tools_in_the_template():
    spec = _spec(tools=[WEATHER], tools_column="tools", tool_choice="required")
    assert has_tools(spec) and {"tool_calls", "tool_call_warning"} <= set(job_output_schema(spec).names)
    assert not has_tools(_spec()) and "tool_calls" not in job_output_schema(_spec()).names
    row = {ROW_INDEX: 0, "id": "a", "prompt": "Weather in Paris?", "tools": None}
    req = to_request(spec, "f", row, job_sampling(spec))
    assert req.prompt == [{"role": "user", "content": "Weather in Paris?"}]
    assert req.chat_template_kwargs == {"tools": [WEATHER]} and req.forced_tool
    assert req.params.json_schema == forced_call_schema([WEATHER], "required")
    own = to_request(spec, "f", {**row, "tools": json.dumps([TIME])}, job_sampling(spec))
    assert own.tools == [TIME]
    bad = to_request(spec, "f", {**row, "tools": "{not json"}, job_sampling(spec))
    assert bad.error.startswith("tools column 'tools' is not valid JSON")
    with pytest.raises(SpecError, match="tool_choice must be auto, none, required"):
        _spec(tools=[WEATHER], tool_choice="always")


def _out(text: str) -> RequestOutput:
    return RequestOutput(request_id="r", prompt_token_ids=[1], output_token_ids=[2], text=text, finish_reason="stop",
                         error=None, metrics=RequestMetrics(arrival_time=0.0))


def test_output_rows_carry_openai_tool_calls():
    spec = _spec(tools=[WEATHER])
    req = to_request(spec, "f", {ROW_INDEX: 0, "id": "a", "prompt": "Weather?"}, job_sampling(spec))
    row = output_row(spec, req, _out('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
                     None, "hermes")
    assert row["finish_reason"] == "tool_calls" and row["generated_text"] is None
    assert row["tool_calls"] == openai_tool_calls([{"name": "get_weather", "arguments": '{"city": "Oslo"}'}], "a", 0)
    no_tools = RowRequest("b", 1, "hi", SamplingParams(max_tokens=4))  # a row without tools is never parsed
    plain = output_row(spec, no_tools, _out("<tool_call>{}</tool_call>"), None, "hermes")
    assert plain["tool_calls"] is None and plain["finish_reason"] == "stop"


def test_openai_batch_tools_round_trip_through_the_openai_types():
    from openai.types.chat import ChatCompletion

    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_1", "type": "function",
                              "function": {"name": "get_time", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}],
            "tools": [WEATHER, TIME], "tool_choice": "auto"}
    parsed = parse_request("POST", "/v1/chat/completions", json.dumps(body))
    assert parsed.tools == [WEATHER, TIME] and parsed.tool_choice == "auto"
    assert parsed.prompt[1]["tool_calls"][0]["id"] == "call_1" and parsed.prompt[2]["tool_call_id"] == "call_1"
    calls = openai_tool_calls([{"name": "get_weather", "arguments": '{"city": "Oslo"}'}], "q1", 0)
    row = {"id": "q1", "sample_index": 0, "generated_text": None, "finish_reason": "tool_calls", "error": None,
           "num_prompt_tokens": 10, "num_output_tokens": 12, "ttft_s": 0.1, "logprobs": None, "tool_calls": calls}
    outputs, _ = result_lines([row], {"q1": "chat"}, "m", "job")
    completion = ChatCompletion.model_validate(outputs[0]["response"]["body"])
    call = completion.choices[0].message.tool_calls[0]
    assert completion.choices[0].finish_reason == "tool_calls"
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (calls[0]["id"], "get_weather",
                                                                                  {"city": "Oslo"})


def test_the_real_engine_writes_a_forced_call_that_parses():
    # a tiny random model, tools in a Hermes template, tool_choice naming get_weather: structured output makes
    # the reply that call's JSON, and the worker's parse turns it into an OpenAI tool call
    tok = make_tokenizer()
    tok.chat_template = HERMES_TEMPLATE
    hf = make_hf_model("llama", vocab_size=len(tok))
    engine = engine_from_hf(hf, tok, block_size=4)
    spec = _spec(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    spec = spec.model_copy(update={"sampling": spec.sampling.model_copy(update={"max_tokens": 60})})
    req = to_request(spec, "f", {ROW_INDEX: 0, "id": "a", "prompt": "Weather in Paris?"}, job_sampling(spec))
    prompt_text = tok.apply_chat_template(req.prompt, tokenize=False, add_generation_prompt=True,
                                          **req.chat_template_kwargs)
    assert '"name": "get_weather"' in prompt_text  # the tools reached the template
    engine.add_request("a", req.prompt, req.params, chat_template_kwargs=req.chat_template_kwargs)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    row = output_row(spec, req, outs[0], None, choose_tool_parser("auto", engine.tokenizer))
    assert row["finish_reason"] == "tool_calls", row
    call = row["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in ("Paris", "Oslo")
