"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, and samples.

Per step the runner describes the scheduled rows once (:class:`~jobrunner.attention.StepLayout`), lets the
attention backend add its arrays, and sends every integer input of the step to the device in one copy
(:class:`~jobrunner.attention.StepUpload`, pinned and reused on CUDA). Fixed-shape paths (CUDA graphs and
their eager twins) live in :mod:`jobrunner.engine.decode_graphs` (torch backend: decode-only steps) and
:mod:`jobrunner.engine.step_graphs` (triton backend: every step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from jobrunner.attention import AttentionMetadata, StepLayout, StepUpload, make_backend
from jobrunner.attention.upload import PinnedStaging
from jobrunner.engine.decode_graphs import DecodeGraphs, DecodeRow
from jobrunner.engine.sampler import Sampler
from jobrunner.engine.sampling.logprobs import LogprobEntry
from jobrunner.engine.scheduler import ScheduledRequest, SchedulerOutput
from jobrunner.engine.speculative.verify import verify_drafts

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    sampled: dict[tuple[str, int], int]            # Request.key -> new token (rows that reached their end)
    logprobs: dict[tuple[str, int], LogprobEntry]  # Request.key -> (token, logprob, top alternatives), if asked
    num_prefill_tokens: int
    num_decode_tokens: int
    fixed_shape: bool = False          # ran through a fixed-shape path (a CUDA graph replay, or its eager twin)
    speculative: dict | None = None    # Request.key -> VerifiedDraft, rows that verified drafts (speculative/)


@dataclass
class StepInputs:
    input_ids: torch.Tensor            # [T]
    positions: torch.Tensor            # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor          # [num sampling rows] flat index of the token each samples from
    sampling: list[ScheduledRequest]


class ModelRunner:
    """Owns the model and the KV cache tensor ``[num_layers, 2, num_slots, kv_heads, head_dim]``.

    ``attention_backend``: ``auto`` | ``torch`` | ``triton`` (see :mod:`jobrunner.attention`); a ``triton``
    backend that cannot start, or fails on its first use, falls back to ``torch`` with one warning.
    ``decode_graphs``: ``"off"``; ``"cuda"`` (fixed-shape steps replay CUDA graphs); ``"static"`` (the same
    fixed-shape path run eagerly, on any device: for tests). With either of the last two the cache holds one
    scratch block past ``num_blocks``. With the torch backend only decode-only steps take the fixed-shape
    path (:mod:`~jobrunner.engine.decode_graphs`); with triton every step up to ``max_num_tokens`` does
    (:mod:`~jobrunner.engine.step_graphs`).
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, device: torch.device,
                 seed: int = 0, decode_graphs: str = "off", max_batch: int = 1, max_model_len: int = 1,
                 attention_backend: str = "auto", max_num_tokens: int = 2048) -> None:
        if decode_graphs not in ("off", "cuda", "static"):
            raise ValueError(f"decode_graphs must be off|cuda|static, got {decode_graphs!r}")
        self.sliding_window = _effective_window(model.shape.sliding_window, max_model_len)
        if self.sliding_window is not None and (attention_backend == "triton" or decode_graphs != "off"):
            log.warning("sliding-window attention (window %d < max_model_len %d) runs on the eager torch backend "
                        "only; attention_backend=%r and decode_graphs=%r are not used", self.sliding_window,
                        max_model_len, attention_backend, decode_graphs)
            attention_backend, decode_graphs = "torch", "off"
        self.model = model
        self.device = device
        self.block_size = block_size
        s = model.shape
        dtype = model.dtype
        total_blocks = num_blocks + (decode_graphs != "off")
        # zeros, not empty: padded keys are masked, but NaN garbage would still poison 0 * NaN
        self.kv_cache = torch.zeros(s.num_layers, 2, total_blocks * block_size, s.num_kv_heads, s.head_dim,
                                    dtype=dtype, device=device)
        self.sampler = Sampler(device, seed)
        self.staging = PinnedStaging() if device.type == "cuda" else None
        self.num_attention_fallbacks = 0
        self.requested_backend = attention_backend
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.backend = self._make_backend(attention_backend)
        self.graphs = None
        if decode_graphs != "off":
            self.graphs = self._make_graphs(decode_graphs, num_blocks, max_batch, max_model_len, max_num_tokens)
            if decode_graphs == "cuda" and device.type == "cuda":
                self.graphs.warm_up()   # every bucket captured now, before any (timed) step

    def _make_backend(self, name: str):
        s = self.model.shape
        try:
            return make_backend(name, s.num_heads, s.num_kv_heads, self.block_size, self.device,
                                max_rows=self.max_batch, max_model_len=self.max_model_len)
        except RuntimeError as exc:  # triton asked for where it cannot run: the tested torch path instead
            self.num_attention_fallbacks += 1
            log.warning("attention backend %r unavailable (%s); using torch", name, exc)
            return make_backend("torch", s.num_heads, s.num_kv_heads, self.block_size, self.device)

    def _make_graphs(self, mode: str, num_blocks: int, max_batch: int, max_model_len: int, max_num_tokens: int):
        if self.backend.name == "triton":
            from jobrunner.engine.step_graphs import StepGraphs

            return StepGraphs(self.model, self.kv_cache, self.backend, max_batch, max_num_tokens, max_model_len,
                              scratch_block=num_blocks, capture=mode == "cuda", staging=self.staging)
        return DecodeGraphs(self.model, self.kv_cache, self.block_size, max_batch, max_model_len,
                            scratch_block=num_blocks, capture=mode == "cuda")

    def stats(self) -> dict:
        """Which attention backend runs, its fallbacks, and the fixed-shape path's counters."""
        out = {"attention_backend": self.backend.name, "attention_fallbacks": self.num_attention_fallbacks,
               "attention_backend_requested": self.requested_backend}
        if self.graphs is not None:
            out.update(self.graphs.stats())
        return out

    def release(self, request_key) -> None:
        """A sequence finished: the backend and the sampler forget its per-row state (table row, penalty counts)."""
        self.backend.release(request_key)
        self.sampler.release(request_key)

    @staticmethod
    def bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
        s = model.shape
        itemsize = torch.tensor([], dtype=dtype).element_size()
        return s.num_layers * 2 * block_size * s.num_kv_heads * s.head_dim * itemsize

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        hidden, sample_rows, sampling, fixed = self._forward(sched.scheduled)
        verified = None
        if any(s.draft for s in sampling):  # speculative rows: score every draft position, keep what matches
            sampled, logprobs, verified = verify_drafts(self.model, self.sampler, hidden, sample_rows, sampling)
        else:
            sampled, logprobs = self._sample(hidden, sample_rows, sampling)
        num_decode = sum(1 + len(s.draft) for s in sched.scheduled if _is_decode(s))
        return StepResult(sampled, logprobs, sched.num_tokens - num_decode, num_decode, fixed, verified)

    # -- the forward pass (attention metadata and fixed-shape paths; sampling stays in execute) ---------------

    def _forward(self, scheduled: list[ScheduledRequest]):
        """(hidden [T, hidden], sample_rows, sampling requests, whether a fixed-shape path ran)."""
        if self.graphs is not None:
            fixed = self._run_fixed_shape(scheduled)
            if fixed is not None:
                return (*fixed, True)
        inputs = self._prepare(scheduled)
        try:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache)
        except Exception as exc:
            if self.backend.name == "torch":
                raise
            # e.g. a Triton compile error: never a crashed job. Rewriting this step's K/V is harmless.
            self._fall_back_to_torch(exc)
            inputs = self._prepare(scheduled)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache)
        return hidden, inputs.sample_rows, inputs.sampling, False

    def _fall_back_to_torch(self, exc: Exception) -> None:
        log.warning("attention backend %r failed (%s: %s); falling back to torch for the rest of the run",
                    self.backend.name, type(exc).__name__, exc)
        self.num_attention_fallbacks += 1
        self.backend = make_backend("torch", 1, 1, self.block_size, self.device)
        if getattr(self, "deterministic", False):  # engine.deterministic: the fixed-order torch twin
            from jobrunner.attention.invariant_ops import INVARIANT_BACKEND

            self.backend = INVARIANT_BACKEND
        if self.graphs is not None and not isinstance(self.graphs, DecodeGraphs):
            self.graphs = None  # step graphs need the triton metadata

    # -- sampling (owned by the sampler side: engine/sampler.py) ------------------------------------------------

    def _sample(self, hidden: torch.Tensor, sample_rows: torch.Tensor, sampling: list[ScheduledRequest]
                ) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], LogprobEntry]]:
        """New tokens (and logprob entries where asked) keyed by ``Request.key``."""
        if not sampling:
            return {}, {}
        logits = self.model.compute_logits(hidden.index_select(0, sample_rows))
        requests = [s.request for s in sampling]
        out = self.sampler.sample(logits, requests)
        sampled = {r.key: t for r, t in zip(requests, out.token_ids)}
        logprobs = {r.key: e for r, e in zip(requests, out.logprobs) if e is not None}
        return sampled, logprobs

    def _run_fixed_shape(self, scheduled: list[ScheduledRequest]):
        if isinstance(self.graphs, DecodeGraphs):
            return self._run_decode_graphs(scheduled)
        layout, lists = self._layout(scheduled)
        try:
            out = self.graphs.run(layout, *lists)
        except Exception as exc:  # a failed replay/launch of the triton path: eager torch from now on
            self._fall_back_to_torch(exc)
            return None
        if out is None:
            return None
        hidden, sample_rows = out
        return hidden, sample_rows, [s for s in scheduled if s.samples]

    def _run_decode_graphs(self, scheduled: list[ScheduledRequest]):
        """A step of single-token rows through DecodeGraphs; None when it has a chunk or doesn't fit a shape."""
        if any(s.num_new_tokens != 1 or s.draft for s in scheduled):
            return None
        bs = self.block_size
        rows = []
        for s in scheduled:
            req, p = s.request, s.start
            past_prompt = p - req.num_prompt_tokens
            token = req.output_token_ids[past_prompt] if past_prompt >= 0 else req.prompt_token_ids[p]
            table = req.block_ids
            rows.append(DecodeRow(token, p, table[p // bs] * bs + p % bs, table[:p // bs + 1]))
        shape = self.graphs.shape_for(rows)
        if shape is None:
            return None
        hidden = self.graphs.run(rows, shape)
        sampling = [s for s in scheduled if s.samples]
        sample_rows = torch.tensor([i for i, s in enumerate(scheduled) if s.samples], device=self.device)
        return hidden, sample_rows, sampling

    def _layout(self, scheduled: list[ScheduledRequest]):
        """The step's StepLayout and its flat lists (input ids, positions, cache slots, sampling rows)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        bs = self.block_size
        layout = StepLayout([], [], [], [], 0, bs, row_keys=[], sliding_window=self.sliding_window)
        for s in scheduled:
            req, start, n = s.request, s.start, s.num_new_tokens
            offset = len(input_ids)
            if n == 1 and start >= req.num_prompt_tokens:
                input_ids.append(req.output_token_ids[start - req.num_prompt_tokens])
            else:
                input_ids.extend(req.all_token_ids[start:start + n])
            if s.draft:  # speculative tokens: scored in this step after the real one (causal within the row)
                input_ids.extend(s.draft)
                n += len(s.draft)
            positions.extend(range(start, start + n))
            table = req.block_ids
            slots.extend(_slots(table, start, start + n, bs))
            layout.query_starts.append(offset)
            layout.query_lens.append(n)
            layout.seq_lens.append(start + n)
            layout.block_tables.append(table)
            layout.row_keys.append(req.key)   # per sample: siblings have their own block tables
            if s.samples:
                sample_rows.extend(range(offset + n - 1 - len(s.draft), offset + n))
        layout.num_tokens = len(input_ids)
        return layout, (input_ids, positions, slots, sample_rows)

    def _prepare(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        layout, (input_ids, positions, slots, sample_rows) = self._layout(scheduled)
        upload = StepUpload(self.device, self.staging)
        upload.add("input_ids", input_ids)
        upload.add("positions", positions)
        upload.add("slot_mapping", slots)
        upload.add("sample_rows", sample_rows)
        meta = self.backend.build(layout, upload)  # adds the backend's arrays, then one copy for all
        t = upload.flush()
        return StepInputs(t["input_ids"], t["positions"], meta, t["sample_rows"],
                          [s for s in scheduled if s.samples])


def _effective_window(window: int | None, max_model_len: int) -> int | None:
    """The model's sliding window where it can hide a key: None when no sequence outgrows it."""
    return window if window is not None and window < max_model_len else None


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions start..end-1 (block by block: a whole block is one range)."""
    out: list[int] = []
    p = start
    while p < end:
        block_end = min(end, (p // block_size + 1) * block_size)
        base = table[p // block_size] * block_size - (p // block_size) * block_size
        out.extend(range(base + p, base + block_end))
        p = block_end
    return out


def _is_decode(s: ScheduledRequest) -> bool:
    return s.num_new_tokens == 1 and s.start >= s.request.num_prompt_tokens
