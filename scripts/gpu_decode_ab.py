"""The decode-step A/B of the GPU check's extra phase (``gpu_bench.py --runs decode-ab``): split-K decode attention
and one-step-late readback, each off and on, measured and compared. Reported, not judged (both are opt-in).

* ``kernel``: the triton decode kernel unsplit vs split-K (``split_decode="on"``) at Llama-3-8B's attention shape
  (32 heads, 8 KV heads, head_dim 128, bf16, block 16) over (rows, context) from 1 x 8192 to 256 x 512: time per
  call (CUDA events), the split's speed-up, its largest difference from the unsplit output, and whether ``auto``
  splits there (jobrunner/attention/split_decode.py).
* ``engine``: a Llama-3-8B-wide model with 4 layers (random bf16), triton + CUDA graphs, 16 prompts of 2,048
  tokens prefilled, then ``STEADY_STEPS`` decode steps timed, per variant (split off / auto) x (late readback off
  / cuda): step time, decode tokens/s, the steps read late, and whether every row's greedy tokens equal the
  first variant's (late readback must not change one; split-K may, by bf16 rounding).

Without CUDA (the check's CPU-only smoke, ``--tiny``): no kernel part; the engine part runs the tiny model on the
torch backend with late readback ``always`` vs ``off`` (split-K needs the triton backend).
"""

from __future__ import annotations

import time
from typing import Any

import torch

KERNEL_SHAPES = ((1, 8192), (4, 4096), (16, 2048), (64, 1024), (256, 512))
ENGINE_LAYERS = 4
ENGINE_ROWS, ENGINE_INPUT = 16, 2048
STEADY_STEPS = 48
VARIANTS = (("off", "off"), ("off", "cuda"), ("auto", "off"), ("auto", "cuda"))   # (split_decode, late_readback)


def run(args, deadline: float, bench) -> dict[str, Any]:
    """Both parts, stopping at ``deadline`` (perf_counter) between measurements. ``bench``: scripts/gpu_bench.py."""
    device = torch.device(args.device)
    result: dict[str, Any] = {"run": "decode-ab"}
    if device.type == "cuda":
        result["kernel"] = kernel_ab(device, deadline)
    result["engine"] = engine_ab(args, device, deadline, bench)
    return result


def kernel_ab(device: torch.device, deadline: float, heads: int = 32, kv_heads: int = 8) -> list[dict[str, Any]]:
    from jobrunner.attention.split_decode import use_split_decode
    from jobrunner.attention.triton_backend import TritonBackend

    out = []
    for rows, context in KERNEL_SHAPES:
        if time.perf_counter() > deadline:
            out.append({"rows": rows, "context": context, "skipped": "deadline"})
            continue
        layout, slots, cache, qkv = _decode_inputs(rows, context, heads, kv_heads, device)
        timings, outputs = {}, {}
        for mode in ("off", "on"):
            backend = TritonBackend(heads, kv_heads, 16, device, max_num_seqs=rows, max_model_len=context,
                                    split_decode=mode)
            timings[mode], outputs[mode] = _time_forward(backend, layout, slots, cache, qkv)
        auto = use_split_decode(rows, kv_heads, context, backend.segment_keys, backend.target_programs)
        out.append({"rows": rows, "context": context, "unsplit_us": timings["off"], "split_us": timings["on"],
                    "split_speedup": round(timings["off"] / timings["on"], 3), "auto_splits": auto,
                    "max_abs_diff": float((outputs["on"].float() - outputs["off"].float()).abs().max())})
        del cache, qkv, outputs
    return out


