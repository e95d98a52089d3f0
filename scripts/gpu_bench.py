"""Throughput of our engine on a Llama-3-8B-shaped model with random bf16 weights (no weights, no tokenizer).

Builds OUR model directly on the device (``jobrunner.models.loader.build_model``), fills it with N(0, 0.02)
weights and unit norms, and runs random token-id prompts through ``LLMEngine`` (greedy). Output lengths are
drawn at random (uniform in ``[1, --output-len]``, seeded) and reached through ``max_tokens`` (random weights
make EOS meaningless). Each run is ``[quantization:]backend[+graphs][+fp8kv]`` — e.g. ``torch``, ``triton+graphs``,
``fp8:triton+graphs``, ``int8:triton+graphs``, ``int4:triton+graphs`` (the engine's quantization names),
``triton+graphs+fp8kv`` (``engine.kv_cache_dtype: fp8_e4m3``: half the KV bytes a decode step reads) —
or ``hf`` (the same workload through transformers' continuous-batching ``generate_batch`` on an HF model
with random weights) or ``parity`` (32 greedy tokens at head_dim 128 against transformers, bf16 then float32,
each token's logprob also compared teacher-forced with transformers' (``max_logprob_diff_teacher_forced``),
for torch/triton attention with and without CUDA graphs; ``rows_full_match`` is the share of rows equal to
transformers' on every token) or ``quant-kernels`` (scripts/gpu_quant_bench.py: quantized linears per layer
shape and batch; opt-in Triton paths included; engine runs use them with ``JOBRUNNER_TRITON_QUANT=1`` in the
environment) or ``decode-ab`` (scripts/gpu_decode_ab.py: split-K decode attention and one-step-late readback,
each off and on, kernel and engine; reported, not judged). ``scripts/gpu_check_verdict.py`` judges these numbers.
Every run gets a fresh
model and a share of the wall-clock budget; a run past its deadline stops early and is marked
``timed_out``. A run's share counts from the end of its set-up (model build, quantization, graph capture,
warm-up: reported apart as ``setup_s``), so a slow set-up never leaves the timed loop without time; parity
runs bf16 (the judged dtype) before float32. A run's failure (a kernel error, an fp8 GEMM the device refuses)
is recorded and the next run still goes. Results go to stdout and to ``--out`` (default
``$OUT/gpu_bench.json``), rewritten after every run.

Decode roofline: the floor of a decode step is the larger of its bytes (every weight once, each row's KV cache)
over the device's memory bandwidth and its FLOPs over its bf16 GEMM rate, both measured at the start of the
call (``ceilings``), at the rows a decode step really had (decode tokens / steps: the batch drains) and the
run's mean context; ``roofline`` says which term binds, ``roofline_share`` = measured decode tokens/s ÷ the
tokens/s at that floor.

    PYTHONPATH=. python scripts/gpu_bench.py                      # the H200 run
    PYTHONPATH=. python scripts/gpu_bench.py --device cpu --tiny  # a smoke check anywhere
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import time
import traceback
from typing import Any

import torch

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192)
PARITY = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,  # head_dim 128
              intermediate_size=1024, vocab_size=1024, max_position_embeddings=1024)
PARITY_COMBOS = (("torch", False), ("torch", True), ("triton", False), ("triton", True))
PARITY_TOKENS = 32
PARITY_DTYPES = (torch.bfloat16, torch.float32)
STEADY_MARGIN_TOKENS = 64  # room for the tokens rows decode while the others are still prefilling
MIN_TIMED_S = 10.0  # a run's timed loop gets at least this long, even when its set-up ran past its share
# the core phase answers what decides defaults (parity, the bf16 graphs run, eager) in a few minutes of device
# time; the extra phase (transformers, quantized schemes, kernel A/B) runs in a later call if time is left
# parity is a correctness check: scripts/gpu_check.sh runs it as a stage of its own (``--runs parity``), under a
# fixed cap and no timing deadline, so that a slow timed run can never leave it "incomplete"
CORE_RUNS = "triton+graphs,torch"
EXTRA_RUNS = ("hf,triton+graphs+fp8kv,fp8:triton+graphs,int8:triton+graphs,int4:triton+graphs,quant-kernels,"
              "decode-ab")
RUN_SETS = {"core": CORE_RUNS, "extra": EXTRA_RUNS, "all": f"parity,{CORE_RUNS},{EXTRA_RUNS}"}
DEFAULT_RUNS = "all"
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, max_position_embeddings=1024)


class IdsOnlyTokenizer:
    """Stand-in tokenizer: the engine only calls ``decode`` for token-id prompts (``final_text``)."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)

    def __call__(self, text: str, **kwargs: Any) -> dict[str, list[int]]:
        raise ValueError("IdsOnlyTokenizer takes token-id prompts only")


