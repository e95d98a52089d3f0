"""What a step hands back to the host, read at once or one step late.

The synchronous step reads its sampled ids as soon as they are picked (the host waits for the whole forward).
With *late readback* (``EngineConfig.late_readback``; docs/engine.md, "One-step-late readback") the engine
launches step N+1 before it reads step N: step N's ids stay on the device (:class:`DeviceTokens`), the rows
that decode them in step N+1 take them there (the step runner patches its input ids,
:func:`jobrunner.attention.step_runner.patch_input_ids`), and the host copy of step N's ids
(:class:`HostCopy`: pinned, non-blocking, an event) completes while step N+1 runs. Only then does the host
append the tokens, check stops and free finished rows. :class:`LaunchedStep` is one step in that state.

One engine step in this mode (``LLMEngine.step``; the synchronous mode is the same loop with every step read
as soon as it is launched), with step N launched and unread:

1. if the running requests could run out of KV blocks, read step N first (a step that may preempt is then
   decided on the same state as the synchronous path); in strict mode also whenever a request waits to be
   admitted (else it is admitted a step later than the synchronous path would, into the room a row that ended
   at N leaves: the same tokens, but a prefix-cache hit can differ where blocks were evicted meanwhile);
2. schedule step N+1 -- step N's rows count their token already: a placeholder ends each one's output, and a
   row whose length limit that token reaches is not scheduled (it ends whatever the token is);
3. launch step N+1 (its decode rows take step N's ids on the device) and set its rows' computed tokens;
4. read step N (the copy has run while the host did 2-3): placeholders give way to tokens, stops are checked,
   finished rows are freed and handed back (``Scheduler.update_from_output``); a row that stopped at N ran in
   N+1 for nothing and its token is dropped when N+1 is read (not read at all when every row of N+1 has ended);
5. hold step N+1 unread, its sampled rows ending in a placeholder (``Scheduler.hold``) -- unless one of its rows
   must be read at once (:func:`can_read_late`), then read it now.

Which rows may be read late (:func:`can_read_late`): those whose next sampling needs nothing of the token on
the host. A row with a grammar (structured output: the mask of step N+1 follows the token of step N), penalties
(the device counts are fed from the host's token lists), a prefill-only (pooling) request, or sample 0 of an
``n > 1`` request before its siblings fork, makes its step synchronous: that step is read as soon as it is
launched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jobrunner.engine.config import LATE_READBACK_MODES
from jobrunner.engine.request import Request
from jobrunner.engine.sampler import DeviceSample, host_output
from jobrunner.engine.sampling.logprobs import LogprobEntry


@dataclass
class StepResult:
    sampled: dict[tuple[str, int], int]            # Request.key -> new token (rows that reached their end)
    logprobs: dict[tuple[str, int], LogprobEntry]  # Request.key -> (token, logprob, top alternatives), if asked
    num_prefill_tokens: int
    num_decode_tokens: int
    fixed_shape: bool = False          # ran through a fixed-shape path (a CUDA graph replay, or its eager twin)
    speculative: dict | None = None    # Request.key -> VerifiedDraft, rows that verified drafts (speculative/)
    pooled: dict | None = None         # Request.key -> PooledOutput (or why it failed), prefill-only rows done


@dataclass
class DeviceTokens:
    """The ids a launched step sampled, on the device, and which of them is each sequence's."""

    tokens: torch.Tensor                   # [num sampled rows] int64
    index_of: dict[tuple[str, int], int]   # Request.key -> its row in ``tokens``


class HostCopy:
    """A device tensor's copy to pinned host memory, queued now; :meth:`wait` waits for that copy only.

    On the CPU the tensor is its own copy."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.event = None
        if tensor.device.type != "cuda":
            self.host = tensor
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


class LaunchedStep:
    """A step whose forward and sampling are queued on the device, its ids on their way to the host."""

    def __init__(self, sample: DeviceSample | None, requests: list[Request], num_prefill_tokens: int,
                 num_decode_tokens: int, fixed_shape: bool, pooled: dict | None = None,
                 result: StepResult | None = None) -> None:
        self.sample = sample              # None: nothing sampled (only prompt chunks that do not reach their end)
        self.requests = requests          # the sampled rows, in ``sample`` order
        self.num_prefill_tokens = num_prefill_tokens
        self.num_decode_tokens = num_decode_tokens
        self.fixed_shape = fixed_shape
        self.pooled = pooled              # prefill-only rows' results (computed on the host already)
        self.result = result              # read already (a speculative step verifies its drafts at once)
        self.copy = HostCopy(sample.host_tensor()) if sample is not None else None

    @property
    def device_tokens(self) -> DeviceTokens | None:
        """The sampled ids for the next step's inputs (None when nothing was sampled)."""
        if self.sample is None:
            return None
        return DeviceTokens(self.sample.tokens, {r.key: i for i, r in enumerate(self.requests)})

    def read(self) -> StepResult:
        """Wait for the ids (and logprobs) on the host: the step's result."""
        if self.result is not None:
            return self.result
        sampled: dict[tuple[str, int], int] = {}
        logprobs: dict[tuple[str, int], LogprobEntry] = {}
        if self.sample is not None:
            out = host_output(self.sample, self.copy.wait(), self.requests)
            sampled = {r.key: t for r, t in zip(self.requests, out.token_ids)}
            logprobs = {r.key: e for r, e in zip(self.requests, out.logprobs) if e is not None}
        return StepResult(sampled, logprobs, self.num_prefill_tokens, self.num_decode_tokens, self.fixed_shape,
                          pooled=self.pooled)


def can_read_late(request: Request) -> bool:
    """Whether ``request``'s sampled token may stay on the device for a step (see the module docstring)."""
    return (request.grammar is None and not request.params.has_penalties and request.pooling is None
            and not request.siblings)


def late_readback_on(mode: str, device: torch.device, has_speculator: bool) -> bool:
    """Whether an engine reads its steps late: ``cuda`` on a CUDA device, ``always`` anywhere (tests prove the
    logic on the CPU), never ``off``; and never with a speculator (its drafts need the last token on the host)."""
    if mode not in LATE_READBACK_MODES:
        raise ValueError(f"late_readback must be one of {'|'.join(LATE_READBACK_MODES)}, got {mode!r}")
    return not has_speculator and (mode == "always" or (mode == "cuda" and device.type == "cuda"))
