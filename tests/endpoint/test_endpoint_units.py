"""engine.backend openai without a server: the sliding-window budgets, the request bodies and answers, the spec
keys and their checks, the API key never written by the spec's own paths."""

from __future__ import annotations

import json

import pytest

from jobrunner.endpoint_backend.limits import RateLimiter
from jobrunner.endpoint_backend.transport import Reply
from jobrunner.endpoint_backend.wire import error_message, parse_answer, request_body
from jobrunner.engine.sampling_params import SamplingParams
from jobrunner.redaction import redact_text
from jobrunner.spec import JobSpec, SpecError, load_spec
from tests.endpoint.proxy import Record, max_in_window


def _sends(limiter: RateLimiter, count: int, tokens: float, start: float = 0.0) -> list[float]:
    """The times `count` sends of `tokens` go when each goes as soon as the limiter lets it."""
    now, times = start, []
    for _ in range(count):
        now += limiter.wait_s(tokens, now)
        assert limiter.wait_s(tokens, now) == 0.0
        limiter.seen_by(limiter.take(tokens, now), now)  # at the server at once
        times.append(now)
    return times


def test_requests_budget_holds_in_every_window_and_spreads_the_minute():
    limiter = RateLimiter(requests_per_minute=60, tokens_per_minute=None)
    times = _sends(limiter, 150, 1)
    records = [Record(t, "/", "forwarded") for t in times]
    assert max_in_window(records, 60.0) == 60  # never more than the budget in any minute
    assert max_in_window(records, 10.0) == 10  # a sixth of it in any 10 s: spread, not one burst
    assert times[9] == 0.0 and times[10] == 10.0  # the short window's share at once, then the next 10 s
    assert times[-1] == 140.0  # 150 requests at 60 / min: 140 s, within the ideal of 150 s


def test_tokens_budget_and_usage_correction():
    limiter = RateLimiter(requests_per_minute=None, tokens_per_minute=600)
    grant = limiter.take(100, 0.0)  # the short window holds 100 tokens (600 / 6)
    assert limiter.wait_s(500, 0.0) == 10.0  # the full window holds the send in flight: it counts
    assert limiter.wait_s(100, 0.0) == 10.0
    limiter.seen_by(grant, 1.0)
    assert limiter.wait_s(501, 1.0) == 60.0  # counted until a minute after the server had it
    limiter.correct(grant, 40)  # the usage says 40: 60 tokens of room now
    assert limiter.wait_s(60, 1.0) == 0.0 and limiter.wait_s(61, 1.0) == 9.0
    assert limiter.never_fits(601) is not None and "tokens_per_minute=600" in limiter.never_fits(601)
    assert limiter.never_fits(600) is None


def test_a_send_larger_than_the_short_share_goes_when_that_window_is_empty():
    limiter = RateLimiter(requests_per_minute=None, tokens_per_minute=600)
    times = _sends(limiter, 4, 250)  # 250 > 100 (the short window's share); 600 / min allows two
    assert times == [0.0, 10.0, 60.0, 70.0]


def test_a_429_gives_its_send_back():
    limiter = RateLimiter(requests_per_minute=6, tokens_per_minute=None)
    grant = limiter.take(1, 0.0)
    assert limiter.wait_s(1, 0.0) == 10.0  # one a 10 s (6 / min over six short windows)
    limiter.give_back(grant)
    assert limiter.wait_s(1, 0.0) == 0.0


def test_request_bodies_chat_and_completion():
    params = SamplingParams(max_tokens=7, temperature=0.0, n=1, seed=3, stop=("\n",), logprobs=2, top_k=5,
                            json_schema={"type": "object"})
    path, body = request_body("m", [{"role": "user", "content": "hi"}], params,
                              {"tools": [{"type": "function", "function": {"name": "f"}}], "enable_thinking": False})
    assert path == "/chat/completions"
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7,
                    "temperature": 0.0, "seed": 3, "stop": ["\n"], "top_k": 5, "logprobs": True, "top_logprobs": 2,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "row", "schema": {"type": "object"}}},
                    "tools": [{"type": "function", "function": {"name": "f"}}],
                    "chat_template_kwargs": {"enable_thinking": False}}
    path, body = request_body("m", "text", SamplingParams(max_tokens=3, n=2, logprobs=1))
    assert path == "/completions" and body == {"model": "m", "prompt": "text", "max_tokens": 3, "temperature": 1.0,
                                               "n": 2, "logprobs": 1}
    assert request_body("m", [1, 2, 3], SamplingParams())[1]["prompt"] == [1, 2, 3]
    with pytest.raises(ValueError, match="neither text, token ids nor chat messages"):
        request_body("m", {"x": 1}, SamplingParams())


def test_answers_parsed_with_usage_logprobs_and_tool_calls():
    chat = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                         "function": {"name": "f", "arguments": "{}"}}]},
        "logprobs": {"content": [{"token": "A", "logprob": -0.5, "bytes": [65],
                                  "top_logprobs": [{"token": "A", "logprob": -0.5, "bytes": [65]}]}]}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}}}
    answer = parse_answer(chat)
    assert (answer.prompt_tokens, answer.completion_tokens, answer.cached_tokens) == (9, 1, 4)
    choice = answer.choices[0]
    assert choice.text == "" and choice.tool_calls[0]["id"] == "c1" and choice.finish_reason == "tool_calls"
    assert choice.logprobs[0].token == "A" and choice.logprobs[0].token_bytes == b"A"
    assert choice.logprobs[0].top_logprobs[0].logprob == -0.5
    completion = {"choices": [{"index": 1, "text": "b", "finish_reason": "length",
                               "logprobs": {"tokens": ["b"], "token_logprobs": [-1.0],
                                            "top_logprobs": [{"b": -1.0, "c": -2.0}]}},
                              {"index": 0, "text": "a", "finish_reason": "stop", "logprobs": None}]}
    answer = parse_answer(completion)
    assert [c.text for c in answer.choices] == ["a", "b"] and answer.prompt_tokens is None
    assert [t.token for t in answer.choices[1].logprobs[0].top_logprobs] == ["b", "c"]
    with pytest.raises(ValueError, match="no choices"):
        parse_answer({"object": "error"})
    assert error_message(b'{"error": {"message": "slow down"}}') == "slow down"


