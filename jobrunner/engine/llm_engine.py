"""LLMEngine: add requests, step the continuous batch, collect finished outputs."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from jobrunner.attention.kv_quant import cache_dtype
from jobrunner.engine.adapters import (
    adapter_workspace_bytes,
    check_engine_with_adapters,
    load_adapters_onto,
    record_adapters,
)
from jobrunner.engine.config import EngineConfig
from jobrunner.engine.images import prompt_images
from jobrunner.engine.kv_cache.manager import KVCacheManager
from jobrunner.engine.long_rope import make_long_rope_switch
from jobrunner.engine.memory_plan import (
    MemoryPlan,
    estimate_activation_bytes,
    model_bytes,
    plan_cpu,
    plan_from_numbers,
)
from jobrunner.engine.model_runner import ModelRunner
from jobrunner.engine.parallel.rank import agreed_num_blocks, check_rank_config, check_step, is_parallel, rank_info
from jobrunner.engine.pooling import PoolingParams
from jobrunner.engine.profile_run import profile_step
from jobrunner.engine.prompt_tokens import text_or_chat_token_ids
from jobrunner.engine.readback import LaunchedStep, StepResult, can_read_late, late_readback_on
from jobrunner.engine.request import Request, RequestOutput, RequestStatus
from jobrunner.engine.sampling.logprobs import prompt_logprob_entries
from jobrunner.engine.sampling.noise import derive_seed
from jobrunner.engine.sampling_params import SamplingParams
from jobrunner.engine.scheduler import Scheduler, SchedulerOutput
from jobrunner.engine.speculative import make_speculator
from jobrunner.engine.speculative.draft_model import DraftModel, prepare_draft
from jobrunner.engine.stats import EngineStats
from jobrunner.engine.stopping import finished_output
from jobrunner.engine.vision import ImageEncoder, RequestImages, image_prompt, is_chat_prompt

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


def free_device_memory() -> None:
    """Collect garbage and empty the CUDA cache allocator (a no-op on CPU)."""
    import gc

    gc.collect()
    try:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a device that cannot even free its cache fails the next build
        pass


class LLMEngine:
    """Our continuous-batching engine over one model on one device.

    Build it with :meth:`from_source` (a model alias, local dir, Hub id or fsspec URL) or directly from a loaded
    model and tokenizer. Per-request problems (empty prompt, too long, ...) never raise: the request finishes
    with ``finish_reason="error"`` and the rest of the batch is unaffected. ``chat_template`` (or
    :meth:`set_chat_template`) replaces the tokenizer's chat template for message prompts.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None,
                 eos_token_ids: Sequence[int] = (), model_info: dict[str, Any] | None = None,
                 chat_template: str | None = None, draft: DraftModel | None = None,
                 tensor_parallel: Any = None) -> None:
        self.config = config or EngineConfig()
        self.tp = tensor_parallel  # this rank's TensorParallel (engine/parallel/rank.py), or None: one process
        check_rank_config(self.config, self.tp)
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.eos_token_ids = tuple(eos_token_ids)
        self.model_info = dict(model_info or {})
        self.adapters = model.lora  # LoRA adapters attached to the model (engine/adapters.py), or None
        check_engine_with_adapters(self.adapters, self.config, self.device)
        record_adapters(self.adapters, self.model_info)
        # speculative = a model source: the draft model (loaded here unless given), its KV beside ours
        self.draft = prepare_draft(self.config, model, tokenizer, self.model_info, draft)
        self.memory_plan: MemoryPlan | None = None  # how the memory was shared out (None: num_kv_blocks given)
        num_blocks = agreed_num_blocks(self._num_kv_blocks(), self.tp)  # world > 1: the MIN over ranks
        bs = self.config.block_size
        model_len = self.config.max_model_len or model.shape.max_position_embeddings
        self.max_model_len = min(model_len, model.shape.max_position_embeddings, num_blocks * bs)
        self.kv_manager = KVCacheManager(num_blocks, bs, self.config.enable_prefix_caching)
        self._stats = EngineStats(kv_num_blocks=num_blocks, kv_block_size=bs)
        self.scheduler = Scheduler(self.config, self.kv_manager, make_long_rope_switch(model, self.max_model_len),
                                   tokenizer=tokenizer, max_model_len=self.max_model_len, stats=self._stats)
        self.runner = ModelRunner(model, self.config, num_blocks, self.device, self.max_model_len,
                                  self._decode_graphs_mode())  # deterministic mode chosen there too
        if getattr(model, "is_vision_language", False):  # images in prompts (engine/vision.py)
            self.runner.images = ImageEncoder(model, self._stats)
        if self.tp is not None:
            kv_dtype = cache_dtype(self.config.kv_cache_dtype, model.dtype)
            self.model_info.update(rank_info(self.tp, model_bytes(model),
                                             num_blocks * ModelRunner.bytes_per_block(model, bs, kv_dtype)))
        self._request_ids: dict[str, int] = {}  # request id -> samples not yet handed back
        self._rejected: list[Request] = []
        self._seeds = random.Random(self.config.seed)
        self.chat_template = chat_template
        self._grammars = None  # GrammarCompiler, built on the first structured request
        if self.config.deterministic:
            self.model_info["deterministic"] = True
        self.speculator = make_speculator(self._speculative_mode(), self.config.num_speculative_tokens,
                                          self.config.max_num_seqs, self.max_model_len, self.device.type,
                                          self, num_blocks)
        # the step loop's mode (engine/readback.py): each step read at once, or one step late
        self.late_readback = not is_parallel(self.tp) and late_readback_on(
            self.config.late_readback, self.device, self.speculator is not None)
        self._held: tuple[SchedulerOutput, LaunchedStep] | None = None  # late readback: the step launched, unread

    def _speculative_mode(self) -> str:
        """``auto`` stays off on the fixed-shape (graph) decode path: a draft step leaves it for an eager step,
        a cost the step-cost fit has not been measured on yet (``ngram`` is still honoured); and with tensor
        parallel (its plan follows each rank's own timings: engine/parallel/rank.py)."""
        if self.config.speculative == "auto" and (self.runner.graphs is not None or is_parallel(self.tp)):
            return "off"
        return self.config.speculative

    @classmethod
    def from_source(cls, source: str, dtype: str = "auto", quantization: str = "none",
                    config: EngineConfig | None = None, chat_template: str | None = None,
                    adapters: dict[str, str] | None = None, tensor_parallel: Any = None,
                    **load_options: Any) -> LLMEngine:
        """Load a model (alias, local dir, Hub id or fsspec URL) and build an engine over it.

        ``chat_template``: a Jinja chat template used instead of the tokenizer's own. ``adapters``: PEFT LoRA
        adapters by name (``{name: source}``; sources fetched like the model's), for requests to name.
        ``tensor_parallel``: this rank's ``TensorParallel`` (its shard is loaded). With
        ``config.tensor_parallel_size > 1`` and no group given, the group is started on this machine
        (followers as local processes, :func:`jobrunner.engine.parallel.spawn_local`) and its leader, a
        ``ParallelEngine``, is returned.
        """
        from jobrunner.models.factory import load_for_engine
        from jobrunner.models.stopwatch import Stopwatch

        config = config or EngineConfig()
        if config.tensor_parallel_size > 1 and tensor_parallel is None:
            from jobrunner.engine.parallel.launch import spawn_local

            build = EngineFromSource(source, dtype, quantization, config, chat_template, adapters, load_options)
            return spawn_local(build, config.tensor_parallel_size)
        if is_parallel(tensor_parallel):
            load_options["tensor_parallel"] = tensor_parallel
        model, tokenizer, eos_ids, info = load_for_engine(
            source, dtype=dtype if dtype != "auto" else config.dtype, device=config.device,
            quantization=quantization, max_model_len=config.max_model_len, **load_options)
        clock = Stopwatch()
        if adapters:
            options = {k: load_options[k] for k in ("cache_dir", "storage_options") if k in load_options}
            load_adapters_onto(model, adapters, **options)
            clock.mark("adapters")
        engine = cls(model, tokenizer, config, eos_ids, info, chat_template=chat_template,
                     tensor_parallel=tensor_parallel)
        clock.mark("engine")  # KV cache, attention library (compiled on a machine's first run), draft model
        engine.model_info["load_stages_s"] = {**info.get("load_stages_s", {}), **clock.stages}
        return engine

    # -- requests -------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | PoolingParams | None = None,
                    *, chat_template_kwargs: dict[str, Any] | None = None, adapter: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue one request (``params.n`` samples of it, all answered with this ``request_id``).

        With :class:`~jobrunner.engine.pooling.PoolingParams` the request is prefill-only: it samples nothing
        and its output carries ``pooled`` (an embedding, classification scores or a completion's
        log-likelihood) once its prompt is computed.

        Bad *content* (empty or too long prompt, a broken chat template) never raises: the request finishes
        with ``finish_reason="error"`` on the next ``step``. Raises ``ValueError`` for a duplicate id and for an
        invalid structured-output spec (bad or unsupported JSON schema, bad regex), which the caller turns
        into a per-row error. ``chat_template_kwargs`` go to the tokenizer's ``apply_chat_template`` (e.g.
        ``{"enable_thinking": False}``). ``adapter``: the LoRA adapter the request runs with (a name given at
        load; None or "" is the base model); an unknown name finishes the request with an error naming it.
        ``arrival_time``: when it arrived (``time.perf_counter()``; default now), e.g. when a tensor-parallel
        leader recorded it before the step that sends it.
        """
        if request_id in self._request_ids:
            raise ValueError(f"duplicate request id {request_id!r}")
        pooling = params if isinstance(params, PoolingParams) else None
        params = SamplingParams() if pooling is not None or params is None else params
        grammar_factory = self._grammar_factory(params)  # raises ValueError on a bad spec, before any state
        now = time.perf_counter() if arrival_time is None else arrival_time
        num_prompt_tokens, images = 0, None
        image_error = self._image_error(prompt, params, pooling, adapter)
        try:
            token_ids, images = ([], None) if image_error else self._tokenize_with_images(prompt, chat_template_kwargs)
            num_prompt_tokens = len(token_ids)
            if pooling is not None and pooling.task == "loglik" and pooling.completion:
                token_ids = token_ids + self._completion_ids(pooling.completion)
            error = self._admission_error(token_ids) or self._pooling_error(pooling, num_prompt_tokens)
        except Exception as exc:  # a broken chat template or odd input: that request only
            token_ids, error = [], f"could not tokenize the prompt: {exc}"
        adapter_id, adapter_error = self._adapter_id(adapter)
        error = image_error or adapter_error or error
        samples = self._make_samples(request_id, token_ids, params, now)
        for request in samples:
            request.adapter, request.adapter_id = adapter or None, adapter_id
            _attach_images(request, images)
        if pooling is not None:
            samples[0].make_pooling(pooling, num_prompt_tokens)
        self._request_ids[request_id] = len(samples)
        if not error and params.prompt_logprobs is not None:
            try:
                error = self._attach_prompt_logprobs(samples, token_ids, params.prompt_logprobs)
            except Exception as exc:  # e.g. out of memory scoring one long prompt: that request only
                error = f"could not score the prompt for prompt_logprobs: {exc}"
        if error:
            for request in samples:
                request.status, request.error = RequestStatus.FINISHED_ERROR, error
                request.metrics.finish_time = now
                self._rejected.append(request)
            return
        for request in samples:
            request.grammar = grammar_factory() if grammar_factory is not None else None
        samples[0].siblings = samples[1:]  # forked from sample 0 once its prompt is computed
        self.scheduler.add(samples[0])

    def _image_error(self, prompt: Prompt, params: SamplingParams, pooling: PoolingParams | None,
                     adapter: str | None) -> str | None:
        """Why this engine cannot run a prompt with image parts (None: it has none, or it can)."""
        if not prompt_images(prompt):
            return None
        arch = self.model.shape.architecture
        if not getattr(self.model, "is_vision_language", False):
            name = self.model_info.get("source", arch)
            return (f"model {name!r} ({arch}) is a text-only model and takes no images; use a vision-language model "
                    "(SmolVLM: Idefics3ForConditionalGeneration) or drop the image parts")
        if pooling is not None:
            return f"{arch}: task {pooling.task} with images is not supported yet (generation only)"
        if params.prompt_logprobs is not None:
            return f"{arch}: prompt_logprobs with images is not supported yet (the scoring pass runs no vision encoder)"
        if adapter:
            return f"{arch}: LoRA adapters with images are not supported yet (adapter {adapter!r})"
        if self.draft is not None:
            return f"{arch}: speculative decoding with a draft model is not supported with images (the draft sees none)"
        return None

    def _tokenize_with_images(self, prompt: Prompt, chat_template_kwargs: dict[str, Any] | None
                              ) -> tuple[list[int], RequestImages | None]:
        """Token ids of a prompt and its images (a chat prompt with image parts, on a vision-language model:
        transformers' processor expands each image into its tokens, engine/vision.py; its chat prompts without
        images go through the processor's chat template too)."""
        if getattr(self.model, "is_vision_language", False) and is_chat_prompt(prompt):
            return image_prompt(self.model, prompt, self.chat_template, chat_template_kwargs)
        return self.tokenize(prompt, chat_template_kwargs), None

    def _adapter_id(self, name: str | None) -> tuple[int, str | None]:
        """The id of adapter ``name`` (0: the base model), or an error naming it and the known ones."""
        if not name:
            return 0, None
        if self.adapters is None:
            return 0, f"unknown adapter {name!r}: the model has no adapters (model.adapters)"
        try:
            return self.adapters.id_of(name), None
        except ValueError as exc:
            return 0, str(exc)

    def _completion_ids(self, completion: str | list[int]) -> list[int]:
        """A scored completion's token ids: its text tokenized without special tokens, or ids as given."""
        if isinstance(completion, str):
            return list(self.tokenizer(completion, add_special_tokens=False)["input_ids"])
        return self.tokenize(list(completion))

    def _pooling_error(self, pooling: PoolingParams | None, num_prompt_tokens: int) -> str | None:
        """Why this model cannot serve a prefill-only request, or None."""
        if pooling is None:
            return None
        arch = self.model.shape.architecture
        if pooling.task == "classify" and getattr(self.model, "score", None) is None:
            return (f"task classify needs a sequence-classification head; {arch} has none "
                    "(use a *ForSequenceClassification checkpoint)")
        if pooling.task == "loglik" and getattr(self.model, "lm_head", None) is None:
            return f"log-likelihood scoring needs a language-model head; {arch} has none (use a *ForCausalLM model)"
        if pooling.task == "loglik" and (num_prompt_tokens == 0 or not pooling.completion):
            return "log-likelihood scoring needs a non-empty prompt and a non-empty completion"
        return None

    def set_chat_template(self, template: str | None) -> None:
        """Use this Jinja chat template for message prompts instead of the tokenizer's own (None: the own)."""
        self.chat_template = template

    def _make_samples(self, request_id: str, token_ids: list[int], params: SamplingParams,
                      now: float) -> list[Request]:
        # sample i of a seeded request draws from (seed, i); unseeded requests get a seed from the engine's
        # own stream (EngineConfig.seed), so every row samples through the same counter-based path
        base_seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        return [Request(request_id, token_ids, params, now, self.eos_token_ids, sample_index=i,
                        seed=derive_seed(base_seed, i))
                for i in range(params.n)]

    def tokenize(self, prompt: Prompt, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a prompt exactly as ``add_request`` makes them.

        Raw text gets the tokenizer's special tokens (e.g. BOS); chat messages go through the chat template
        with the generation prompt; token-id lists are checked against the vocabulary.
        """
        if isinstance(prompt, str):
            return text_or_chat_token_ids(self.tokenizer, prompt)
        if getattr(self.model, "is_vision_language", False) and is_chat_prompt(prompt):
            return image_prompt(self.model, prompt, self.chat_template, chat_template_kwargs)[0]
        items = list(prompt)
        if items and isinstance(items[0], dict):
            return text_or_chat_token_ids(self.tokenizer, items, self.chat_template, chat_template_kwargs)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise ValueError("prompt must be a string, a list of token ids, or a list of chat messages")
        vocab = self.model.shape.vocab_size
        bad = [t for t in items if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab})")
        return items

    def prompt_logprobs(self, prompt: Prompt, adapter: str | None = None) -> list[float]:
        """Log-probability of each prompt token given the tokens before it (``len(tokens) - 1`` values), with
        LoRA adapter ``adapter`` (None: the base model).

        Runs one causal prefill over a private KV buffer (``jobrunner.engine.scoring``): it does not touch
        the KV pool, so it may be called between steps while requests are running.
        """
        from jobrunner.engine.scoring import sequence_logits

        token_ids = self.tokenize(prompt)
        limit = self.model.rotary.max_positions  # the positions this model was built for (<= its config's)
        if len(token_ids) > limit:
            raise ValueError(f"prompt has {len(token_ids)} tokens; the model context is {limit}")
        adapter_id, error = self._adapter_id(adapter)
        if error:
            raise ValueError(error)
        logits = sequence_logits(self.model, token_ids, adapter_id, self.runner.kv_cache_dtype)[:-1]
        targets = torch.tensor(token_ids[1:], device=logits.device)
        return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1).tolist()

    def _grammar_factory(self, params: SamplingParams):
        """A maker of per-sample grammar matchers, or None; ValueError if the spec is bad or unsupported."""
        if not params.is_structured:
            return None
        if self._grammars is None:
            from jobrunner.engine.sampling.structured import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.model.shape.vocab_size, self.eos_token_ids)
        return self._grammars.factory(params)

    def _attach_prompt_logprobs(self, samples: list[Request], token_ids: list[int], k: int) -> str | None:
        """Score the prompt once (a private causal pass, engine/scoring.py); every sample shares the entries."""
        from jobrunner.engine.scoring import sequence_logits

        if len(token_ids) > self.model.rotary.max_positions:
            return f"prompt has {len(token_ids)} tokens; too long to score for prompt_logprobs"
        logits = sequence_logits(self.model, token_ids, samples[0].adapter_id, self.runner.kv_cache_dtype)
        entries = prompt_logprob_entries(logits, token_ids, k)
        values = [None if e is None else self.scheduler.token_texts.entry(e) for e in entries]
        for request in samples:
            request.prompt_logprobs = values
        return None

    def _admission_error(self, token_ids: list[int]) -> str | None:
        if not token_ids:
            return "prompt is empty"
        if len(token_ids) >= self.max_model_len:
            return (f"prompt has {len(token_ids)} tokens; the limit is {self.max_model_len - 1} "
                    f"(max_model_len {self.max_model_len}, set by the model context and the KV cache size)")
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.num_unfinished or self._rejected)

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished + len(self._rejected)

    @property
    def block_size(self) -> int:
        """KV cache block size in tokens."""
        return self.config.block_size

    # -- after a failure (the worker engine contract: engine/contract.py) -------------------------------------

    def rebuild(self) -> LLMEngine:
        """A fresh engine over the weights (and draft model) this one holds: empty queues, a new KV cache.
        This engine's KV cache and runner are let go first; it is not used afterwards."""
        args = (self.model, self.tokenizer, self.config, self.eos_token_ids, self.model_info)
        draft = self.draft
        self.close()
        return LLMEngine(*args, chat_template=self.chat_template, draft=draft, tensor_parallel=self.tp)

    def close(self) -> None:
        """Drop the KV cache, runner, scheduler and speculator (and free the device's cached memory); the
        model, tokenizer and draft model stay with whoever holds them."""
        self.runner = self.kv_manager = self.scheduler = self.speculator = self._held = None
        free_device_memory()

    # -- the loop ----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the outputs of the requests that finished in the step it read.

        Synchronous mode reads each step as soon as it is launched. With late readback (``late_readback``,
        chosen at construction; engine/readback.py lists the order) the step launched here is read by the next
        call, which launches its own first: the host's work on one step overlaps the device's on the next.
        """
        finished = self._rejected_outputs()
        if self.speculator is not None:  # drafts for decoding requests (speculative/); the scheduler reads them
            self.speculator.propose(self.scheduler.running, len(self.scheduler.waiting))
        if self._held is not None and (self.scheduler.may_preempt()
                                       or (self.config.late_readback_strict and self.scheduler.waiting)):
            finished += self._read_held()  # a step that may preempt (or admit, strict) sees every token first
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        check_step(sched, self.tp)  # tensor parallel: every rank scheduled the same step, or all raise
        if sched.is_empty:
            finished += self._read_held()
            self._record_kv_usage()
            return finished
        t1 = time.perf_counter()
        launched = self.runner.launch(sched, self._held[1].device_tokens if self._held is not None else None)
        sched.advance()
        finished += self._read_held()
        result = self._read_or_hold(sched, launched)
        t2 = time.perf_counter()
        self._stats.schedule_s += t1 - t0
        self._stats.record_step(t2 - t1, launched.num_prefill_tokens, launched.num_decode_tokens)
        self._stats.num_fixed_shape_steps += launched.fixed_shape
        if self.speculator is not None:
            self.speculator.observe_step(launched.num_prefill_tokens, launched.num_decode_tokens, t2 - t1)
        if result is not None:
            finished += self._update(sched, result, t2)
        if self.speculator is not None:  # finished / preempted requests give back their draft-model KV
            self.speculator.settle(self.scheduler.running)
        self._record_kv_usage()
        return finished

    def _read_or_hold(self, sched: SchedulerOutput, launched: LaunchedStep) -> StepResult | None:
        """The step's result now, or None: held to be read by the next step (late readback, when every row may
        wait), or nothing left to read (every row ended with the step before)."""
        if not self.late_readback:
            return launched.read()
        if all(s.request.is_finished for s in sched.scheduled):
            self._stats.num_late_discarded_tokens += len(launched.requests)
            return None
        if not all(can_read_late(s.request) for s in sched.scheduled):
            return launched.read()
        self.scheduler.hold(sched)
        self._held = (sched, launched)
        self._stats.num_late_steps += 1
        return None

    def _read_held(self) -> list[RequestOutput]:
        """Read the held step, if any; the outputs of the requests it finished."""
        if self._held is None:
            return []
        sched, launched = self._held
        self._held = None
        result = launched.read()
        return self._update(sched, result, time.perf_counter())

    def _update(self, sched: SchedulerOutput, result: StepResult, now: float) -> list[RequestOutput]:
        """The scheduler takes the step's output; the runner forgets the finished rows; outputs handed back."""
        if result.speculative:
            self._record_drafts(sched, result)
        finished = self.scheduler.update_from_output(sched, result, now)
        for out in finished:
            self.runner.release((out.request_id, out.sample_index))
            self._hand_back(out)
        return finished

    def _record_kv_usage(self) -> None:
        used = self.kv_manager.pool.num_used_blocks
        self._stats.kv_blocks_used = used
        self._stats.kv_peak_blocks_used = max(self._stats.kv_peak_blocks_used, used)

    def _record_drafts(self, sched: SchedulerOutput, result: StepResult) -> None:
        for s in sched.scheduled:
            verified = result.speculative.get(s.request.key)
            if verified is not None:
                self.speculator.record(s.request, verified)
                self._stats.num_draft_tokens += verified.num_drafted
                self._stats.num_accepted_tokens += verified.num_accepted
                self._stats.num_speculative_rows += 1

    def _rejected_outputs(self) -> list[RequestOutput]:
        """The outputs of requests refused when added (they never reached the scheduler)."""
        finished = [finished_output(r, self.tokenizer, None) for r in self._rejected]
        self._rejected = []
        for out in finished:
            self._hand_back(out)
        return finished

    def _hand_back(self, out: RequestOutput) -> None:
        """One sample of a request is out: one fewer to wait for under its id; the counters take it."""
        left = self._request_ids[out.request_id] - 1
        if left:
            self._request_ids[out.request_id] = left
        else:
            del self._request_ids[out.request_id]
        self._count(out)

    def _count(self, out: RequestOutput) -> None:
        st, m = self._stats, out.metrics
        st.num_requests += 1
        if not m.prompt_shared:  # a forked sample's prompt is counted once, with sample 0
            st.num_prompt_tokens += m.num_prompt_tokens
            st.num_cached_tokens += m.num_cached_tokens
            st.num_images += m.num_images
            st.num_image_tokens += m.num_image_tokens
        st.num_output_tokens += m.num_output_tokens
        st.num_preemptions += m.num_preemptions
        st.num_errors += out.finish_reason == "error"

    def stats(self) -> EngineStats:
        """Counters since the engine started (a live object; copy ``to_dict()`` to keep a snapshot)."""
        return self._stats

    def check_integrity(self) -> None:
        """Raise if the KV bookkeeping is inconsistent (for tests, after every step)."""
        # forked samples hold their shared prompt blocks while they wait
        self.kv_manager.check_integrity(self.scheduler.running + list(self.scheduler.waiting))

    # -- convenience -------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts (texts, token-id lists or chat message lists) to completion; outputs in input order.

        A prompt whose params have ``n = k`` contributes k outputs in a row (sample_index 0..k-1).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = [f"gen-{id(prompts)}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params):
            self.add_request(request_id, prompt, p)
        outputs = {}
        bar = _progress(sum(self._request_ids[i] for i in ids)) if use_tqdm else None
        while self.has_unfinished_requests():
            for out in self.step():
                outputs[(out.request_id, out.sample_index)] = out
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        order = {request_id: i for i, request_id in enumerate(ids)}
        return [outputs[key] for key in sorted(outputs, key=lambda key: (order[key[0]], key[1]))]

    def _decode_graphs_mode(self) -> str:
        if self.adapters is not None:  # each step's per-adapter row groups: eager steps only (engine/adapters.py)
            return "off"
        if self.config.graphs_on(self.device.type):
            if getattr(self.model.shape, "moe", None) is not None:
                raise ValueError("engine.use_cuda_graphs is not supported for mixture-of-experts models: their "
                                 "expert grouping reads per-expert token counts on the host every step, which a "
                                 "CUDA graph cannot capture; run them with use_cuda_graphs: false")
            return "cuda"
        return "static" if self.config.static_decode else "off"

    def _num_kv_blocks(self) -> int:
        """Blocks for the KV cache, from the memory plan (engine/memory_plan.py), recorded in model_info."""
        cfg = self.config
        dtype = cache_dtype(cfg.kv_cache_dtype, self.model.dtype)  # fp8: about half the bytes, so ~2x the blocks
        per_block = ModelRunner.bytes_per_block(self.model, cfg.block_size, dtype)
        if self.draft is not None:  # every block has a draft-model block beside it: the budget holds both
            per_block += self.draft.kv_bytes_per_block(cfg.block_size)
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        plan = self._cuda_memory_plan(per_block) if self.device.type == "cuda" else plan_cpu(
            weights_bytes=model_bytes(self.model), activations_bytes=self._activation_estimate(cfg.max_num_seqs),
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes, kv_bytes_per_block=per_block)
        self.memory_plan = plan
        self.model_info.update(plan.to_info())
        return plan.num_kv_blocks

    def _activation_estimate(self, num_seqs: int, num_tokens: int | None = None) -> int:
        s = self.model.shape
        return estimate_activation_bytes(s, num_tokens or self.config.max_num_batched_tokens, num_seqs,
                                         torch.empty(0, dtype=self.model.dtype).element_size())

    def _cuda_memory_plan(self, per_block: int) -> MemoryPlan:
        """Weights as allocated, one profile step's peak, the graphs' pool (estimated as one decode step at
        ``max_num_seqs`` rows), then the KV cache from ``gpu_memory_utilization`` x share x the card's total."""
        cfg = self.config
        free_device_memory()  # the load's freed blocks (a quantized layer's float copy) back to the card
        weights = torch.cuda.memory_allocated(self.device)
        shape = self.model.shape
        model_len = min(cfg.max_model_len or shape.max_position_embeddings, shape.max_position_embeddings)
        activations = profile_step(self.model, cfg, self.device, model_len).peak_bytes
        free_device_memory()  # the profile step's cache and activations: not held by anyone now
        graphs = self._activation_estimate(cfg.max_num_seqs, cfg.max_num_seqs) \
            if self._decode_graphs_mode() == "cuda" else 0
        free, total = torch.cuda.mem_get_info(self.device)
        return plan_from_numbers(
            device=str(self.device), total_bytes=total, free_bytes=free, utilization=cfg.gpu_memory_utilization,
            share=cfg.gpu_share, weights_bytes=weights, activations_bytes=activations, graphs_bytes=graphs,
            kv_bytes_per_block=per_block,  # the adapters' weights are allocated already: in `weights`
            other_bytes=adapter_workspace_bytes(self.adapters, self.model, cfg.max_num_batched_tokens))


@dataclass(frozen=True)
class EngineFromSource:
    """A picklable rank builder (``jobrunner.engine.parallel.spawn_local``): ``LLMEngine.from_source(source,
    ..., tensor_parallel=tp)`` with this rank's group."""

    source: str
    dtype: str = "auto"
    quantization: str = "none"
    config: EngineConfig | None = None
    chat_template: str | None = None
    adapters: dict[str, str] | None = None
    load_options: dict[str, Any] = field(default_factory=dict)

    def __call__(self, tp: Any) -> LLMEngine:
        return LLMEngine.from_source(self.source, self.dtype, self.quantization, self.config, self.chat_template,
                                     self.adapters, tensor_parallel=tp, **self.load_options)


def _attach_images(request: Request, images: RequestImages | None) -> None:
    """Give a sample its prompt's images (shared by the n samples) and their counts in its metrics."""
    request.images = images
    if images is not None:
        request.metrics.num_images, request.metrics.num_image_tokens = images.num_images, images.num_image_tokens


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
