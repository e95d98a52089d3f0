"""engine.backend openai against a real OpenAI-compatible server: vLLM's own server on the embedded SmolLM2
(float32, CPU) behind the fault proxy (tests/endpoint/proxy.py). Faults retried to no error row and every row
sent to the server once; retries exhausted as error rows naming the status, a wrong model as the job's stop
(EngineStopped); chat, completions, n, logprobs and JSON schema through the endpoint's fields; usage tokens
and cost; the spending cap. The longer checks (budgets at the server, texts with and without faults, a whole
job stopped by the cap and rerun, the 200-row run, the comparison with engine.backend vllm)
are `heavy`: test_endpoint_heavy.py."""

from __future__ import annotations

import json
import time

import pytest

from jobrunner.endpoint_backend.build import estimate_tokenizer
from jobrunner.endpoint_backend.engine import EndpointConfig, EndpointEngine
from jobrunner.endpoint_backend.transport import Transport
from jobrunner.engine.contract import EngineStopped, check_worker_engine
from jobrunner.engine.sampling_params import SamplingParams
from tests.endpoint.proxy import FaultProxy

# heavy: vLLM's server starts in 57-87 s on this 2-core machine under the usual load (about 30 s idle), more
# than the default suite's allowance; the default suite has the units and the driver's stop on a fake engine
pytestmark = [pytest.mark.heavy, pytest.mark.timeout(600)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _engine(url: str, model: str = "smollm2", key: str | None = None, **settings) -> EndpointEngine:
    config = EndpointConfig(base_url=url, model=model, backoff_base_s=0.05, **settings)
    tokenizer, _ = estimate_tokenizer("smollm2-135m-instruct")
    engine = EndpointEngine(config, Transport(url, key, config.timeout_s), tokenizer)
    check_worker_engine(engine, "the endpoint backend")
    return engine


def _prompt(i: int):
    return [{"role": "user", "content": f"Name one word that rhymes with number {i}."}] if i % 2 else f"Fact {i}:"


def _run(engine: EndpointEngine, count: int, params: SamplingParams = GREEDY, deadline_s: float = 300.0) -> dict:
    for i in range(count):
        engine.add_request(f"r{i}", _prompt(i), params)
    outputs: dict = {}
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"{engine.num_unfinished_requests} requests still unfinished"
        for out in engine.step():
            outputs[(out.request_id, out.sample_index)] = out
    engine.close()
    return outputs


def test_faults_are_retried_to_no_error_row_and_each_row_reaches_the_server_once(vllm_endpoint):
    with FaultProxy(vllm_endpoint.url, seed=7, rate_429=0.2, retry_after="0.2", rate_503=0.1, rate_drop=0.1,
                    rate_slow=0.1, slow_s=0.3) as proxy:
        engine = _engine(proxy.url, max_concurrency=6, max_retries=20)
        outputs = _run(engine, 16)
        records = list(proxy.records)
    assert sorted(outputs) == sorted((f"r{i}", 0) for i in range(16))
    assert [o.error for o in outputs.values() if o.error] == []
    assert all(o.finish_reason in ("stop", "length") and 0 < o.metrics.num_output_tokens <= 8
               for o in outputs.values())
    assert all(o.metrics.num_prompt_tokens > 0 and o.metrics.e2e_s >= o.metrics.queue_s >= 0
               for o in outputs.values())
    outcomes = [r.outcome for r in records]
    assert outcomes.count("forwarded") == 16  # every row answered once: a fault never reaches the server
    faults = {o: outcomes.count(o) for o in ("429", "503", "dropped")}
    assert all(faults.values()), faults
    stats = engine.stats().to_dict()
    assert stats["num_retries"] == sum(faults.values()) and stats["num_sends"] == len(records)
    assert json.loads(stats["http_statuses"]) == {"200": 16, **{k: v for k, v in faults.items()}}
    assert stats["num_output_tokens"] == sum(r.completion_tokens for r in records if r.outcome == "forwarded")


def test_retries_exhausted_and_refused_requests_are_error_rows_naming_the_status(vllm_endpoint):
    with FaultProxy(vllm_endpoint.url, rate_429=1.0, retry_after="0") as proxy:
        outputs = _run(_engine(proxy.url, max_retries=2), 3)
        assert len(proxy.records) == 9  # the first try and two retries, each row
    assert {o.error for o in outputs.values()} == {
        "endpoint: gave up after 3 attempts (engine.endpoint.max_retries=2); last: HTTP 429: rate limited by the "
        "fault proxy"}
    with FaultProxy(vllm_endpoint.url) as proxy:  # a wrong model is the job's: it stops, no row errs
        with pytest.raises(EngineStopped, match="HTTP 404 .*The model `no-such-model` does not exist.*"
                                                "the server's models: smollm2"):
            _run(_engine(proxy.url, model="no-such-model", max_retries=5), 2)
        assert len(proxy.records) <= 2  # a 404 is not retried


def test_chat_n_logprobs_json_schema_and_cost(vllm_endpoint):
    engine = _engine(vllm_endpoint.url, usd_per_m_input=2.0, usd_per_m_output=10.0)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    engine.add_request("n", [{"role": "user", "content": "Say a colour."}],
                       SamplingParams(max_tokens=6, temperature=0.9, n=3, seed=1))
    engine.add_request("lp-chat", [{"role": "user", "content": "Say hi."}],
                       SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))
    engine.add_request("lp-text", "The sky is", SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))
    engine.add_request("json", [{"role": "user", "content": "Answer in JSON: what is 2 + 2?"}],
                       SamplingParams(max_tokens=40, temperature=0.0, json_schema=schema))
    outputs = {}
    deadline = time.monotonic() + 300
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for out in engine.step():
            outputs[(out.request_id, out.sample_index)] = out
    assert sorted(outputs) == sorted([("n", 0), ("n", 1), ("n", 2), ("lp-chat", 0), ("lp-text", 0), ("json", 0)])
    assert [outputs[("n", i)].metrics.prompt_shared for i in range(3)] == [False, True, True]
    for key in ("lp-chat", "lp-text"):
        out = outputs[(key, 0)]
        assert len(out.logprobs) == out.metrics.num_output_tokens
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0.0 for t in out.logprobs)
        assert "".join(t.token for t in out.logprobs) == out.text
    answer = json.loads(outputs[("json", 0)].text)
    assert isinstance(answer["answer"], str)
    stats = engine.stats()
    assert stats.cost_usd == pytest.approx((stats.num_prompt_tokens * 2.0 + stats.num_output_tokens * 10.0) / 1e6)
    engine.close()