def test_retry_after_in_seconds_milliseconds_and_dates():
    assert Reply(429, {"retry-after": "2"}, b"").retry_after_s() == 2.0
    assert Reply(429, {"retry-after-ms": "1500", "retry-after": "9"}, b"").retry_after_s() == 1.5
    assert Reply(429, {}, b"").retry_after_s() is None
    assert Reply(429, {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, b"").retry_after_s() == 0.0


BASE = {"name": "e", "input": {"url": "/tmp/in.parquet", "prompt_column": "prompt"}, "output": {"url": "/tmp/out"},
        "engine": {"backend": "openai", "endpoint": {"base_url": "http://127.0.0.1:9/v1/", "model": "m",
                                                     "api_key": "${env:EP_TEST_KEY}"}}}


def _spec(tmp_path, data: dict, monkeypatch) -> JobSpec:
    import yaml

    monkeypatch.setenv("EP_TEST_KEY", "sk-endpoint-test-0123456789abcdefXYZ")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


def test_spec_keys_and_the_api_key_never_written(tmp_path, monkeypatch):
    spec = _spec(tmp_path, {**BASE, "cost": {"usd_per_m_input": 0.5, "usd_per_m_output": 1.5, "max_usd": 2}},
                 monkeypatch)
    assert spec.engine.endpoint.base_url == "http://127.0.0.1:9/v1" and spec.engine.endpoint.max_concurrency == 16
    assert spec.engine.endpoint.api_key == "sk-endpoint-test-0123456789abcdefXYZ"
    assert "sk-endpoint-test" not in json.dumps(spec.redacted())
    assert redact_text("401: key sk-endpoint-test-0123456789abcdefXYZ refused") == "401: key *** refused"


@pytest.mark.parametrize(("change", "message"), [
    ({"engine": {"backend": "openai"}}, "engine.backend openai needs engine.endpoint"),
    ({"engine": {"endpoint": {"base_url": "http://x/v1", "model": "m"}}}, "engine.endpoint applies to engine"),
    ({"cost": {"max_usd": 1.0}}, "cost.max_usd needs a token price"),
    ({"task": "embed"}, "runs task generate only"),
    ({"engine": {"backend": "openai", "endpoint": {"base_url": "ftp://x", "model": "m"}}}, "must start with http"),
    ({"engine": {"backend": "openai", "endpoint": {"base_url": "http://x", "model": "m", "rpm": 3}}}, "rpm"),
])
def test_spec_checks_name_the_field(tmp_path, monkeypatch, change, message):
    with pytest.raises(SpecError, match=message):
        _spec(tmp_path, {**BASE, **change}, monkeypatch)


def test_streamed_chunks_assemble_into_the_plain_answer():
    from jobrunner.endpoint_backend.wire import assemble_stream

    chat = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "He"},
                          "logprobs": {"content": [{"token": "He", "logprob": -0.1}]}}]},
            {"choices": [{"index": 0, "delta": {"content": "llo", "tool_calls": [
                {"index": 0, "id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"a\""}}]},
                          "logprobs": {"content": [{"token": "llo", "logprob": -0.2}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                          "finish_reason": "tool_calls"}]},
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}]
    answer = parse_answer(assemble_stream(chat))
    choice = answer.choices[0]
    assert (choice.text, choice.finish_reason, answer.prompt_tokens, answer.completion_tokens) == \
        ("Hello", "tool_calls", 5, 2)
    assert choice.tool_calls == [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}]
    assert [t.token for t in choice.logprobs] == ["He", "llo"]
    text = [{"choices": [{"index": 1, "text": "b", "logprobs": {"tokens": ["b"], "token_logprobs": [-1.0],
                                                                "top_logprobs": [{"b": -1.0}]}}]},
            {"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]},
            {"choices": [{"index": 1, "text": "c", "finish_reason": "stop",
                          "logprobs": {"tokens": ["c"], "token_logprobs": [-2.0], "top_logprobs": [{"c": -2.0}]}}]}]
    answer = parse_answer(assemble_stream(text))
    assert [(c.index, c.text, c.finish_reason) for c in answer.choices] == [(0, "a", "length"), (1, "bc", "stop")]
    assert [t.logprob for t in answer.choices[1].logprobs] == [-1.0, -2.0] and answer.choices[0].logprobs is None
    with pytest.raises(ValueError, match="the stream ended with an error: boom"):
        assemble_stream([{"error": {"message": "boom"}}])


def test_a_resume_with_another_endpoint_model_is_refused_other_endpoint_settings_are_not():
    from jobrunner.driver.resume_check import spec_differences

    def spec(**endpoint):
        return {"engine": {"backend": "openai", "endpoint": {"base_url": "http://a/v1", "model": "m", **endpoint}}}

    assert spec_differences(spec(), spec(base_url="http://b/v1", requests_per_minute=10, api_key="***")) == []
    assert spec_differences(spec(), spec(model="judge-2")) == [("engine.endpoint.model", "m", "judge-2")]
    assert spec_differences({"engine": {}}, {"engine": {"backend": "jobrunner", "endpoint": None}}) == []
