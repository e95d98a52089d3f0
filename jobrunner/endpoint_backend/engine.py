"""`engine.backend: openai`: an OpenAI-compatible endpoint as a worker engine (jobrunner.engine.WorkerEngine).

`add_request` queues a row; a dispatcher thread sends queued rows to the endpoint, each on a thread of a pool
of `max_concurrency`, as soon as the requests- and tokens-per-minute budgets (limits.py) and the spending cap
allow; retries (waiting `Retry-After` when the server gives one, else exponential backoff with jitter) go
before fresh rows. `step` hands back the samples finished since the last call, waiting briefly when none
have. Which thread owns what: the caller thread owns nothing but the queue it appends to; the dispatcher owns
the limiter and the in-flight count; a sending thread owns its call until it puts the result (or the call,
to retry) back, all under one condition variable.

Token counts are the server's usage; before a request goes its tokens are estimated (the prompt through the
model's tokenizer when one is on this machine, else characters / 4, plus max_tokens x n) and the estimate is
replaced by the usage once the answer comes. Cost is counted at the job's token prices; with a cap, a request
goes only while the spent cost plus the estimates of the requests in flight and of this one stay within it.
When no request may go because of the cap and none is in flight, `step` raises EngineStopped. So it does, once
the requests in flight have ended, after an answer that is the job's misconfiguration (faults.py: a wrong key,
URL or model, no server at all): that row gets no error, nothing more is sent, and the reason names the fix.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from jobrunner.endpoint_backend.faults import JOB_STATUSES, connection_fault, status_fault, unreachable
from jobrunner.endpoint_backend.limits import Grant, RateLimiter
from jobrunner.endpoint_backend.transport import TRANSPORT_ERRORS, Reply, Transport
from jobrunner.endpoint_backend.wire import (
    Answer,
    error_message,
    image_tokens_estimate,
    parse_answer,
    request_body,
    without_images,
)
from jobrunner.engine.contract import EngineStopped
from jobrunner.engine.images import prompt_images
from jobrunner.engine.pooling import PoolingParams
from jobrunner.engine.prompt_tokens import text_or_chat_token_ids
from jobrunner.engine.request import RequestMetrics, RequestOutput
from jobrunner.engine.sampling_params import SamplingParams

STEP_WAIT_S = 0.05  # how long step() waits for a finished sample when none is ready
RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})  # plus every other 5xx
CHARS_PER_TOKEN = 4  # the estimate without a tokenizer
NETWORK_MARGIN_S = 1.0  # a request written by then is at the server by then + this (the budgets' window)


@dataclass(frozen=True)
class EndpointConfig:
    """What one worker's endpoint engine needs (built from the spec by build.py)."""

    base_url: str
    model: str
    max_concurrency: int = 16
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_retries: int = 6
    timeout_s: float = 600.0
    usd_per_m_input: float = 0.0
    usd_per_m_output: float = 0.0
    max_usd: float | None = None  # this worker's share of cost.max_usd
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    window_s: float = 60.0  # the budgets' window: providers count per minute (tests shorten it)
    stream: bool = False  # stream answers: each row's time to first token (needs the usage in the stream)


@dataclass
class EndpointStats:
    """Counters since the engine started (`stats()`); token counts are the server's usage."""

    steps: int = 0
    num_requests: int = 0
    num_sends: int = 0
    num_retries: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_sampled_tokens: int = 0  # output tokens of finished requests (progress: the endpoint streams nothing)
    num_prefill_tokens: int = 0  # the same as prompt / output tokens: the worker's progress counts these
    num_decode_tokens: int = 0
    num_error_requests: int = 0
    http_statuses: dict[str, int] = field(default_factory=dict)  # status (or "dropped", "timeout") -> count
    cost_usd: float = 0.0  # at the token prices, from the usage
    prefill_s: float = 0.0
    decode_s: float = 0.0  # no split: the endpoint's time is its own

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["http_statuses"] = json.dumps(self.http_statuses, sort_keys=True)  # a flat value for the manifest
        out["cost_usd"] = round(self.cost_usd, 6)
        return out


