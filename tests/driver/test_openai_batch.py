"""OpenAI batch request bodies -> prompt + sampling overrides, and result lines parsed by the openai package."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from jobrunner.driver.openai_batch import parse_request, result_lines

CHAT = "/v1/chat/completions"


def _parse(body, url=CHAT, method="POST"):
    return parse_request(method, url, json.dumps(body))


def test_chat_body_fields_become_sampling_overrides():
    body = {"model": "gpt-4o-mini", "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "n": 3,
            "stop": "END", "seed": 4, "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.1,
            "frequency_penalty": 0.2, "logit_bias": {"17": -100}, "min_p": 0.05, "user": "u",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            "messages": [{"role": "system", "content": "be short"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "chat_template_kwargs": {"enable_thinking": False}}
    parsed = _parse(body)
    assert parsed.endpoint == "chat"
    assert parsed.prompt == [{"role": "system", "content": "be short"}, {"role": "user", "content": "a\nb"}]
    assert parsed.overrides == {"max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "n": 3, "stop": ["END"],
                                "seed": 4, "logprobs": 2, "presence_penalty": 0.1, "frequency_penalty": 0.2,
                                "logit_bias": {17: -100.0}, "min_p": 0.05, "json_schema": {"type": "object"}}
    assert parsed.chat_template_kwargs == {"enable_thinking": False}
    assert _parse({"messages": [{"role": "user", "content": "x"}], "logprobs": True}).overrides == {"logprobs": 0}
    assert _parse({"messages": [{"role": "user", "content": "x"}],
                   "response_format": {"type": "json_object"}}).overrides == {"json_schema": {"type": "object"}}


def test_completions_body():
    parsed = _parse({"prompt": "Once", "max_tokens": 5, "logprobs": 3, "echo": False}, url="/v1/completions")
    assert (parsed.endpoint, parsed.prompt, parsed.overrides) == ("completions", "Once",
                                                                  {"max_tokens": 5, "logprobs": 3})
    assert _parse({"prompt": [[1, 2, 3]]}, url="/v1/completions").prompt == [1, 2, 3]


@pytest.mark.parametrize(("body", "url", "message"), [
    ({"messages": [{"role": "user", "content": "x"}], "functions": []}, CHAT,
     r"body field\(s\) functions not supported"),  # the deprecated form; tools are taken
    ({"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}, CHAT, "body.tools must be a list"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, CHAT,
     r"body.tools\[0\] must be \{type: function"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, CHAT, "body.stream"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, CHAT, "needs body.logprobs: true"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, CHAT,
     "body.response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}, CHAT, "body.logit_bias"),
    ({"messages": []}, CHAT, "body.messages must be a non-empty list"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, CHAT, "needs image_url.url"),
    ({"prompt": ["a", "b"]}, "/v1/completions", "one non-empty string"),
    ({"prompt": "a", "echo": True}, "/v1/completions", "body.echo"),
    ({"prompt": "a", "messages": []}, "/v1/completions", r"messages not supported for /v1/completions"),
    ({"input": "a"}, "/v1/moderations", "url '/v1/moderations': must be one of"),
    ({"input": ["a", "b"]}, "/v1/embeddings", "one input per line"),
    ({"input": "a", "dimensions": 8}, "/v1/embeddings", "body.dimensions"),
    ({"input": "a", "encoding_format": "base64"}, "/v1/embeddings", "only float"),
    ({"input": "a", "temperature": 0}, "/v1/embeddings", "temperature not supported for /v1/embeddings"),
])
def test_bad_requests_name_the_field(body, url, message):
    with pytest.raises(ValueError, match=message):
        _parse(body, url=url)


def test_bad_method_and_body():
    with pytest.raises(ValueError, match="only POST"):
        _parse({"prompt": "x"}, method="GET")
    with pytest.raises(ValueError, match="body must be a JSON object"):
        parse_request("POST", CHAT, "[1]")
    with pytest.raises(ValueError, match="body is missing"):
        parse_request("POST", CHAT, None)


def _lp(token, logprob, tops):
    return {"token_id": 1, "token": token, "logprob": logprob,
            "top_logprobs": [{"token_id": 2, "token": t, "logprob": v} for t, v in tops]}


def _row(custom_id, index, text, logprobs=None, **extra):
    row = {"id": custom_id, "sample_index": index, "generated_text": text, "finish_reason": "stop",
           "error": None, "num_prompt_tokens": 7, "num_output_tokens": 2, "logprobs": logprobs}
    row.update(extra)
    return row


def test_result_lines_parse_as_openai_types():
    rows = [_row("c1", 1, "B", [_lp("B", -0.5, [("B", -0.5), ("A", -1.0)])]),
            _row("c1", 0, "A", [_lp("A", -0.25, [("A", -0.25), ("B", -2.0)])]),
            _row("t1", 0, " once", [_lp(" on", -0.1, [(" on", -0.1)]), _lp("ce", -0.2, [("ce", -0.2)])]),
            _row("e1", 0, None, finish_reason="error", error="bad schema", _status=400),
            _row("e2", 0, None, finish_reason="error", error="engine boom", _status=500)]
    outputs, errors = result_lines(rows, {"c1": "chat", "t1": "completions"}, "tiny", "job", created=123)
    assert [line["custom_id"] for line in outputs] == ["c1", "t1"]
    chat = ChatCompletion.model_validate(outputs[0]["response"]["body"])
    assert outputs[0]["response"]["status_code"] == 200 and outputs[0]["error"] is None
    assert [c.message.content for c in chat.choices] == ["A", "B"] and [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.prompt_tokens == 7 and chat.usage.completion_tokens == 4 and chat.usage.total_tokens == 11
    assert chat.choices[0].logprobs.content[0].top_logprobs[1].token == "B"
    assert chat.choices[0].logprobs.content[0].top_logprobs[1].logprob == -2.0
    assert chat.model == "tiny" and chat.created == 123
    text = Completion.model_validate(outputs[1]["response"]["body"])
    assert text.choices[0].text == " once" and text.choices[0].logprobs.tokens == [" on", "ce"]
    assert text.choices[0].logprobs.text_offset == [0, 3] and text.choices[0].logprobs.top_logprobs[1] == {"ce": -0.2}
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("e1", 400), ("e2", 500)]
    assert errors[0]["response"]["body"]["error"]["message"] == "bad schema"
    assert errors[0]["response"]["body"]["error"]["type"] == "invalid_request_error"
    again, _ = result_lines(rows, {"c1": "chat", "t1": "completions"}, "tiny", "job", created=123)
    assert again == outputs  # ids are stable (a retried shard writes the same lines)


def test_logprob_bytes_are_the_token_bytes_through_a_part():
    """A character split over tokens: each piece's text is U+FFFD, its `bytes` are its own raw bytes (engine
    entry -> row -> Parquet part -> result line), and the pieces join back into the character."""
    import io

    import pyarrow.parquet as pq

    from jobrunner.driver.rows import token_logprobs
    from jobrunner.engine import TokenLogprob, TopLogprob
    from jobrunner.io.parts import rows_to_table

    def entry(token_id, raw):
        text = raw.decode(errors="replace")
        return TokenLogprob(token_id, text, -0.5, [TopLogprob(token_id, text, -0.5, raw)], raw)

    engine_entries = [entry(7, b" caf"), entry(8, b"\xc3"), entry(9, b"\xa9")]  # " café" as 3 tokens
    row = _row("c1", 0, " café", token_logprobs(engine_entries), num_output_tokens=3)
    buf = io.BytesIO()
    pq.write_table(rows_to_table([row]), buf)
    stored = pq.read_table(io.BytesIO(buf.getvalue())).to_pylist()[0]
    assert [e["token_bytes"] for e in stored["logprobs"]] == [b" caf", b"\xc3", b"\xa9"]
    legacy = _row("c2", 0, "A", [_lp("A", -0.25, [("A", -0.25)])])  # a part written without token_bytes
    outputs, _ = result_lines([stored, legacy], {"c1": "chat", "c2": "chat"}, "tiny", "job", created=1)
    content = ChatCompletion.model_validate(outputs[0]["response"]["body"]).choices[0].logprobs.content
    assert [t.token for t in content] == [" caf", "\ufffd", "\ufffd"]
    assert [t.bytes for t in content] == [list(b" caf"), [0xC3], [0xA9]]
    assert [t.top_logprobs[0].bytes for t in content] == [list(b" caf"), [0xC3], [0xA9]]
    assert bytes(b for t in content for b in t.bytes).decode() == " café"
    legacy_content = ChatCompletion.model_validate(outputs[1]["response"]["body"]).choices[0].logprobs.content
    assert legacy_content[0].bytes == [ord("A")] and legacy_content[0].top_logprobs[0].bytes == [ord("A")]


def test_result_rows_of_parts_with_and_without_token_bytes(tmp_path):
    """A job resumed across the `token_bytes` schema change: old parts read with the field null."""
    import pyarrow as pa

    from jobrunner.io.openai_files import RESULT_COLUMNS, read_result_rows
    from jobrunner.io.parts import OUTPUT_SCHEMA, rows_to_table, write_part
    from jobrunner.io.storage import Storage

    old_top = pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64())])
    old_type = pa.list_(pa.struct([*old_top, ("top_logprobs", pa.list_(old_top))]))
    old_schema = pa.schema([f if f.name != "logprobs" else pa.field("logprobs", old_type) for f in OUTPUT_SCHEMA])
    storage = Storage(str(tmp_path / "out"))
    old = _row("c1", 0, "A", [_lp("A", -0.25, [("A", -0.25)])])
    new = _row("c2", 0, "B", [{**_lp("B", -0.5, []), "token_bytes": b"B"}])
    keys = [write_part(storage, "s0", rows_to_table([old], schema=old_schema)),
            write_part(storage, "s1", rows_to_table([new]))]
    rows = read_result_rows(storage, keys)
    assert set(rows[0]) == set(RESULT_COLUMNS)
    assert [r["logprobs"][0]["token_bytes"] for r in rows] == [None, b"B"]
    outputs, _ = result_lines(rows, {"c1": "chat", "c2": "chat"}, "tiny", "job", created=1)
    assert [o["response"]["body"]["choices"][0]["logprobs"]["content"][0]["bytes"] for o in outputs] == [[65], [66]]


def test_error_status_from_part_columns():
    from jobrunner.driver.output_files import error_status

    assert error_status({"error": None, "num_output_tokens": 3, "ttft_s": 0.1}) == 200
    assert error_status({"error": "bad n", "num_output_tokens": 0, "ttft_s": None}) == 400
    assert error_status({"error": "prompt too long", "num_output_tokens": 0, "ttft_s": None}) == 400
    assert error_status({"error": "engine died", "num_output_tokens": 2, "ttft_s": 0.2}) == 500
