"""A request's state inside the engine, its metrics, and the output handed back to callers."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from jobrunner.engine.pooling import PooledOutput, PoolingParams, PoolingState, first_needed
from jobrunner.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: everything from FINISHED_STOPPED on is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ERROR = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# The id a sampled token has on the host while the token itself is still on the device (late readback,
# engine/readback.py): a request's last output token, until the engine reads the step that sampled it.
PENDING_TOKEN = -1

# One table from finished status to the user-facing finish reason.
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestMetrics:
    """Timestamps (``time.perf_counter`` seconds) and counts of one request.

    ``queue_s`` is arrival → first scheduled; ``ttft_s`` arrival → first output token; ``itl_s`` the gaps
    between consecutive output tokens; ``e2e_s`` arrival → finish.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    prompt_shared: bool = False  # this sample's prompt KV was forked from sample 0 (count prompt tokens once)
    num_draft_tokens: int = 0      # speculative decoding: tokens drafted for this sample and verified
    num_accepted_tokens: int = 0   # of those, accepted (each saved one decode step)
    num_images: int = 0            # images in the prompt (engine/vision.py)
    num_image_tokens: int = 0      # of the prompt tokens, those that stand for image content (<image> tokens)
    mean_itl_s: float | None = None  # an engine that keeps only its first and last token times (vLLM) gives
    # the mean gap directly: (last - first) / (output tokens - 1)

    @property
    def queue_s(self) -> float | None:
        return _gap(self.arrival_time, self.first_scheduled_time)

    @property
    def ttft_s(self) -> float | None:
        return _gap(self.arrival_time, self.first_token_time)

    @property
    def e2e_s(self) -> float | None:
        return _gap(self.arrival_time, self.finish_time)

    @property
    def itl_s(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def itl_mean_s(self) -> float | None:
        gaps = self.itl_s
        return sum(gaps) / len(gaps) if gaps else self.mean_itl_s

    def to_dict(self) -> dict[str, float | int | None]:
        """The flat metric fields written with every output row."""
        return {
            "ttft_s": self.ttft_s,
            "itl_mean_s": self.itl_mean_s,
            "e2e_s": self.e2e_s,
            "queue_s": self.queue_s,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_preemptions": self.num_preemptions,
            "prompt_shared": self.prompt_shared,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_images": self.num_images,
            "num_image_tokens": self.num_image_tokens,
        }


def _gap(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass
class TopLogprob:
    """One of the most likely tokens at a position (``token_bytes``: see :class:`TokenLogprob`)."""

    token_id: int
    token: str
    logprob: float
    token_bytes: bytes | None = None


@dataclass
class TokenLogprob:
    """The log-probability of the token at a position and the top alternatives there (most likely first).

    Log-probabilities are those of the model's distribution (log-softmax of the raw logits, before
    temperature, penalties or grammar masks), as in vLLM and OpenAI. ``token`` is the token decoded alone (a
    piece of a multi-byte character decodes to U+FFFD); ``token_bytes`` are the token's raw bytes (OpenAI's
    ``bytes``), so the pieces of a split character join back into it.
    """

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = field(default_factory=list)
    token_bytes: bytes | None = None


@dataclass
class RequestOutput:
    """A finished sample as handed back by ``LLMEngine.step`` / ``generate``.

    A request with ``n = k`` gives k outputs with the same ``request_id`` and ``sample_index`` 0..k-1.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first prompt token: None
    sample_index: int = 0
    num_samples: int = 1
    pooled: PooledOutput | None = None  # a prefill-only request's embedding / scores / log-likelihood

    @property
    def finished(self) -> bool:
        return True


class Request:
    """Engine-side state of one request.

    The scheduler's only rule: hand out tokens so that ``num_computed_tokens`` catches up with
    ``num_tokens`` (prompt + generated so far).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, eos_token_ids: tuple[int, ...] = (), sample_index: int = 0,
                 seed: int = 0) -> None:
        self.request_id = request_id
        self.sample_index = sample_index
        # unique inside the engine (the n samples of a request share its request_id)
        self.key: tuple[str, int] = (request_id, sample_index)
        self.seed = seed  # counter-based sampling stream: (seed, output position) -> noise
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.num_cached_blocks = 0  # leading blocks already registered in the prefix cache
        self.block_hashes: list[int] = []
        self.rope_table = 0  # the rope table its KV is rotated with: longrope's long one is 1 (engine/long_rope.py)
        self.adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)
        self.adapter_id = 0  # that adapter's id in the model's AdapterSet (models/lora.py); 0 = base model
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.text = ""
        self.stopped_on_string = False
        self.error: str | None = None
        self.siblings: list[Request] = []  # samples 1..n-1, started once this one's prompt is computed
        self.grammar = None                # a structured-output matcher (engine/sampling/structured.py)
        self.detok = None                  # incremental detokenizer state (stop strings)
        self.draft_token_ids: list[int] = []  # speculative tokens to verify in the next step (engine/speculative)
        # late readback (engine/readback.py): output_token_ids ends with this many PENDING_TOKENs (0 or 1), and
        # whether the request ends with that token whatever it is (its length limit): not scheduled meanwhile
        self.num_pending_tokens = 0
        self.ends_with_pending = False
        self.spec = None                   # the n-gram drafter's per-request state
        self.images = None                 # RequestImages (engine/vision.py): a vision-language prompt's images
        self.metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids))
        # a prefill-only request (engine/pooling.py): finishes once its tokens are computed, samples nothing
        self.pooling: PoolingParams | None = None
        self.pool_state = PoolingState()
        self.pool_prompt_len = len(prompt_token_ids)  # loglik: tokens before the completion
        self.pooled: PooledOutput | None = None

    def make_pooling(self, params: PoolingParams, num_prompt_tokens: int) -> None:
        """Turn this into a prefill-only request; its first ``num_prompt_tokens`` tokens precede a scored
        completion (loglik), else they are all of it."""
        self.pooling, self.pool_prompt_len = params, num_prompt_tokens

    @property
    def first_needed_position(self) -> int:
        """The first position whose computation this request needs: a prefix-cache hit stops before it."""
        if self.pooling is None:
            return self.num_tokens - 1  # the last token is always computed (its logits sample the next)
        return first_needed(self.pooling, self.pool_prompt_len, self.num_tokens)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def to_output(self) -> RequestOutput:
        self.metrics.num_output_tokens = len(self.output_token_ids)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=list(self.output_token_ids),
            text=self.text,
            finish_reason=FINISH_REASONS.get(self.status, "error"),
            error=self.error,
            metrics=self.metrics,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs,
            sample_index=self.sample_index,
            num_samples=self.params.n,
            pooled=self.pooled,
        )