@dataclass(eq=False)
class _Call:
    """One row's request while it waits, goes, and maybe goes again."""

    request_id: str
    path: str
    body: dict[str, Any]
    n: int
    arrival: float
    estimate: float  # tokens counted for it before its usage is known
    cost_estimate: float
    attempts: int = 0
    first_sent: float | None = None
    grant: Grant | None = None
    last_error: str = ""
    unreachable: bool = False  # the last attempt found no server (refused, unknown host)


class EndpointEngine:
    """The worker engine contract over one OpenAI-compatible endpoint."""

    block_size = 16  # no KV cache of ours: only prefix-aware sharding's chains read it (they see no token ids)

    def __init__(self, config: EndpointConfig, transport: Transport, tokenizer: Any = None,
                 model_info: dict[str, Any] | None = None, chat_template: str | None = None,
                 spent_usd: float = 0.0) -> None:
        self.config, self.transport, self.tokenizer, self.chat_template = config, transport, tokenizer, chat_template
        self.model_info = {"backend": "openai", "endpoint_model": config.model, **(model_info or {})}
        self.device = "endpoint"
        self._stats = EndpointStats(cost_usd=spent_usd)
        self._limiter = RateLimiter(config.requests_per_minute, config.tokens_per_minute, config.window_s)
        self._cond = threading.Condition()
        self._fresh: list[_Call] = []  # FIFO (index 0 first)
        self._retries: list[tuple[float, int, _Call]] = []  # heap: (ready time, order, call)
        self._order = itertools.count()
        self._ids: set[str] = set()  # added, not handed back
        self._done: list[RequestOutput] = []
        self._in_flight = 0
        self._in_flight_cost = 0.0
        self._closed = False
        self._fault: str | None = None  # the job's misconfiguration (faults.py): nothing more goes
        self._pool = ThreadPoolExecutor(config.max_concurrency, thread_name_prefix="endpoint-send")
        self._dispatcher = threading.Thread(target=self._dispatch, name="endpoint-dispatch", daemon=True)
        self._dispatcher.start()

    # ---- the contract -------------------------------------------------------------------------------------
    @property
    def num_unfinished_requests(self) -> int:
        with self._cond:
            return len(self._ids)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished_requests > 0

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams | None = None, *,
                    chat_template_kwargs: dict[str, Any] | None = None, adapter: str | None = None) -> None:
        if isinstance(params, PoolingParams):
            raise ValueError("engine.backend openai runs generation jobs only (task: generate)")
        params = params or SamplingParams()
        arrival = time.perf_counter()
        with self._cond:
            if request_id in self._ids:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._ids.add(request_id)
            self._stats.num_requests += 1
        error, call = None, None
        if adapter:
            error = f"LoRA adapter {adapter!r}: engine.backend openai sends engine.endpoint.model only"
        else:
            try:
                path, body = request_body(self.config.model, prompt, params, chat_template_kwargs)
                if self.config.stream:
                    body.update(stream=True, stream_options={"include_usage": True})
                prompt_tokens = self._estimate_prompt(prompt, chat_template_kwargs)
                estimate = prompt_tokens + params.max_tokens * params.n
                error = self._limiter.never_fits(estimate)
                call = _Call(request_id, path, body, params.n, arrival, estimate,
                             self._cost(prompt_tokens, params.max_tokens * params.n))
            except ValueError as exc:
                error = str(exc)
        with self._cond:
            if error is not None:
                self._done += _error_outputs(request_id, error, arrival, params.n)
                self._stats.num_error_requests += 1
            else:
                self._fresh.append(call)
            self._cond.notify_all()

    def step(self) -> list[RequestOutput]:
        with self._cond:
            self._stats.steps += 1
            if not self._done:
                self._cond.wait_for(lambda: self._done or self._is_stopped(), timeout=STEP_WAIT_S)
            outputs, self._done = self._done, []
            for out in outputs:
                self._ids.discard(out.request_id)
            if not outputs and self._is_stopped():
                raise EngineStopped(self._stop_reason())
            return outputs

    def stats(self) -> EndpointStats:
        return self._stats

    def rebuild(self) -> EndpointEngine:
        """A fresh engine on the same endpoint (empty queues); the money spent so far still counts."""
        self.close()
        return EndpointEngine(self.config, self.transport, self.tokenizer, self.model_info, self.chat_template,
                              spent_usd=self._stats.cost_usd)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- estimates ------------------------------------------------------------------------------------------
    def _estimate_prompt(self, prompt: Any, chat_template_kwargs: dict[str, Any] | None) -> int:
        """The prompt's tokens: its text through the tokenizer when there is one, else its characters / 4, plus
        each image's estimate (wire.image_tokens_estimate)."""
        images = prompt_images(prompt)
        if images:
            text = self._estimate_prompt(without_images(prompt), chat_template_kwargs)
            return text + sum(image_tokens_estimate(image.size) for image in images)
        if self.tokenizer is not None:
            try:
                if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], int):
                    return len(prompt)
                return len(text_or_chat_token_ids(self.tokenizer, prompt, self.chat_template, chat_template_kwargs))
            except Exception:  # noqa: BLE001 - a template the tokenizer cannot apply: fall back to characters
                pass
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], int):
            return len(prompt)
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
        return max(1, -(-len(text) // CHARS_PER_TOKEN))

    def _cost(self, prompt_tokens: float, output_tokens: float) -> float:
        return (prompt_tokens * self.config.usd_per_m_input + output_tokens * self.config.usd_per_m_output) / 1e6

    # ---- the dispatcher -------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                call, wait_s = self._next_call(time.monotonic())
                if call is None:
                    self._cond.wait(timeout=1.0 if wait_s is None else min(1.0, max(0.001, wait_s)))
                    continue
                self._in_flight += 1
                self._in_flight_cost += call.cost_estimate
                call.grant = self._limiter.take(call.estimate, time.monotonic())
            try:
                self._pool.submit(self._send, call)
            except RuntimeError:  # the pool was shut down (close): nothing more goes
                return

    def _next_call(self, now: float) -> tuple[_Call | None, float | None]:
        """The call that may go now (a retry that is due first, then the oldest fresh one), or None and how
        long to wait (None: until something changes)."""
        if self._in_flight >= self.config.max_concurrency or self._fault is not None:
            return None, None
        due = self._retries[0][0] - now if self._retries else None
        if due is not None and due <= 0:
            call, from_retries = self._retries[0][2], True
        elif self._fresh:
            call, from_retries = self._fresh[0], False
        else:
            return None, due
        if self._over_cap(call):
            return None, None if self._in_flight else 1.0
        wait_s = self._limiter.wait_s(call.estimate, now)
        if wait_s > 0:
            return None, wait_s if due is None else min(wait_s, max(due, 0.001))
        if from_retries:
            heapq.heappop(self._retries)
        else:
            self._fresh.pop(0)
        return call, None

    def _over_cap(self, call: _Call) -> bool:
        cap = self.config.max_usd
        return cap is not None and self._stats.cost_usd + self._in_flight_cost + call.cost_estimate > cap

    def _is_stopped(self) -> bool:
        """The cap lets no waiting request go, and none is in flight whose answer could change that; or the job
        is misconfigured and the requests in flight have ended."""
        if self._fault is not None:
            return not self._in_flight
        if self.config.max_usd is None or self._in_flight:
            return False
        due = bool(self._retries) and self._retries[0][0] <= time.monotonic()
        head = self._retries[0][2] if due or (self._retries and not self._fresh) else \
            (self._fresh[0] if self._fresh else None)  # what the dispatcher would send next
        return head is not None and self._over_cap(head)

    def _stop_reason(self) -> str:
        if self._fault is not None:
            return self._fault
        return (f"cost.max_usd reached: this worker spent ${self._stats.cost_usd:.4f} of its ${self.config.max_usd:g} "
                f"share at the token prices; {len(self._fresh) + len(self._retries)} request(s) not sent")

    # ---- a sending thread -----------------------------------------------------------------------------------
    def _send(self, call: _Call) -> None:
        call.attempts += 1
        call.first_sent = call.first_sent or time.perf_counter()
        try:
            reply: Reply | None = self.transport.post(call.path, call.body, lambda: self._sent(call))
            problem = None
        except TimeoutError:
            reply, problem = None, ("timeout", f"no answer within engine.endpoint.timeout_s="
                                               f"{self.config.timeout_s:g} s")
        except TRANSPORT_ERRORS as exc:
            reply, problem = None, ("dropped", f"connection failed: {type(exc).__name__}: {exc}")
            call.unreachable = unreachable(exc)
        except Exception as exc:  # noqa: BLE001 - anything else of this one call: that row's error, no thread lost
            reply, problem = None, ("error", f"{type(exc).__name__}: {exc}")
        if reply is not None:
            call.unreachable = False
        job_level = reply is not None and reply.status in JOB_STATUSES
        fault = self._status_fault(call, reply) if job_level else None
        with self._cond:
            self._limiter.seen_by(call.grant, time.monotonic())  # written or failed: no later than now
            self._in_flight -= 1
            self._in_flight_cost -= call.cost_estimate
            self._stats.num_sends += 1
            try:
                if job_level:
                    self._fault = self._fault or fault  # the row gets no error: the job stops (resumable)
                else:
                    self._settle(call, reply, problem)
            finally:
                self._cond.notify_all()

    def _status_fault(self, call: _Call, reply: Reply) -> str | None:
        """The job's stop reason for a 401 / 403 / 404 (a 404 asks the server's models to tell a wrong model
        from a wrong path); None when the job already stops."""
        if self._fault is not None:
            return None
        models = None
        if reply.status == 404:
            try:
                listing = self.transport.get("/models")
                if listing.status == 200:
                    data = json.loads(listing.body).get("data") or []
                    models = [str(m.get("id")) for m in data if isinstance(m, dict)]
            except (*TRANSPORT_ERRORS, ValueError, AttributeError):
                models = None
        message = self.transport.cut_key(error_message(reply.body))[:200]
        return status_fault(self.config.base_url, call.path, reply.status, message, self.config.model, models)

    def _sent(self, call: _Call) -> None:
        with self._cond:
            self._limiter.seen_by(call.grant, time.monotonic() + NETWORK_MARGIN_S)

    def _settle(self, call: _Call, reply: Reply | None, problem: tuple[str, str] | None) -> None:
        """What one send's answer makes of its call: its samples, a retry, or its error (under the lock)."""
        if reply is not None:
            self._count_status(str(reply.status))
            if reply.status == 200:
                try:
                    self._succeed(call, parse_answer(json.loads(reply.body)), reply.first_token_time)
                    return
                except ValueError as exc:
                    problem = ("200", f"HTTP 200 with an answer that cannot be read: {exc}")
            else:
                retryable = reply.status in RETRY_STATUSES or reply.status >= 500
                message = f"HTTP {reply.status}: {error_message(reply.body)}"
                if reply.status == 429 and call.grant is not None:
                    self._limiter.give_back(call.grant)  # not taken: it does not count against the budgets
                if not retryable:
                    self._fail(call, message)
                    return
                problem = (str(reply.status), message)
        else:
            self._count_status(problem[0])
        call.last_error = problem[1]
        if call.attempts > self.config.max_retries and call.unreachable:
            self._fault = self._fault or connection_fault(self.config.base_url, call.attempts, call.last_error)
            return
        if call.attempts > self.config.max_retries:
            self._fail(call, f"gave up after {call.attempts} attempts (engine.endpoint.max_retries="
                             f"{self.config.max_retries}); last: {call.last_error}")
            return
        self._stats.num_retries += 1
        delay = self._retry_delay(call.attempts, reply.retry_after_s() if reply is not None else None)
        heapq.heappush(self._retries, (time.monotonic() + delay, next(self._order), call))

    def _retry_delay(self, attempts: int, retry_after_s: float | None) -> float:
        """The server's Retry-After (plus up to 10% jitter), else exponential backoff with full jitter."""
        if retry_after_s is not None:
            return retry_after_s * (1.0 + 0.1 * random.random())
        ceiling = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** (attempts - 1))
        return ceiling * (0.5 + 0.5 * random.random())

    def _count_status(self, status: str) -> None:
        self._stats.http_statuses[status] = self._stats.http_statuses.get(status, 0) + 1

    def _succeed(self, call: _Call, answer: Answer, first_token_time: float | None = None) -> None:
        now = time.perf_counter()
        prompt_tokens = answer.prompt_tokens or 0
        output_tokens = answer.completion_tokens
        if output_tokens is None:  # no usage: count each sample's text
            output_tokens = sum(self._count_text(c.text) for c in answer.choices)
        if call.grant is not None and answer.prompt_tokens is not None:
            self._limiter.correct(call.grant, prompt_tokens + output_tokens)
        stats = self._stats
        stats.num_prompt_tokens += prompt_tokens
        stats.num_prefill_tokens += prompt_tokens
        stats.num_cached_tokens += answer.cached_tokens
        stats.num_output_tokens += output_tokens
        stats.num_decode_tokens += output_tokens
        stats.num_sampled_tokens += output_tokens
        stats.cost_usd += self._cost(prompt_tokens, output_tokens)
        shares = _split(output_tokens, [self._count_text(c.text) for c in answer.choices])
        by_index = {c.index: (c, s) for c, s in zip(answer.choices, shares, strict=True)}
        for index in range(call.n):
            metrics = RequestMetrics(arrival_time=call.arrival, first_scheduled_time=call.first_sent,
                                     first_token_time=first_token_time, finish_time=now,
                                     num_prompt_tokens=prompt_tokens,
                                     num_cached_tokens=answer.cached_tokens if index == 0 else 0,
                                     prompt_shared=index > 0)
            if index not in by_index:
                self._done.append(_error_output(call.request_id, f"the endpoint answered without sample {index} "
                                                f"of n={call.n}", metrics, index, call.n))
                continue
            choice, tokens = by_index[index]
            metrics.num_output_tokens = tokens
            self._done.append(_sample_output(call.request_id, choice, metrics, call.n))
        for out in self._done[-call.n:]:
            out.num_retries = call.attempts - 1

    def _count_text(self, text: str) -> int:
        if self.tokenizer is not None:
            try:
                return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            except Exception:  # noqa: BLE001 - fall back to characters
                pass
        return -(-len(text) // CHARS_PER_TOKEN)

    def _fail(self, call: _Call, error: str) -> None:
        self._stats.num_error_requests += 1
        now = time.perf_counter()
        for index in range(call.n):
            metrics = RequestMetrics(arrival_time=call.arrival, first_scheduled_time=call.first_sent,
                                     finish_time=now)
            self._done.append(_error_output(call.request_id, f"endpoint: {error}", metrics, index, call.n))
            self._done[-1].num_retries = call.attempts - 1


def _split(total: int, weights: list[int]) -> list[int]:
    """`total` tokens over samples in proportion to their own counts (the usage gives only the sum)."""
    if len(weights) == 1:
        return [total]
    whole = sum(weights)
    if whole <= 0:
        return [total // len(weights) + (i < total % len(weights)) for i in range(len(weights))]
    shares = [total * w // whole for w in weights]
    for i in range(total - sum(shares)):
        shares[i % len(shares)] += 1
    return shares


_FINISH = {"stop": "stop", "length": "length", "tool_calls": "stop", "function_call": "stop", "eos": "stop"}


def _sample_output(request_id: str, choice: Any, metrics: RequestMetrics, n: int) -> RequestOutput:
    reason = _FINISH.get(choice.finish_reason)
    error = None if reason else f"endpoint: the sample finished with {choice.finish_reason!r}"
    out = RequestOutput(request_id=request_id, prompt_token_ids=[], output_token_ids=[], text=choice.text,
                        finish_reason=reason or "error", error=error, metrics=metrics, logprobs=choice.logprobs,
                        sample_index=choice.index, num_samples=n)
    out.tool_calls = choice.tool_calls  # the endpoint's own calls (driver/rows.py takes them as they are)
    out.reasoning = choice.reasoning
    return out


def _error_output(request_id: str, error: str, metrics: RequestMetrics, index: int, n: int) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt_token_ids=[], output_token_ids=[], text="",
                         finish_reason="error", error=error, metrics=metrics, sample_index=index, num_samples=n)


def _error_outputs(request_id: str, error: str, arrival: float, n: int) -> list[RequestOutput]:
    now = time.perf_counter()
    return [_error_output(request_id, error, RequestMetrics(arrival_time=arrival, finish_time=now), i, n)
            for i in range(n)]
