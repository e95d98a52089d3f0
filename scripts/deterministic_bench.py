"""engine.deterministic on a real model (issue 18, item 3): rows identical across configurations, and its cost.

Seeded sampled rows (temperature 0.8, top_p 0.95, one seed per row; EOS ignored) of GSM8K chat prompts are
generated under a baseline (max_num_seqs 64, max_num_batched_tokens 2048, cold prefix cache) and four other
configurations: max_num_seqs 2; max_num_batched_tokens 64 (chunked prefill); a warm prefix cache (the same
prompts run once before); a KV pool small enough to force preemption. For deterministic off and on, it counts the
rows whose tokens differ from the baseline, and the rows whose logprob bits differ (a logit change that did not
flip a token). Then output tokens/s of both modes at max_num_seqs 64 (--speed-rows rows). Prints one JSON object.

Usage: python scripts/deterministic_bench.py [--model smollm2-135m-instruct] [--dtype bfloat16] [--rows 12]
       [--max-tokens 32] [--speed-rows 32]
"""

from __future__ import annotations

import argparse
import json
import time

from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams

CONFIGS = {
    "max_num_seqs=2": dict(max_num_seqs=2),
    "max_num_batched_tokens=64": dict(max_num_batched_tokens=64),
    "prefix_cache_hit": dict(),
    "preemption": dict(num_kv_blocks=48),
}


def load_prompts(rows: int) -> list[list[dict]]:
    from sampling_bench import find_prompts
    from sampling_bench import load_prompts as load

    return load(find_prompts(), rows)


def engine_over(base: LLMEngine, deterministic: bool, **config) -> LLMEngine:
    settings = dict(max_num_seqs=64, max_num_batched_tokens=2048, dtype=base.config.dtype, device="cpu",
                    deterministic=deterministic)
    settings.update(config)
    return LLMEngine(base.model, base.tokenizer, EngineConfig(**settings), base.eos_token_ids, dict(base.model_info))


def params(rows: int, max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=1000 + i,
                           logprobs=0) for i in range(rows)]


def rows_of(engine: LLMEngine, prompts, ps, warm: bool) -> tuple[list, dict]:
    if warm:
        engine.generate(prompts, [SamplingParams(max_tokens=1, seed=1)] * len(prompts))
    outs = engine.generate(prompts, ps)
    stats = engine.stats().to_dict()
    return [(o.output_token_ids, [lp.logprob for lp in o.logprobs]) for o in outs], stats


def compare(base: LLMEngine, deterministic: bool, prompts, ps) -> dict:
    reference, _ = rows_of(engine_over(base, deterministic), prompts, ps, False)
    out = {}
    for name, config in CONFIGS.items():
        rows, stats = rows_of(engine_over(base, deterministic, **config), prompts, ps, name == "prefix_cache_hit")
        out[name] = {"rows_tokens_differ": sum(a[0] != b[0] for a, b in zip(rows, reference)),
                     "rows_logprob_bits_differ": sum(a[1] != b[1] for a, b in zip(rows, reference)),
                     "preemptions": stats.get("num_preemptions"), "cached_tokens": stats.get("num_cached_tokens")}
    return out


def speed(base: LLMEngine, deterministic: bool, prompts, max_tokens: int) -> dict:
    engine = engine_over(base, deterministic, enable_prefix_caching=False)
    ps = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=i)
          for i in range(len(prompts))]
    engine.generate(prompts[:2], SamplingParams(max_tokens=2, seed=0))  # warm-up
    t0 = time.perf_counter()
    outs = engine.generate(prompts, ps)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.output_token_ids) for o in outs)
    return {"rows": len(prompts), "output_tokens": tokens, "wall_s": round(wall, 2),
            "output_tok_s": round(tokens / wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--speed-rows", type=int, default=32)
    args = ap.parse_args()
    config = EngineConfig(device="cpu", dtype=args.dtype)
    plain = LLMEngine.from_source(args.model, config=config)             # default mode: never wrapped
    tiled = LLMEngine.from_source(args.model, config=config)             # its own copy, wrapped in place
    prompts = load_prompts(max(args.rows, args.speed_rows))
    ps = params(args.rows, args.max_tokens)
    result = {"model": args.model, "dtype": args.dtype, "rows": args.rows, "max_tokens": args.max_tokens,
              "default": compare(plain, False, prompts[:args.rows], ps),
              "deterministic": compare(tiled, True, prompts[:args.rows], ps)}
    result["speed_default"] = speed(plain, False, prompts[:args.speed_rows], args.max_tokens)
    result["speed_deterministic"] = speed(tiled, True, prompts[:args.speed_rows], args.max_tokens)
    result["deterministic_cost"] = round(1 - result["speed_deterministic"]["output_tok_s"]
                                         / result["speed_default"]["output_tok_s"], 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