def test_the_spending_cap_stops_sending_and_step_says_so(vllm_endpoint):
    with FaultProxy(vllm_endpoint.url) as proxy:
        # each request is estimated at its prompt + 8 output tokens at $1000 / M: ~$0.02-0.05; the cap lets ~2 go
        engine = _engine(proxy.url, max_concurrency=1, usd_per_m_input=1000.0, usd_per_m_output=1000.0,
                         max_usd=0.1)
        for i in range(6):
            engine.add_request(f"r{i}", _prompt(i), GREEDY)
        finished, deadline = [], time.monotonic() + 120
        with pytest.raises(EngineStopped, match=r"cost.max_usd reached: this worker spent \$0\.0\d+ of its \$0.1 "
                                                r"share at the token prices; \d request\(s\) not sent"):
            while time.monotonic() < deadline:
                finished += engine.step()
        sent = len(proxy.records)
    assert 1 <= len(finished) == sent < 6 and engine.stats().cost_usd <= 0.1
    engine.close()


def test_streamed_answers_equal_the_plain_ones_and_give_ttft(vllm_endpoint):
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    plain = _run(_engine(vllm_endpoint.url), 4, params)
    streamed = _run(_engine(vllm_endpoint.url, stream=True), 4, params)
    assert {k: (o.text, o.metrics.num_prompt_tokens, o.metrics.num_output_tokens) for k, o in plain.items()} == \
        {k: (o.text, o.metrics.num_prompt_tokens, o.metrics.num_output_tokens) for k, o in streamed.items()}
    assert all(o.metrics.ttft_s is None for o in plain.values())
    assert all(0 < o.metrics.ttft_s <= o.metrics.e2e_s for o in streamed.values())
    assert all([t.token for t in o.logprobs] == [t.token for t in plain[k].logprobs] for k, o in streamed.items())
