"""A small fake engine implementing the contract API (docs/contracts.md), for driver tests.

Tokens are whitespace words. Each step decodes one token for up to max_num_seqs running requests; a request
generates `max_tokens` tokens ("tok0 tok1 ...") and finishes with "length". An empty prompt or one longer
than max_model_len finishes with finish_reason "error". `step_delay_s` slows every step so that kills land
mid-shard; `fail_on` makes step() raise while a request whose prompt contains that text is running;
`hang_on` makes step() block (as a hung kernel would) while such a request is running; `stall_on` makes
step() return at once with nothing done (no token, no finished row) while such a request is running;
`bad_text_on` gives such a request a text Arrow cannot store (an error outside the engine, when the part is
built). `rebuild()` is a fresh engine with the same settings (no model load), as the worker asks after a crash.
Images (message parts of type image, engine/images.py): refused in add_request ("does not take images") unless
`takes_images`; then each image is the word `img:<first 8 hex of its digest>` followed by IMAGE_TOKENS - 1
more prompt tokens, and the output reports `num_image_tokens`.

Gauges with known values (the real engine's keys): `kv_blocks=[used, total]` reports that KV usage at every step;
`cached_prompt_tokens=k` counts the first k tokens of every prompt as prefix-cache hits (not prefilled).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from jobrunner.engine import RequestMetrics, RequestOutput, SamplingParams
from jobrunner.engine.images import prompt_images

IMAGE_TOKENS = 4  # prompt tokens per image when the fake engine takes images


@dataclass
class FakeStats:
    steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_sampled_tokens: int = 0  # output tokens produced, as the real engine counts them (the driver's tokens/s)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_num_blocks: int = 0
    kv_blocks_used: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Req:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    text: str = ""
    output: list[int] = field(default_factory=list)
    error: str | None = None
    num_image_tokens: int = 0


class FakeEngine:
    """Deterministic stand-in for LLMEngine."""

    count_sampled = False  # report num_sampled_tokens (make_engine's count_sampled): the driver then counts them

    def __init__(self, max_num_seqs: int = 8, max_model_len: int = 512, step_delay_s: float = 0.0,
                 fail_on: str | None = None, hang_on: str | None = None, stall_on: str | None = None,
                 bad_text_on: str | None = None, kv_blocks: tuple[int, int] = (0, 0),
                 cached_prompt_tokens: int = 0, hold_file: str | None = None, takes_images: bool = False) -> None:
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.step_delay_s, self.fail_on, self.hang_on = step_delay_s, fail_on, hang_on
        self.stall_on, self.bad_text_on = stall_on, bad_text_on
        self.kv_blocks, self.cached_prompt_tokens = tuple(kv_blocks), cached_prompt_tokens
        self.hold_file, self._num_finished = hold_file, 0
        self.takes_images = takes_images
        self.tokenizer = None
        self.device = "cpu"
        self.model_info = {"architecture": "FakeForTests"}
        self.block_size = 16
        self.closed = False
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._ids: set[str] = set()
        self._stats = FakeStats(kv_blocks_used=self.kv_blocks[0], kv_num_blocks=self.kv_blocks[1])
        self.max_seen_unfinished = 0

    def add_request(self, request_id: str, prompt, params: SamplingParams, *, chat_template_kwargs=None,
                    adapter=None) -> None:
        if request_id in self._ids:
            raise ValueError(f"duplicate request id {request_id!r}")
        images = prompt_images(prompt)
        if images and not self.takes_images:
            raise ValueError(f"model {self.model_info['architecture']} does not take images")
        self._ids.add(request_id)
        text = prompt if isinstance(prompt, str) else " ".join(_text(m["content"]) for m in prompt)
        tokens = [len(w) for w in text.split()] + [0] * ((IMAGE_TOKENS - 1) * len(images))
        req = _Req(request_id, tokens, params, RequestMetrics(arrival_time=time.perf_counter(),
                                                               num_prompt_tokens=len(tokens)), text=text,
                   num_image_tokens=IMAGE_TOKENS * len(images))
        if not tokens:
            req.error = "empty prompt"
        elif len(tokens) + params.max_tokens > self.max_model_len:
            req.error = f"prompt of {len(tokens)} tokens is too long (max_model_len {self.max_model_len})"
        self._waiting.append(req)
        self.max_seen_unfinished = max(self.max_seen_unfinished, self.num_unfinished_requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._waiting) + len(self._running)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished_requests > 0

    def stats(self) -> FakeStats:
        return self._stats

    def rebuild(self) -> FakeEngine:
        """A fresh engine with the same settings (what the worker asks for after a crash)."""
        engine = FakeEngine(self.max_num_seqs, self.max_model_len, self.step_delay_s, self.fail_on, self.hang_on,
                            self.stall_on, self.bad_text_on, self.kv_blocks, self.cached_prompt_tokens,
                            self.hold_file, self.takes_images)
        engine.count_sampled = self.count_sampled
        return engine

    def close(self) -> None:
        self.closed = True

    def _hold(self) -> None:
        """After the first finished row, wait (at most 120 s) until `hold_file` exists: a test sees the job
        mid-run, with rows done and rows left, however slowly the machine runs."""
        deadline = time.monotonic() + 120.0
        while self._num_finished and not os.path.exists(self.hold_file) and time.monotonic() < deadline:
            time.sleep(0.05)

    def step(self) -> list[RequestOutput]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.hold_file:
            self._hold()
        now = time.perf_counter()
        finished = [self._finish(r, now) for r in self._waiting if r.error]
        self._waiting = [r for r in self._waiting if not r.error]
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting.pop(0)
            req.metrics.first_scheduled_time = now
            cached = min(self.cached_prompt_tokens, len(req.prompt_token_ids))
            req.metrics.num_cached_tokens = cached
            self._stats.num_prompt_tokens += len(req.prompt_token_ids)
            self._stats.num_cached_tokens += cached
            self._stats.num_prefill_tokens += len(req.prompt_token_ids) - cached
            self._running.append(req)
        if self.fail_on and any(self.fail_on in r.text for r in self._running):
            raise RuntimeError("fake engine failure")
        while self.hang_on and any(self.hang_on in r.text for r in self._running):
            time.sleep(1.0)  # hung: never returns
        if self.stall_on and any(self.stall_on in r.text for r in self._running):
            return finished  # steps, but nothing progresses
        for req in self._running:
            req.output.append(len(req.output))
            req.metrics.token_times.append(now)
            req.metrics.first_token_time = req.metrics.first_token_time or now
        self._stats.steps += 1
        self._stats.num_decode_tokens += len(self._running)
        if self.count_sampled:
            self._stats.num_sampled_tokens += len(self._running)
        self._stats.decode_s += self.step_delay_s
        done = [r for r in self._running if len(r.output) >= r.params.max_tokens]
        self._running = [r for r in self._running if len(r.output) < r.params.max_tokens]
        return finished + [self._finish(r, now) for r in done]

    def _finish(self, req: _Req, now: float) -> RequestOutput:
        self._num_finished += 1
        req.metrics.finish_time = now
        req.metrics.num_output_tokens = len(req.output)
        text = " ".join(f"tok{t}" for t in req.output)
        if self.bad_text_on and self.bad_text_on in req.text:
            text = {"not": "a string"}  # Arrow refuses it in a string column
        reason = "error" if req.error else "length"
        out = RequestOutput(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                            output_token_ids=list(req.output), text=text, finish_reason=reason,
                            error=req.error, metrics=req.metrics)
        req.metrics.num_image_tokens = req.num_image_tokens  # what the real engine's metrics report
        out.num_image_tokens = req.num_image_tokens  # read by driver/rows.py image_tokens
        return out


def _text(content) -> str:
    """A message's content as the fake engine reads it: text parts' words and one `img:<digest>` per image."""
    if isinstance(content, str) or content is None:
        return content or ""
    return " ".join(p["text"] if p["type"] == "text" else f"img:{p['image'].digest[:8]}" for p in content)


def make_engine(spec, step_delay_s: float = 0.0, fail_on: str | None = None, hang_on: str | None = None,
                load_delay_s: float = 0.0, stall_on: str | None = None, bad_text_on: str | None = None,
                no_rebuild: bool = False, kv_blocks: tuple[int, int] = (0, 0),
                cached_prompt_tokens: int = 0, hold_file: str | None = None,
                count_sampled: bool = False, takes_images: bool = False) -> FakeEngine:
    """Factory for `engine.factory: tests.driver.fake_engine:make_engine` (load_delay_s: a slow model load;
    no_rebuild: an engine without `rebuild()`, which the worker must load anew after a crash; hold_file: steps
    wait after the first finished row until this file exists; count_sampled: report num_sampled_tokens)."""
    time.sleep(load_delay_s)
    cls = _NoRebuildEngine if no_rebuild else FakeEngine
    engine = cls(max_num_seqs=spec.engine.max_num_seqs, max_model_len=spec.engine.max_model_len or 512,
                 step_delay_s=step_delay_s, fail_on=fail_on, hang_on=hang_on, stall_on=stall_on,
                 bad_text_on=bad_text_on, kv_blocks=kv_blocks, cached_prompt_tokens=cached_prompt_tokens,
                 hold_file=hold_file, takes_images=takes_images)
    engine.count_sampled = count_sampled
    return engine


class _NoRebuildEngine(FakeEngine):
    """A custom engine that cannot rebuild itself: the worker closes it and loads one anew after a crash."""

    def rebuild(self) -> FakeEngine:
        raise NotImplementedError("this engine is built anew, never rebuilt")