def _decode_inputs(rows: int, context: int, heads: int, kv_heads: int, device: torch.device):
    from jobrunner.attention import StepLayout

    block_size, blocks_per_row = 16, -(-context // 16)
    perm = torch.randperm(rows * blocks_per_row).tolist()   # scattered blocks, as a used pool has them
    layout = StepLayout([], [], [], [], rows, block_size)
    slots = []
    for r in range(rows):
        table = perm[r * blocks_per_row:(r + 1) * blocks_per_row]
        layout.query_starts.append(r)
        layout.query_lens.append(1)
        layout.seq_lens.append(context)
        layout.block_tables.append(table)
        slots.append(table[(context - 1) // block_size] * block_size + (context - 1) % block_size)
    gen = dict(device=device, dtype=torch.bfloat16)
    cache = torch.randn(2, rows * blocks_per_row * block_size, kv_heads, 128, **gen)
    qkv = (torch.randn(rows, heads, 128, **gen), torch.randn(rows, kv_heads, 128, **gen),
           torch.randn(rows, kv_heads, 128, **gen))
    return layout, slots, cache, qkv


def _time_forward(backend, layout, slots, cache, qkv, iters: int = 20) -> tuple[float, torch.Tensor]:
    """Microseconds per forward (CUDA events, after warm-up), and its output."""
    from jobrunner.attention import StepUpload

    upload = StepUpload(cache.device)
    upload.add("slot_mapping", slots)
    meta = backend.build(layout, upload)
    q, k, v = qkv
    for _ in range(3):
        out = backend.forward(q, k, v, cache[0], cache[1], meta, 128 ** -0.5)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        backend.forward(q, k, v, cache[0], cache[1], meta, 128 ** -0.5)
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) * 1e3 / iters, 2), out


def engine_ab(args, device: torch.device, deadline: float, bench) -> dict[str, Any]:
    cuda = device.type == "cuda"
    shape = dict(bench.LLAMA3_8B, num_hidden_layers=ENGINE_LAYERS) if cuda and not args.tiny else None
    model = bench.build_random_model(bench.make_config(shape is None, shape), torch.bfloat16, device)
    rows, length = (ENGINE_ROWS, ENGINE_INPUT) if shape else (4, 40)
    prompts = bench.random_prompts(rows, length, model.shape.vocab_size, seed=11)
    variants = VARIANTS if cuda else (("off", "off"), ("off", "always"))
    out: dict[str, Any] = {"layers": model.shape.num_layers, "rows": rows, "input_len": length,
                           "steady_steps": STEADY_STEPS, "variants": {}}
    tokens: dict[str, Any] = {}
    for split, late in variants:
        name = f"split={split},late={late}"
        if time.perf_counter() > deadline:
            out["variants"][name] = {"skipped": "deadline"}
            continue
        try:
            entry, tokens[name] = _engine_variant(model, prompts, device, split, late, bench)
        except Exception as exc:  # record and go on with the next variant
            out["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        # late readback must leave every token as the synchronous variant of the same split gives it
        sync_name = f"split={split},late=off"
        if late != "off" and sync_name in tokens:
            entry["tokens_equal_synchronous"] = tokens[name] == tokens[sync_name]
        entry["tokens_equal_first_variant"] = tokens[name] == next(iter(tokens.values()))
        out["variants"][name] = entry
    del model
    return out


def _engine_variant(model, prompts, device, split: str, late: str, bench):
    from jobrunner.bench.result import sync
    from jobrunner.engine import EngineConfig, SamplingParams
    from jobrunner.engine.llm_engine import LLMEngine

    cuda = device.type == "cuda"
    config = EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=2048, enable_prefix_caching=False,
                          device=str(device), use_cuda_graphs=cuda, attention_backend="triton" if cuda else "torch",
                          speculative="off", split_decode=split, late_readback=late,
                          num_kv_blocks=2 * len(prompts) * (-(-len(prompts[0]) // 16) + STEADY_STEPS))
    t0 = time.perf_counter()
    engine = LLMEngine(model, bench.IdsOnlyTokenizer(), config, eos_token_ids=[])
    engine.generate(prompts[:2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))   # compile, warm
    entry: dict[str, Any] = {"setup_s": round(time.perf_counter() - t0, 2)}
    params = SamplingParams(max_tokens=STEADY_STEPS + 8, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"ab{i}", ids, params)
    outputs = []
    while _prefilling(engine):   # untimed: every row prefilled
        outputs += engine.step()
    before = engine.stats().to_dict()
    sync(device)
    start = time.perf_counter()
    for _ in range(STEADY_STEPS):
        outputs += engine.step()
    sync(device)
    seconds = time.perf_counter() - start
    after = engine.stats().to_dict()
    while engine.has_unfinished_requests():   # untimed: the tokens are compared across variants
        outputs += engine.step()
    decode = after["num_decode_tokens"] - before["num_decode_tokens"]
    entry.update({"step_ms": round(seconds / STEADY_STEPS * 1e3, 3), "decode_tokens_per_s": round(decode / seconds, 1),
                  "late_steps": after["num_late_steps"] - before["num_late_steps"],
                  "fixed_shape_steps": after["num_fixed_shape_steps"] - before["num_fixed_shape_steps"],
                  "runner": engine.runner.stats()})
    tokens = {o.request_id: o.output_token_ids for o in outputs}
    del engine
    return entry, tokens


def _prefilling(engine) -> bool:
    """Whether a request still waits or has prompt tokens left to compute."""
    scheduler = engine.scheduler
    return bool(scheduler.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)
