"""Sampling-side workloads (issues 9 and 10): n samples vs repeated rows, JSON schema, top logprobs, sampling vs
greedy, stop strings on long outputs. Prints one JSON object with tokens/s and computed prompt tokens.

Usage: python scripts/sampling_bench.py [--model smollm2-135m-instruct] [--rows 64] [--max-tokens 64]
       [--stop-tokens 1024] [--only NAME ...]     # --tiny: the random test model (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k_test.prompts.jsonl"  # beside the checkout
ANSWER_SCHEMA = {"type": "object", "properties": {
    "reasoning": {"type": "string", "maxLength": 200}, "answer": {"type": "integer"}},
    "required": ["reasoning", "answer"], "additionalProperties": False}


def load_prompts(path: Path, rows: int) -> list[list[dict]]:
    lines = path.read_text().splitlines()[:rows]
    return [[{"role": "user", "content": json.loads(line)["prompt"]}] for line in lines]


def run(engine: LLMEngine, prompts, params) -> dict:
    """One workload on a fresh stats baseline: wall time, output tok/s, computed prompt tokens."""
    before = engine.stats().to_dict()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    after = engine.stats().to_dict()
    num_out = sum(len(o.output_token_ids) for o in outs)
    return {"rows": len(outs), "wall_s": wall, "output_tok_s": num_out / wall,
            "computed_prompt_tokens": after["num_prefill_tokens"] - before["num_prefill_tokens"],
            "output_tokens": num_out, "errors": sum(o.error is not None for o in outs),
            "finished_stop": sum(o.finish_reason == "stop" for o in outs)}


def workloads(prompts, max_tokens: int, stop_tokens: int) -> dict:
    base = dict(max_tokens=max_tokens, temperature=0.8, top_p=0.95, ignore_eos=True)
    seeded = [SamplingParams(**base, seed=i) for i in range(len(prompts))]
    return {
        "n4": (prompts, [SamplingParams(**base, seed=i, n=4) for i in range(len(prompts))]),
        "rows_x4": ([p for p in prompts for _ in range(4)],
                    [SamplingParams(**base, seed=i) for i in range(4 * len(prompts))]),
        "plain": (prompts, seeded),
        # same knobs as "plain"; room for the whole JSON (the grammar ends it, ignore_eos or not)
        "json_schema": (prompts, [SamplingParams(**{**base, "max_tokens": max_tokens * 4}, seed=i,
                                                 json_schema=ANSWER_SCHEMA) for i in range(len(prompts))]),
        "logprobs_5": (prompts, [SamplingParams(**base, seed=i, logprobs=5) for i in range(len(prompts))]),
        "greedy_x2": (prompts * 2, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)),
        "sampled_x2": (prompts * 2, [SamplingParams(**base, seed=i) for i in range(2 * len(prompts))]),
        "stop_strings": (prompts[:8], SamplingParams(max_tokens=stop_tokens, temperature=0.8, seed=1,
                                                     ignore_eos=True, stop=["\x00never", "zzzz-no"])),
    }


def build_engine(args) -> LLMEngine:
    config = dict(max_num_seqs=256, enable_prefix_caching=False)  # sharing must come from n, not the cache
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
        from tiny import engine_from_hf, make_hf_model, make_tokenizer

        return engine_from_hf(make_hf_model("llama"), make_tokenizer(), **config)
    return LLMEngine.from_source(args.model, config=EngineConfig(**config))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stop-tokens", type=int, default=1024)
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    engine = build_engine(args)
    results = {"model": "tiny" if args.tiny else args.model, "rows": args.rows, "max_tokens": args.max_tokens}
    for name, (prompts, params) in workloads(load_prompts(PROMPTS, args.rows), args.max_tokens,
                                             args.stop_tokens).items():
        if not args.only or name in args.only:
            results[name] = run(engine, prompts, params)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
