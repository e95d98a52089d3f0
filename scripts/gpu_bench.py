"""Throughput of our engine on a Llama-3-8B-shaped model with random bf16 weights (no weights, no tokenizer).

Builds OUR model directly on the device (``jobrunner.models.loader.build_model``), fills it with N(0, 0.02)
weights and unit norms, and runs random token-id prompts through ``LLMEngine`` (greedy, ignore_eos). Each
quantization scheme (none, none without CUDA graphs, int8, int4) gets a fresh
model; a scheme's failure is recorded and the next one still runs. Every scheme has a wall-clock deadline:
a run past it stops early and is marked ``timed_out`` (its counters cover what finished). Results go to
stdout and to ``--out`` (default ``$OUT/gpu_bench.json``), rewritten after every scheme.

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


def make_config(tiny: bool):
    """A Llama-3-8B-shaped (or tiny) ``LlamaConfig`` with llama3 rope scaling."""
    import transformers
    from transformers import LlamaConfig

    shape = TINY if tiny else LLAMA3_8B
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


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def timed_run(engine, prompts: list[list[int]], output_len: int, deadline: float) -> dict[str, Any]:
    """Add every prompt, step until done or ``deadline`` (perf_counter); counters of what finished."""
    from jobrunner.bench.result import sync
    from jobrunner.engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    before = dict(engine.stats().to_dict())
    sync(engine.device)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{i}", ids, params)
    outputs = []
    while engine.has_unfinished_requests() and time.perf_counter() < deadline:
        outputs += engine.step()
    sync(engine.device)
    seconds = time.perf_counter() - start
    after = engine.stats().to_dict()
    delta = {k: after[k] - before[k] for k in ("steps", "prefill_s", "decode_s", "schedule_s",
                                               "num_prefill_tokens", "num_decode_tokens", "num_preemptions")}
    # Tokens actually computed (also by unfinished requests when the deadline hit):
    out_tok = delta["num_decode_tokens"] + sum(1 for o in outputs if o.output_token_ids)
    prompt_tok = sum(len(o.prompt_token_ids) for o in outputs)
    errors = [o.error for o in outputs if o.finish_reason == "error"]
    return {"seconds": seconds, "timed_out": engine.has_unfinished_requests(), "finished": len(outputs),
            "num_output_tokens_finished": sum(len(o.output_token_ids) for o in outputs),
            "num_prompt_tokens_finished": prompt_tok, "num_output_tokens_computed": out_tok,
            "output_tokens_per_s": out_tok / seconds,
            "total_tokens_per_s": (delta["num_prefill_tokens"] + delta["num_decode_tokens"]) / seconds,
            "num_errors": len(errors), "first_error": errors[0] if errors else None,
            "kv_num_blocks": after["kv_num_blocks"], "kv_peak_blocks_used": after["kv_peak_blocks_used"],
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in delta.items()}}


def run_scheme(scheme: str, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """Build, quantize (unless ``none``), warm up, time one run; always free the model afterwards."""
    from jobrunner.bench.result import peak_memory, reset_peak_memory, sync
    from jobrunner.engine import EngineConfig, SamplingParams
    from jobrunner.engine.llm_engine import LLMEngine

    device = torch.device(args.device)
    result: dict[str, Any] = {"scheme": scheme}
    scheme, _, mode = scheme.partition(":")  # "none:eager": no CUDA graphs, to measure what they bring
    t0 = time.perf_counter()
    model = build_random_model(make_config(args.tiny), torch.bfloat16, device)
    result["build_s"] = round(time.perf_counter() - t0, 2)
    if scheme != "none":
        from jobrunner.quant import quantize_model

        t0 = time.perf_counter()
        report = quantize_model(model, scheme)
        sync(device)
        result["quantize_s"] = round(time.perf_counter() - t0, 2)
        result["quant_summary"] = report.summary()
    reset_peak_memory(device)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_prefix_caching=False, device=str(device), use_cuda_graphs=mode != "eager",
                          kv_cache_memory_bytes=256 * 2**20 if device.type == "cpu" else None)
    engine = LLMEngine(model, IdsOnlyTokenizer(), config, eos_token_ids=[])
    vocab = model.shape.vocab_size
    engine.generate(random_prompts(2, 16, vocab, seed=1), SamplingParams(max_tokens=4, temperature=0.0,
                                                                         ignore_eos=True))
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    result.update(timed_run(engine, prompts, args.output_len, deadline))
    result["memory"] = peak_memory(device)
    graphs = getattr(engine.runner, "graphs", None)
    result["decode_graphs"] = graphs.stats() if graphs is not None else None
    del engine, model
    _free(device)
    return result


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _schemes(requested: str) -> list[str]:
    return [s.strip() for s in requested.split(",") if s.strip()]


def _environment(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": args.device, "tiny": args.tiny,
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
    p.add_argument("--schemes", default="none,none:eager,int8,int4",
                   help="quantization schemes; a ':eager' suffix turns CUDA graphs off for that run")
    p.add_argument("--budget-s", type=float, default=180.0, help="wall-clock budget of all timed runs")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_bench.json"))
    args = p.parse_args(argv)
    small, big = (4, 16, 8), (256, 512, 256)
    for name, tiny_v, full_v in zip(("num_prompts", "input_len", "output_len"), small, big):
        if getattr(args, name) is None:
            setattr(args, name, tiny_v if args.tiny else full_v)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {"environment": _environment(args), "schemes": {}}
    schemes = _schemes(args.schemes)
    end = time.perf_counter() + args.budget_s
    for i, scheme in enumerate(schemes):
        deadline = time.perf_counter() + (end - time.perf_counter()) / (len(schemes) - i)
        try:
            result = run_scheme(scheme, args, deadline)
        except Exception as exc:  # record and go on with the next scheme
            result = {"scheme": scheme, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=8)}
        _free(torch.device(args.device))  # outside the except block: the traceback no longer pins the model
        report["schemes"][scheme] = result
        print(json.dumps(result, default=str), flush=True)
        _write(args.out, report)
    failed = [s for s, r in report["schemes"].items() if "error" in r]
    print(f"wrote {args.out}; failed schemes: {', '.join(failed) or '(no failures)'}", flush=True)
    return 1 if "none" in failed else 0


def _write(path: str, report: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)


if __name__ == "__main__":
    raise SystemExit(main())
