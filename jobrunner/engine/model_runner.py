"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, and samples.

Per step the runner describes the scheduled rows once (:class:`~jobrunner.attention.StepLayout` and the flat
:class:`~jobrunner.attention.StepLists`) and hands them to the attention backend's step runner
(:class:`~jobrunner.attention.StepRunner`), which takes the backend's fixed-shape path (CUDA graphs, or their
eager twin) when the step fits it and runs eagerly otherwise, with every integer input of the step sent to
the device in one copy. The runner has one path; its one fall-back rule: a backend other than the torch
backend that cannot start, or fails on a step, is replaced by the torch backend (its deterministic twin in
deterministic mode) and the step is recomputed eagerly; never a crashed job.
"""

from __future__ import annotations

import logging

import torch

from jobrunner.attention import (
    AttentionBackend,
    FixedShapeLimits,
    StepForward,
    StepLayout,
    StepLists,
    make_backend,
    make_step_runner,
)
from jobrunner.attention.kv_quant import cache_dtype, kv_bytes_per_block, row_width
from jobrunner.engine.config import EngineConfig
from jobrunner.engine.pooling import collect
from jobrunner.engine.pooling import finish as finish_pooling
from jobrunner.engine.readback import DeviceTokens, LaunchedStep, StepResult
from jobrunner.engine.request import PENDING_TOKEN
from jobrunner.engine.sampler import Sampler
from jobrunner.engine.scheduler import ScheduledRequest, SchedulerOutput
from jobrunner.engine.speculative.verify import verify_drafts
from jobrunner.engine.vision import ImageEncoder
from jobrunner.models.huge_pages import empty_huge

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model and the KV cache tensor ``[num_layers, 2, num_slots, kv_heads, head_dim]`` (of the model's
    dtype, or with ``kv_cache_dtype`` an fp8 format: rows ``head_dim + 4`` wide, :mod:`jobrunner.attention.kv_quant`).

    Built from the engine's config: ``block_size``, ``seed``, ``max_num_seqs``, ``max_num_batched_tokens`` (the
    fixed-shape path's most tokens), ``kv_cache_dtype``, ``split_decode`` (the triton backend's split-K decode
    mode: :mod:`jobrunner.attention.split_decode`), ``deterministic`` (the batch-invariant backend, row tiles and
    sampler, chosen here: :func:`jobrunner.engine.invariant.make_deterministic`) and ``attention_backend``:
    ``auto`` | ``torch`` | ``cpu_paged`` | ``triton`` (see :mod:`jobrunner.attention`; ``auto`` is ``cpu_paged``
    for float32 / bf16 on CPU, else ``torch``: :meth:`_resolve`); a ``triton`` or ``cpu_paged`` backend that
    cannot start, or fails on its first use, falls back to ``torch`` with one warning.
    ``max_model_len``: the longest sequence (None: the config's cap, or the model's context).
    ``decode_graphs`` (the engine's choice from the config, the device and the model): ``"off"``; ``"cuda"``
    (fixed-shape steps replay CUDA graphs); ``"static"`` (the same fixed-shape path run eagerly, on any device:
    for tests). With either of the last two the cache holds one scratch block past ``num_blocks``, and the
    backend's fixed-shape runner takes the steps it fits (torch: decode-only steps; triton: every step up to
    ``max_num_batched_tokens``; see :mod:`jobrunner.attention.step_runner`).
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig, num_blocks: int, device: torch.device,
                 max_model_len: int | None = None, decode_graphs: str = "off") -> None:
        if decode_graphs not in ("off", "cuda", "static"):
            raise ValueError(f"decode_graphs must be off|cuda|static, got {decode_graphs!r}")
        context = model.shape.max_position_embeddings
        max_model_len = max_model_len or min(config.max_model_len or context, context)
        attention_backend, block_size = config.attention_backend, config.block_size
        self.sliding_window = _effective_window(model.shape.sliding_window, max_model_len)
        self.layer_windows = _effective_layer_windows(model.shape.layer_windows, max_model_len)
        if self.layer_windows is not None and len(set(self.layer_windows)) == 1:  # every layer alike after all
            self.sliding_window, self.layer_windows = self.layer_windows[0], None
        self.attention_notes: list[str] = []  # why the backend or graphs differ from what was asked (stats())
        if (self.sliding_window is not None or self.layer_windows is not None) and (
                attention_backend == "triton" or decode_graphs != "off"):
            # the triton kernel and the fixed-shape (graph) runners take no window
            eager = "torch" if attention_backend == "triton" else attention_backend  # auto: cpu_paged on CPU
            note = (f"sliding-window attention ({_describe_windows(self.sliding_window, self.layer_windows)} < "
                    f"max_model_len {max_model_len}) runs eagerly on the torch or cpu_paged backend only: "
                    f"attention_backend={attention_backend!r}, decode_graphs={decode_graphs!r} -> "
                    f"attention_backend={eager!r}, decode_graphs='off'")
            log.warning("%s", note)
            self.attention_notes.append(note)
            attention_backend, decode_graphs = eager, "off"
        self.model = model
        self.device = device
        self.block_size = block_size
        s = model.shape
        total_blocks = num_blocks + (decode_graphs != "off")
        self.kv_cache_dtype = cache_dtype(config.kv_cache_dtype, model.dtype)
        # zeros, not empty: padded keys are masked, but NaN garbage would still poison 0 * NaN
        width = row_width(s.head_dim, self.kv_cache_dtype)  # fp8: head_dim codes + a float32 scale (kv_quant)
        shape = (s.num_layers, 2, total_blocks * block_size, s.num_kv_heads, width)
        if device.type == "cpu":  # huge pages where JOBRUNNER_HUGE_PAGES=all asks (models/huge_pages.py)
            self.kv_cache = empty_huge(*shape, dtype=self.kv_cache_dtype, kind="kv_cache").zero_()
        else:
            self.kv_cache = torch.zeros(*shape, dtype=self.kv_cache_dtype, device=device)
        self.deterministic = config.deterministic  # batch-invariant: its backend, and the invariant twin on fall-back
        self.sampler = Sampler(device, config.seed, invariant=self.deterministic)
        self.num_attention_fallbacks = 0
        self.requested_backend = attention_backend
        self.max_num_seqs, self.max_model_len = config.max_num_seqs, max_model_len
        self.split_decode = config.split_decode  # the triton backend's split-K decode mode (attention/split_decode.py)
        limits = None
        if decode_graphs != "off":
            limits = FixedShapeLimits(block_size, config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                                      scratch_block=num_blocks, capture=decode_graphs == "cuda")
        name = self._route_softcap(self._resolve(attention_backend, decode_graphs), attention_backend)
        backend = self._make_backend(name)
        if self.deterministic:
            from jobrunner.engine.invariant import make_deterministic

            backend = make_deterministic(model, backend, attention_backend, device)  # the invariant twin: eager
        self.steps = make_step_runner(backend, model, self.kv_cache, limits)
        if decode_graphs == "cuda" and device.type == "cuda":
            self.steps.warm_up()   # every bucket captured now, before any (timed) step

    # a vision-language model's image encoder (engine/vision.py), set by the engine; None for a text model
    images: ImageEncoder | None = None

    @property
    def backend(self) -> AttentionBackend:
        """The attention backend every step runs through."""
        return self.steps.backend

    @property
    def graphs(self):
        """The backend's fixed-shape runner (None when off, or after a fall-back)."""
        return self.steps.fixed

    def use_backend(self, backend: AttentionBackend) -> None:
        """Run every later step eagerly through ``backend`` (deterministic mode's twin, a fall-back)."""
        self.steps = make_step_runner(backend, self.model, self.kv_cache)

    def _resolve(self, name: str, decode_graphs: str) -> str:
        """``auto``: ``cpu_paged`` for float32 and bfloat16 on CPU (eager steps), where it was measured faster than
        ``torch`` on every benchmark workload in both dtypes (docs/bench.md); ``torch`` elsewhere (CUDA, float16),
        and where the native kernel cannot be built here (said at info level: nothing asked for failed)."""
        if name != "auto":
            return name
        if (self.device.type != "cpu" or self.model.dtype not in (torch.float32, torch.bfloat16)
                or decode_graphs != "off"):
            return "torch"
        from jobrunner.attention.cpu_paged import cpu_paged_unavailable_reason

        reason = cpu_paged_unavailable_reason(self.device, self.model.shape.head_dim)
        if reason:
            log.info("attention backend auto: torch (%s)", reason)
            return "torch"
        return "cpu_paged"

    def _route_softcap(self, name: str, requested: str) -> str:
        """``torch`` for a model that soft-caps attention logits (Gemma 2) where ``name``'s kernel cannot
        (cpu_paged, triton); said once, at warning level when that backend was asked for by name."""
        cap = self.model.shape.attn_logit_softcapping
        if cap is None or name not in ("cpu_paged", "triton"):
            return name
        note = (f"{self.model.shape.architecture} soft-caps attention logits (attn_logit_softcapping={cap:g}), "
                f"which the {name} kernel does not do: attention runs on the torch backend")
        log.log(logging.WARNING if requested == name else logging.INFO, "%s", note)
        self.attention_notes.append(note)
        return "torch"

    def _make_backend(self, name: str) -> AttentionBackend:
        s = self.model.shape
        try:
            return make_backend(name, s.num_heads, s.num_kv_heads, self.block_size, self.device,
                               max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len, head_dim=s.head_dim,
                               dtype=self.model.dtype, split_decode=self.split_decode,
                               cache_dtype=self.kv_cache_dtype)
        except RuntimeError as exc:  # triton / cpu_paged where it cannot run: the tested torch path instead
            self.num_attention_fallbacks += 1
            log.warning("attention backend %r unavailable (%s); using torch", name, exc)
            return make_backend("torch", s.num_heads, s.num_kv_heads, self.block_size, self.device)

    def stats(self) -> dict:
        """Which attention backend runs, its fallbacks, the KV cache's dtype where it is not the model's, and the
        fixed-shape path's counters."""
        out = {"attention_backend": self.backend.name, "attention_fallbacks": self.num_attention_fallbacks,
               "attention_backend_requested": self.requested_backend}
        if self.kv_cache_dtype != self.model.dtype:  # an fp8 cache (engine.kv_cache_dtype)
            out["kv_cache_dtype"] = str(self.kv_cache_dtype).removeprefix("torch.")
        if self.attention_notes:
            out["attention_notes"] = list(self.attention_notes)
        if self.backend.chunk_route:
            out["attention_chunks"] = self.backend.chunk_route
        out.update(self.backend.counters())
        out.update(self.steps.stats())
        return out

    def release(self, request_key) -> None:
        """A sequence finished: the backend and the sampler forget its per-row state (table row, penalty counts)."""
        self.backend.release(request_key)
        self.sampler.release(request_key)

    @staticmethod
    def bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one KV block (all layers, K and V) in a cache of ``dtype`` (an fp8 cache's scales included)."""
        s = model.shape
        return kv_bytes_per_block(s.num_layers, s.num_kv_heads, s.head_dim, block_size, dtype)

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Run a step and read its result at once (:meth:`launch`, then :meth:`LaunchedStep.read`)."""
        return self.launch(sched).read()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, previous: DeviceTokens | None = None) -> LaunchedStep:
        """Queue the step's forward and sampling on the device and start its ids' copy to the host; read them
        with :meth:`LaunchedStep.read`, at once or one step late (engine/readback.py). A decode row whose input
        is a placeholder (its token still on the device) reads it from ``previous``, the last launched step's
        ids. A step with speculative rows scores every draft position and keeps what matches: read at once."""
        if self.images is not None:
            self.images.drop(sched.preempted)
        layout, lists = self._layout(sched.scheduled, previous)
        step = self._forward_with_adapters(sched.scheduled, layout, lists)
        self._pool(sched.scheduled, step.hidden, layout.query_starts)
        pooled = self._pooled(sched.scheduled)
        sampling = [s for s in sched.scheduled if s.samples]
        num_decode = sum(1 + len(s.draft) for s in sched.scheduled if _is_decode(s))
        num_prefill = sched.num_tokens - num_decode
        if any(s.draft for s in sampling):
            sampled, logprobs, verified = verify_drafts(self.model, self.sampler, step.hidden, step.sample_rows,
                                                        sampling)
            result = StepResult(sampled, logprobs, num_prefill, num_decode, step.fixed_shape, verified, pooled)
            return LaunchedStep(None, [], num_prefill, num_decode, step.fixed_shape, result=result)
        sample = None
        if sampling:
            logits = self.model.compute_logits(step.hidden.index_select(0, step.sample_rows))
            sample = self.sampler.sample_on_device(logits, [s.request for s in sampling])
        return LaunchedStep(sample, [s.request for s in sampling], num_prefill, num_decode, step.fixed_shape, pooled)

    def _forward_with_adapters(self, scheduled: list[ScheduledRequest], layout: StepLayout,
                               lists: StepLists) -> StepForward:
        """The step's forward with each row's LoRA adapter (models/lora.py): the token rows of every adapter in
        the step, found once here, are what each adapted layer reads."""
        adapters = self.model.lora
        row_adapters = [s.request.adapter_id for s in scheduled]
        if adapters is None or not any(row_adapters):
            return self._forward_with_images(scheduled, layout, lists)
        groups = adapters.token_groups(row_adapters, layout.query_starts, layout.query_lens, self.device)
        with adapters.step(groups):
            return self._forward_with_images(scheduled, layout, lists)

    def _forward_with_images(self, scheduled: list[ScheduledRequest], layout: StepLayout,
                             lists: StepLists) -> StepForward:
        """The step's forward with the image vectors of the image tokens it computes in place of their embeddings
        (engine/vision.py), eagerly (a fixed-shape runner's forward would not read them)."""
        found = self.images.step_rows(scheduled, layout.query_starts, self.device) if self.images else None
        if found is None:
            return self._forward(layout, lists)
        with self.model.image_step(*found):
            return self._forward(layout, lists, eager=True)

    def _forward(self, layout: StepLayout, lists: StepLists, eager: bool = False) -> StepForward:
        """The step through the backend's step runner; a failing backend gives way to the fall-back one."""
        try:
            return self.steps.run(layout, lists, eager=eager)
        except Exception as exc:
            fallback = self._fallback_backend()
            if self.backend is fallback:
                raise
            # e.g. a Triton compile error, or a failed graph launch: never a crashed job. Rewriting this step's
            # K/V is harmless.
            log.warning("attention backend %r failed (%s: %s); falling back to %s for the rest of the run",
                        self.backend.name, type(exc).__name__, exc, fallback.name)
            self.num_attention_fallbacks += 1
            self.use_backend(fallback)
            return self.steps.run(layout, lists, eager=eager)

    def _fallback_backend(self) -> AttentionBackend:
        """The torch backend; in deterministic mode its fixed-order twin."""
        if self.deterministic:
            from jobrunner.attention.invariant_ops import INVARIANT_BACKEND

            return INVARIANT_BACKEND
        return make_backend("torch", 1, 1, self.block_size, self.device)

    def _pool(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor, query_starts: list[int]) -> None:
        """Prefill-only rows keep what their task needs of this step's hidden states (engine/pooling.py)."""
        for s, offset in zip(scheduled, query_starts):
            if s.request.pooling is not None:
                collect(self.model, s.request, hidden[offset:offset + s.num_new_tokens], s.start)

    def _pooled(self, scheduled: list[ScheduledRequest]) -> dict:
        """The result of each prefill-only row whose last token this step computed (engine/pooling.py), or why
        it could not be made (that request only)."""
        out = {}
        for s in scheduled:
            if s.request.pooling is not None and s.completes:
                try:
                    out[s.request.key] = finish_pooling(self.model, s.request)
                except Exception as exc:  # noqa: BLE001 - that request only
                    out[s.request.key] = f"could not pool the hidden states: {exc}"
        return out

    def _layout(self, scheduled: list[ScheduledRequest], previous: DeviceTokens | None = None):
        """The step's StepLayout and its flat lists (input ids, positions, cache slots, sampling rows); a decode
        of a placeholder takes its id from ``previous`` on the device (:func:`_input_sources`)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        bs = self.block_size
        layout = StepLayout([], [], [], [], 0, bs, row_keys=[], sliding_window=self.sliding_window,
                            layer_windows=self.layer_windows)
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
            shift = self.model.rotary.table_offset(req.rope_table) if req.rope_table else 0  # longrope's long table
            positions.extend(range(start + shift, start + n + shift))
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
        lists = StepLists(input_ids, positions, slots, sample_rows)
        if PENDING_TOKEN in input_ids:
            lists.input_sources, lists.source_tokens = _input_sources(scheduled, input_ids, previous)
        return layout, lists


def _effective_window(window: int | None, max_model_len: int) -> int | None:
    """The model's sliding window where it can hide a key: None when no sequence outgrows it."""
    return window if window is not None and window < max_model_len else None


def _effective_layer_windows(windows: tuple[int | None, ...] | None, max_model_len: int
                            ) -> tuple[int | None, ...] | None:
    """Per-layer windows (Gemma 2/3) where they can hide a key (see :func:`_effective_window`)."""
    return None if windows is None else tuple(_effective_window(w, max_model_len) for w in windows)


def _describe_windows(window: int | None, layer_windows: tuple[int | None, ...] | None) -> str:
    if layer_windows is None:
        return f"window {window}"
    local = [w for w in layer_windows if w is not None]
    return f"window {local[0]} on {len(local)} of {len(layer_windows)} layers"


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


def _input_sources(scheduled: list[ScheduledRequest], input_ids: list[int], previous: DeviceTokens | None
                   ) -> tuple[list[int], torch.Tensor]:
    """Per token, the row of ``previous.tokens`` a placeholder input reads (-1 elsewhere); placeholders in
    ``input_ids`` become 0 (patched on the device). Only a decode's one input can be a placeholder."""
    sources = [-1] * len(input_ids)
    offset = 0
    for s in scheduled:
        if input_ids[offset] == PENDING_TOKEN:
            if previous is None or s.request.key not in previous.index_of or s.num_new_tokens != 1:
                raise RuntimeError(f"request {s.request.key}: its input token is still on the device, but not "
                                   "in the previous step's ids")
            sources[offset], input_ids[offset] = previous.index_of[s.request.key], 0
        offset += s.num_new_tokens + len(s.draft)
    if PENDING_TOKEN in input_ids:
        raise RuntimeError("a placeholder token inside a prompt chunk: only a decode reads a token late")
    return sources, previous.tokens


def _is_decode(s: ScheduledRequest) -> bool:
    return s.num_new_tokens == 1 and s.start >= s.request.num_prompt_tokens