def make_config(tiny: bool, shape: dict | None = None):
    """A Llama-3-8B-shaped (or tiny, or ``shape``) ``LlamaConfig`` with llama3 rope scaling."""
    import transformers
    from transformers import LlamaConfig

    shape = shape or (TINY if tiny else LLAMA3_8B)
    rope = dict(LLAMA3_ROPE, original_max_position_embeddings=256 if tiny else 8192)
    if int(transformers.__version__.split(".")[0]) >= 5:
        rope_kwargs: dict[str, Any] = {"rope_parameters": rope}
    else:
        rope_kwargs = {"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"},
                       "rope_theta": rope["rope_theta"]}
    return LlamaConfig(**shape, **rope_kwargs, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)


def build_random_model(config, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Our model on ``device``: matrices ~ N(0, 0.02), 1-D parameters (norms) = 1."""
    from jobrunner.models.loader import build_model

    torch.manual_seed(seed)
    model = build_model(config, dtype, device)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    return model


class RandomCheckpoint:
    """A random checkpoint of ``config`` in Hugging Face's tensor names, made on ``device`` one tensor at a time
    as the loader reads it (matrices ~ N(0, 0.02), 1-D parameters = 1): what a real model's safetensors shards
    give the streamed loader, without weights on disk. It names its tensors up front (:meth:`names`, from
    transformers' model built on ``meta``), so quantize-at-load quantizes each layer as soon as it is complete."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            reference = LlamaForCausalLM(config)
        self.shapes = {name: tuple(t.shape) for name, t in reference.state_dict().items()}
        self.dtype, self.device, self.seed = dtype, device, seed

    def names(self) -> list[str]:
        return list(self.shapes)

    def __iter__(self):
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        for name, shape in self.shapes.items():
            tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
            if len(shape) == 1:
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, 0.02, generator=generator)
            yield name, tensor


def load_random_model(config, dtype: torch.dtype, device: torch.device, quant: str = "none", seed: int = 0):
    """Our model through the job's load path: built on ``meta`` in ``dtype``, each parameter made on the device
    as the (random) checkpoint streams in, quantized layer by layer at load unless ``quant`` is none (the float
    model never whole on the device). Returns ``(model, quant report or None)``."""
    from jobrunner.models.loader import build_model, load_weights

    model = build_model(config, dtype, device, materialize=False)
    transform = None
    if quant != "none":
        from jobrunner.quant.at_load import QuantizeAtLoad

        transform = QuantizeAtLoad(model, quant, device)
    load_weights(model, RandomCheckpoint(config, dtype, device, seed), device=device, transform=transform)
    return model, (transform.report if transform is not None else None)


def load_memory(model, device: torch.device) -> dict[str, Any]:
    """The model's weight bytes and the peak memory its build took (CUDA: max allocated since the reset before
    the build; a float32 detour would show as ~2x the weights), with their ratio."""
    from jobrunner.bench.result import peak_memory

    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    peak = peak_memory(device)
    out: dict[str, Any] = {"weights_mib": round(weights / 2**20, 1), **peak}
    if peak.get("cuda_max_allocated_mib"):
        out["peak_over_weights"] = round(peak["cuda_max_allocated_mib"] * 2**20 / max(weights, 1), 3)
    return out


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def output_lengths(n: int, max_len: int, seed: int = 1) -> list[int]:
    """Per-request output lengths, uniform in [1, max_len]."""
    rng = random.Random(seed)
    return [rng.randint(1, max_len) for _ in range(n)]


class RunBudget:
    """One run's share of the bench's wall-clock budget: ``share_s`` for its timed part, counted from the moment
    its set-up (model build, quantization, graph capture, warm-up) ends, and never past the bench's ``end``
    (except for MIN_TIMED_S, so a slow set-up still measures something)."""

    def __init__(self, share_s: float, end: float) -> None:
        self.share_s, self.end = share_s, end

    def timed_deadline(self) -> float:
        now = time.perf_counter()
        return max(now + MIN_TIMED_S, min(now + self.share_s, self.end))


def timed_run(engine, prompts: list[list[int]], lengths: list[int], deadline: float) -> dict[str, Any]:
    """Add every prompt, step until done or ``deadline`` (perf_counter); counters of what finished."""
    from jobrunner.bench.result import sync
    from jobrunner.engine import SamplingParams

    before = dict(engine.stats().to_dict())
    sync(engine.device)
    start = time.perf_counter()
    for i, (ids, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(f"b{i}", ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests() and time.perf_counter() < deadline:
        outputs += engine.step()
    sync(engine.device)
    seconds = time.perf_counter() - start
    after = engine.stats().to_dict()
    delta = {k: after[k] - before[k] for k in ("steps", "num_fixed_shape_steps", "prefill_s", "decode_s",
                                               "schedule_s", "num_prefill_tokens", "num_decode_tokens",
                                               "num_preemptions")}
    # Tokens actually computed (also by unfinished requests when the deadline hit):
    out_tok = delta["num_decode_tokens"] + sum(1 for o in outputs if o.output_token_ids)
    errors = [o.error for o in outputs if o.finish_reason == "error"]
    return {"seconds": round(seconds, 3), "timed_out": engine.has_unfinished_requests(), "finished": len(outputs),
            "num_output_tokens_finished": sum(len(o.output_token_ids) for o in outputs),
            "num_output_tokens_computed": out_tok,
            "output_tokens_per_s": round(out_tok / seconds, 1),
            "total_tokens_per_s": round((delta["num_prefill_tokens"] + delta["num_decode_tokens"]) / seconds, 1),
            "decode_tokens_per_s": round(delta["num_decode_tokens"] / delta["decode_s"], 1)
            if delta["decode_s"] else None,
            "num_errors": len(errors), "first_error": errors[0] if errors else None,
            "kv_num_blocks": after["kv_num_blocks"], "kv_peak_blocks_used": after["kv_peak_blocks_used"],
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in delta.items()}}


def measure_ceilings(device: torch.device, tiny: bool = False) -> dict[str, Any]:
    """This device's two ceilings, measured in this call (best of a few): memory bandwidth from a large copy
    (bytes read + written / time) and bf16 GEMM rate from a square matmul. The roofline divides by these, not
    by a data-sheet number."""
    from jobrunner.bench.result import sync

    n_bytes = (64 if tiny else 2048) * 2**20
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    size = 256 if tiny else 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    best_copy = best_mm = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best_copy = min(best_copy, time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        best_mm = min(best_mm, time.perf_counter() - t0)
    del src, dst, a, b
    return {"bytes_per_s": 2 * n_bytes / best_copy, "bf16_flop_per_s": 2 * size ** 3 / best_mm,
            "copy_bytes": n_bytes, "gemm_size": size}


def steady_decode(engine, prompts: list[list[int]], steps: int, deadline: float) -> dict[str, Any]:
    """``steps`` decode steps at a fixed batch: every prompt is added and prefilled first (untimed), then the
    steps are timed while no row finishes (max_tokens leaves room for the prefill phase's tokens), then the rest
    drains untimed. The rows and the mean context the timed steps had are reported for the roofline."""
    from jobrunner.bench.result import sync
    from jobrunner.engine import SamplingParams

    params = SamplingParams(max_tokens=steps + STEADY_MARGIN_TOKENS, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"s{i}", ids, params)
    prefill_steps = 0
    while time.perf_counter() < deadline:  # until a step computes no prompt token: every row is decoding
        before = engine.stats().num_prefill_tokens
        engine.step()
        prefill_steps += 1
        if engine.stats().num_prefill_tokens == before:
            break
    before = engine.stats().to_dict()
    sync(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    seconds = time.perf_counter() - start
    after = engine.stats().to_dict()
    while engine.has_unfinished_requests():  # drain, untimed
        engine.step()
    decode_tokens = after["num_decode_tokens"] - before["num_decode_tokens"]
    rows = decode_tokens / steps
    generated_before = before["num_decode_tokens"] / max(len(prompts), 1)
    return {"mode": "steady", "steady_steps": steps, "prefill_steps": prefill_steps, "seconds": round(seconds, 4),
            "step_ms": round(seconds / steps * 1e3, 3), "rows": rows,
            "prefill_in_timed_steps": after["num_prefill_tokens"] - before["num_prefill_tokens"],
            "num_decode_tokens": decode_tokens, "steps": steps,
            "decode_tokens_per_s": round(decode_tokens / seconds, 1),
            "output_tokens_per_s": round(decode_tokens / seconds, 1),
            "mean_context": sum(map(len, prompts)) / len(prompts) + generated_before + steps / 2,
            "num_fixed_shape_steps": after["num_fixed_shape_steps"] - before["num_fixed_shape_steps"],
            "timed_out": time.perf_counter() > deadline}


def decode_roofline(model, rows: float, mean_context: float, ceilings: dict[str, Any],
                    kv_cache_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The floor of one decode step of ``rows`` rows at ``mean_context`` tokens: the larger of its bytes (every
    weight once, each row's KV in a cache of ``kv_cache_dtype``, default the model's) over the measured bandwidth
    and its FLOPs (2 per weight per row, plus attention's 4 per key per head dim) over the measured GEMM rate;
    which of the two binds; tokens/s at it."""
    from jobrunner.attention.kv_quant import kv_bytes_per_block

    s = model.shape
    weight_bytes = weight_count = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "embed_tokens" in name or "rotary" in name:  # the embedding is looked up, not read whole
            continue
        weight_bytes += t.numel() * t.element_size()
        weight_count += t.numel() if t.dim() >= 2 else 0
    if s.tie_word_embeddings:
        weight_bytes += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
        weight_count += model.lm_head.weight.numel()
    kv_per_token = kv_bytes_per_block(s.num_layers, s.num_kv_heads, s.head_dim, 1, kv_cache_dtype or model.dtype)
    step_bytes = weight_bytes + rows * mean_context * kv_per_token
    step_flops = 2 * weight_count * rows + 4 * rows * mean_context * s.num_heads * s.head_dim * s.num_layers
    bytes_s, flops_s = step_bytes / ceilings["bytes_per_s"], step_flops / ceilings["bf16_flop_per_s"]
    step_s = max(bytes_s, flops_s)
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token, "rows": round(rows, 1),
            "mean_context": round(mean_context, 1), "step_bytes": step_bytes, "step_flops": step_flops,
            "bytes_s": bytes_s, "flops_s": flops_s, "binding": "bytes" if bytes_s >= flops_s else "flops",
            "min_step_s": step_s, "roofline_decode_tokens_per_s": round(rows / step_s, 1),
            "bytes_per_s": ceilings["bytes_per_s"], "bf16_flop_per_s": ceilings["bf16_flop_per_s"]}


def parse_run(run: str) -> tuple[str, str, bool, str]:
    """``[quant:]backend[+graphs][+fp8kv]`` -> (quantization, attention backend, CUDA graphs, KV-cache dtype)."""
    quant, _, rest = run.rpartition(":")
    backend, *flags = rest.split("+")
    known = set(flags) <= {"graphs", "fp8kv"} and len(set(flags)) == len(flags)
    if backend not in ("torch", "triton", "auto") or not known:
        raise ValueError(f"run {run!r}: expected [quant:](torch|triton|auto)[+graphs][+fp8kv] or hf")
    return quant or "none", backend, "graphs" in flags, "fp8_e4m3" if "fp8kv" in flags else "auto"


def run_engine(run: str, args: argparse.Namespace, budget: RunBudget) -> dict[str, Any]:
    """Build, quantize (unless ``none``), warm up, time one run; always free the model afterwards. The timed
    loop gets its share of the budget from the moment set-up ends (set-up reported apart, as ``setup_s``)."""
    from jobrunner.bench.result import peak_memory, reset_peak_memory, sync
    from jobrunner.engine import EngineConfig, SamplingParams
    from jobrunner.engine.llm_engine import LLMEngine

    device = torch.device(args.device)
    quant, backend, graphs, kv_dtype = parse_run(run)
    result: dict[str, Any] = {"run": run, "quantization": quant, "attention_backend": backend, "cuda_graphs": graphs,
                              "kv_cache_dtype": kv_dtype}
    setup_start = t0 = time.perf_counter()
    reset_peak_memory(device)
    model, report = load_random_model(make_config(args.tiny), torch.bfloat16, device, quant)  # quantized at load
    sync(device)
    result["build_s"] = round(time.perf_counter() - t0, 2)
    result["load_memory"] = load_memory(model, device)
    if report is not None:
        result["quant_summary"] = report.summary()
    reset_peak_memory(device)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_prefix_caching=False, device=str(device), use_cuda_graphs=graphs,
                          attention_backend=backend, kv_cache_dtype=kv_dtype,
                          # steady mode: one token per row per step, the roofline's unit (no speculation)
                          **({"speculative": "off"} if args.steady_steps else {}),
                          kv_cache_memory_bytes=256 * 2**20 if device.type == "cpu" else None)
    t0 = time.perf_counter()
    engine = LLMEngine(model, IdsOnlyTokenizer(), config, eos_token_ids=[])   # on CUDA: every graph captured here
    result["engine_build_s"] = round(time.perf_counter() - t0, 2)
    vocab = model.shape.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    lengths = output_lengths(args.num_prompts, args.output_len)
    # warm-up on the run's own shapes (kernels compiled and autotuned; the graphs were captured at build)
    t0 = time.perf_counter()
    warm = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate(random_prompts(args.num_prompts, args.input_len, vocab, seed=7), warm)
    result["warmup_s"] = round(time.perf_counter() - t0, 2)
    result["setup_s"] = round(time.perf_counter() - setup_start, 2)
    if args.steady_steps:  # decode steps at a fixed batch (the core phase: graphs vs eager, the roofline)
        result.update(steady_decode(engine, prompts, args.steady_steps, budget.timed_deadline()))
        rows, context = result["rows"], result["mean_context"]
    else:
        result.update(timed_run(engine, prompts, lengths, budget.timed_deadline()))
        # the rows a decode step really had (the batch drains as requests finish), not the configured maximum
        rows = result["num_decode_tokens"] / max(result["steps"], 1)
        context = args.input_len + sum(lengths) / len(lengths) / 2
    roof = decode_roofline(model, rows, context, args.ceilings, engine.runner.kv_cache_dtype)
    result["roofline"] = roof
    if result.get("decode_tokens_per_s"):
        result["roofline_share"] = float(f"{result['decode_tokens_per_s'] / roof['roofline_decode_tokens_per_s']:.4g}")
    result["memory"] = peak_memory(device)
    result["runner"] = engine.runner.stats()
    del engine, model
    _free(device)
    return result


def run_quant_kernels(args: argparse.Namespace, budget: RunBudget) -> dict[str, Any]:
    """scripts/gpu_quant_bench.py (quantized linears: bf16 vs fp8 / int8 / int4, torch vs Triton paths),
    also written to its own ``$OUT/gpu_quant_bench.json``; see that script's docstring for the keys."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_quant_bench.py")
    spec = importlib.util.spec_from_file_location("gpu_quant_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = os.path.join(os.path.dirname(os.path.abspath(args.out)), "gpu_quant_bench.json")
    argv = ["--device", args.device, "--out", out] + (["--tiny"] if args.tiny else [])
    module.main(argv)
    with open(out) as f:
        return {"run": "quant-kernels", **json.load(f)}


def run_decode_ab(args: argparse.Namespace, budget: RunBudget) -> dict[str, Any]:
    """scripts/gpu_decode_ab.py: split-K decode attention and one-step-late readback, off vs on (reported)."""
    import importlib.util
    from types import SimpleNamespace

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_decode_ab.py")
    spec = importlib.util.spec_from_file_location("gpu_decode_ab", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bench = SimpleNamespace(LLAMA3_8B=LLAMA3_8B, build_random_model=build_random_model, make_config=make_config,
                            random_prompts=random_prompts, IdsOnlyTokenizer=IdsOnlyTokenizer)
    return module.run(args, budget.timed_deadline(), bench)


def run_parity(args: argparse.Namespace, budget: RunBudget) -> dict[str, Any]:
    """Greedy tokens at head_dim 128: each (attention backend, CUDA graphs) combination vs transformers.

    A 2-layer random model with large weights (sharp logits), 8 prompts of 64 tokens, 32 greedy tokens each,
    in float32 (every combination should match transformers token for token) and bfloat16 (rounding makes
    a random model drift after a few tokens, so compare the combinations with each other there). Reports the
    share of prompts whose first token matches transformers', the mean matching prefix, the share of
    matching positions.
    """
    from transformers import LlamaForCausalLM

    device = torch.device(args.device)
    config = make_config(True, PARITY)
    torch.manual_seed(0)
    master = LlamaForCausalLM(config).eval()  # float32, on the CPU: each dtype's reference is cast from it
    with torch.no_grad():
        for p in master.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    # --tiny (the CPU smoke): two prompts, 8 tokens, torch eager only (off CUDA the other three combinations
    # fall back to it): the code path is run, the verdict judges nothing in that mode
    num_prompts, max_new, combos = (2, 8, PARITY_COMBOS[:1]) if args.tiny else (8, PARITY_TOKENS, PARITY_COMBOS)
    prompts = random_prompts(num_prompts, 64, config.vocab_size, seed=3)
    result: dict[str, Any] = {"run": "parity", "head_dim": 128, "max_new_tokens": max_new,
                              "num_combinations": len(combos)}
    deadline = float("inf")  # correctness, not timing: every combination runs (the caller caps the process)
    for dtype in PARITY_DTYPES:  # bf16 first: it is the judged one
        hf = reference_model(master, device, dtype)
        result[str(dtype).replace("torch.", "")] = _parity_one(hf, config, prompts, dtype, device, deadline,
                                                               max_new, combos)
        del hf
    _free(device)
    return result


def reference_model(master, device: torch.device, dtype: torch.dtype):
    """A copy of the float32 transformers model ``master`` on ``device``, parameters in ``dtype``, rope buffers
    kept in float32 (:func:`jobrunner.bench.hf_baseline.cast_keeping_buffers`)."""
    import copy

    from jobrunner.bench.hf_baseline import cast_keeping_buffers

    return cast_keeping_buffers(copy.deepcopy(master), device, dtype)


def _parity_one(hf, config, prompts: list[list[int]], dtype: torch.dtype, device: torch.device,
                deadline: float, max_new: int = PARITY_TOKENS,
                runs: tuple[tuple[str, bool], ...] = PARITY_COMBOS) -> dict[str, Any]:
    from jobrunner.engine import EngineConfig, SamplingParams
    from jobrunner.engine.llm_engine import LLMEngine
    from jobrunner.models.loader import build_model, load_weights

    reference = []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        reference.append(out[0, len(ids):].tolist())
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True, logprobs=0)
    combos: dict[str, Any] = {}
    for backend, graphs in runs:
        if time.perf_counter() > deadline:
            break
        model = build_model(config, dtype, device)
        load_weights(model, hf.state_dict().items())
        engine = LLMEngine(model, IdsOnlyTokenizer(), EngineConfig(device=str(device), attention_backend=backend,
                           use_cuda_graphs=graphs, num_kv_blocks=256), eos_token_ids=[])
        outputs = engine.generate(prompts, params)
        got = [o.output_token_ids for o in outputs]
        name = f"{backend}{'+graphs' if graphs else ''}"
        combos[name] = {"vs_transformers": _agreement(got, reference), "tokens": got,
                        "max_logprob_diff_teacher_forced": teacher_forced_difference(hf, outputs, device),
                        "runner": engine.runner.stats(), "num_fixed_shape_steps": engine.stats().num_fixed_shape_steps}
        del engine, model
    first = next(iter(combos.values()), None)
    for entry in combos.values():
        entry["vs_torch_eager"] = _agreement(entry["tokens"], first["tokens"])
    for entry in combos.values():
        del entry["tokens"]
    return combos


def teacher_forced_difference(hf, outputs, device: torch.device) -> float:
    """Over every generated token: |our step path's logprob of it - transformers' logprob of the same token|,
    transformers reading prompt + our tokens in one forward. Teacher-forced: a bf16 run that leaves transformers'
    greedy path is still compared token by token, so a wrong kernel, graph or block shows at its own position
    whatever was chosen there, while plain rounding stays ~1e-2 nats."""
    worst = 0.0
    for out in outputs:
        ids = out.prompt_token_ids + out.output_token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids], device=device)).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        start = len(out.prompt_token_ids)
        for i, entry in enumerate(out.logprobs):
            want = logprobs[start + i - 1, ids[start + i]].item()
            worst = max(worst, abs(entry.logprob - want))
    return round(worst, 5)


def _agreement(got: list[list[int]], want: list[list[int]]) -> dict[str, float]:
    prefix = []
    for a, b in zip(got, want):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix.append(n)
    positions = sum(len(b) for b in want)
    return {"first_token_agreement": sum(a[:1] == b[:1] for a, b in zip(got, want)) / len(want),
            "rows_full_match": sum(p == len(b) for p, b in zip(prefix, want)) / len(want),
            "mean_matching_prefix": sum(prefix) / len(prefix),
            "position_agreement": sum(x == y for a, b in zip(got, want) for x, y in zip(a, b)) / positions}


def run_hf(args: argparse.Namespace, budget: RunBudget) -> dict[str, Any]:
    """The same prompts and output lengths through transformers' continuous batching (``generate_batch``)."""
    import transformers
    from transformers import GenerationConfig, LlamaForCausalLM

    device = torch.device(args.device)
    result: dict[str, Any] = {"run": "hf", "transformers": transformers.__version__}
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(make_config(args.tiny), dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    lengths = output_lengths(args.num_prompts, args.output_len)
    config = GenerationConfig(max_new_tokens=max(lengths), do_sample=False, eos_token_id=None, pad_token_id=0)
    done: dict[str, int] = {}
    try:  # generate_batch's own manager, fed per-request lengths as in our run; its warm-up is not timed
        with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
            start = time.perf_counter()
            deadline = budget.timed_deadline()
            for i, (ids, n) in enumerate(zip(prompts, lengths)):
                manager.add_request(ids, request_id=f"h{i}", max_new_tokens=n)
            while len(done) < len(prompts) and time.perf_counter() < deadline:
                out = manager.get_result(timeout=1)
                if out is not None and out.is_finished():
                    done[out.request_id] = len(out.generated_tokens)
            seconds = time.perf_counter() - start
        result["lengths"] = "per request"
    except TypeError:  # an API without per-request lengths: generate_batch, everyone at the longest length
        start = time.perf_counter()
        outs = model.generate_batch(prompts, generation_config=config)
        seconds = time.perf_counter() - start
        done = {k: len(v.generated_tokens) for k, v in outs.items()}
        result["lengths"] = f"all {max(lengths)}"
    tokens = sum(done.values())
    result.update({"seconds": round(seconds, 3), "finished": len(done), "timed_out": len(done) < len(prompts),
                   "num_output_tokens_finished": tokens, "output_tokens_per_s": round(tokens / seconds, 1)})
    del model
    _free(device)
    return result


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _runs(requested: str) -> list[str]:
    """``core``, ``extra``, ``all`` or a comma list of runs."""
    requested = RUN_SETS.get(requested.strip(), requested)
    return [s.strip() for s in requested.split(",") if s.strip()]


def _environment(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": args.device, "tiny": args.tiny,
           "output_lengths": f"uniform in [1, {args.output_len}]",
           "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
           "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model and small workload (smoke check)")
    p.add_argument("--num-prompts", type=int, default=None, help="default 256 (tiny: 4)")
    p.add_argument("--input-len", type=int, default=None, help="default 512 (tiny: 16)")
    p.add_argument("--output-len", type=int, default=None, help="default 256 (tiny: 8)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--runs", default=DEFAULT_RUNS,
                   help="core, extra, all, or a comma list of [quantization:](torch|triton)[+graphs], hf "
                   "(transformers), parity "
                   "(bf16 greedy tokens at head_dim 128 vs transformers, per backend and graphs on/off), "
                   "quant-kernels (scripts/gpu_quant_bench.py) or decode-ab (scripts/gpu_decode_ab.py)")
    p.add_argument("--budget-s", type=float, default=180.0, help="wall-clock budget of all timed runs")
    p.add_argument("--steady-steps", type=int, default=0,
                   help="time this many decode steps at a fixed batch (every prompt prefilled first) in every "
                   "engine run; 0: time the whole workload as it drains")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_bench.json"))
    args = p.parse_args(argv)
    small, big = (4, 16, 8), (256, 512, 256)
    for name, tiny_v, full_v in zip(("num_prompts", "input_len", "output_len"), small, big):
        if getattr(args, name) is None:
            setattr(args, name, tiny_v if args.tiny else full_v)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {"environment": _environment(args), "runs": {}}
    runs = _runs(args.runs)
    needs_ceilings = any(run != "parity" for run in runs)  # the parity stage alone needs no roofline
    args.ceilings = report["ceilings"] = measure_ceilings(torch.device(args.device), args.tiny) \
        if needs_ceilings else {}
    end = time.perf_counter() + args.budget_s
    for i, run in enumerate(runs):
        budget = RunBudget((end - time.perf_counter()) / (len(runs) - i), end)
        try:
            special = {"hf": run_hf, "parity": run_parity, "quant-kernels": run_quant_kernels,
                       "decode-ab": run_decode_ab}
            result = special[run](args, budget) if run in special else run_engine(run, args, budget)
        except Exception as exc:  # record and go on with the next run
            result = {"run": run, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=8)}
        _free(torch.device(args.device))  # outside the except block: the traceback no longer pins the model
        report["runs"][run] = result
        print(json.dumps(result, default=str), flush=True)
        _write(args.out, report)
    report["summary"] = _summary(report["runs"])
    _write(args.out, report)
    failed = [r for r, v in report["runs"].items() if "error" in v]
    print(f"wrote {args.out}; failed runs: {', '.join(failed) or '(no failures)'}", flush=True)
    return 1 if runs and runs[0] in failed else 0


def _summary(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Output tokens/s per run, each run's share of the decode roofline, ratios to the first run and to hf."""
    tok = {r: v.get("output_tokens_per_s") for r, v in runs.items() if v.get("output_tokens_per_s")}
    out: dict[str, Any] = {"output_tokens_per_s": tok,
                           "roofline_share": {r: v["roofline_share"] for r, v in runs.items() if "roofline_share" in v}}
    if tok:
        first = next(iter(tok.values()))
        out["vs_first_run"] = {r: round(t / first, 3) for r, t in tok.items()}
        if "hf" in tok:
            out["vs_hf"] = {r: round(t / tok["hf"], 3) for r, t in tok.items()}
    return out


def _write(path: str, report: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)


if __name__ == "__main__":
    raise SystemExit(main())
