"""Sampling-side workloads (issues 9 and 10): n samples vs repeated rows, JSON schema, top logprobs, sampling vs
greedy, stop strings on long outputs; and prefill throughput. Prints one JSON object with tokens/s and computed
prompt tokens.

Usage: python scripts/sampling_bench.py [--model smollm2-135m-instruct] [--rows 64] [--max-tokens 64]
       [--stop-tokens 1024] [--only NAME ...]     # --tiny: the random test model (a smoke run)
       python scripts/sampling_bench.py --only prefill [--rows 256] [--long-rows 32] [--long-tokens 1536]

`prefill`: max_tokens=1 (no decode step), prefix caching off, prompts tokenized before the clock starts:
`short` is --rows GSM8K chat prompts as they are; `long` is --long-rows prompts, each several GSM8K questions
(no question used twice while there are enough) joined into one user turn of about --long-tokens tokens, so
prompts span engine steps (max_num_batched_tokens, default 2048: chunked prefill). Reported: prompt tokens per
wall second, and per second of the engine's own prefill time (stats prefill_s).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams

PROMPTS_FILE = "gsm8k_test.prompts.jsonl"
NEVER_STOP = ["\x00never", "zzzz-no"]  # stop strings that never match: the check runs on every step
ANSWER_SCHEMA = {"type": "object", "properties": {
    "reasoning": {"type": "string", "maxLength": 200}, "answer": {"type": "integer"}},
    "required": ["reasoning", "answer"], "additionalProperties": False}


def find_prompts(name: str = PROMPTS_FILE) -> Path:
    """shared/data/NAME beside the checkout or beside a folder above it (a worktree under /work/wt/...)."""
    here = Path(__file__).resolve()
    for parent in here.parents[1:]:
        candidate = parent / "shared" / "data" / name
        if candidate.exists():
            return candidate
    raise SystemExit(f"no shared/data/{name} beside {here.parents[1]} or above it; pass --prompts PATH")


def load_questions(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def load_prompts(path: Path, rows: int) -> list[list[dict]]:
    return [[{"role": "user", "content": q}] for q in load_questions(path)[:rows]]


def timed_generate(engine: LLMEngine, prompts, params) -> tuple[list, float, dict, dict]:
    """``(outputs, wall seconds, engine stats before, stats after)`` of one ``generate`` call."""
    before = engine.stats().to_dict()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    return outs, wall, before, engine.stats().to_dict()


def run(engine: LLMEngine, prompts, params) -> dict:
    """One workload on a fresh stats baseline: wall time, output tok/s, computed prompt tokens."""
    outs, wall, before, after = timed_generate(engine, prompts, params)
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
                                                     ignore_eos=True, stop=NEVER_STOP)),
    }


def long_prompts(engine: LLMEngine, questions: list[str], rows: int, target_tokens: int) -> list[list[dict]]:
    """``rows`` chat prompts of about ``target_tokens`` tokens each (at most the engine's max_model_len - 2):
    consecutive questions joined by blank lines, wrapping around the set if it runs out (prefix caching is
    off, so a repeat costs the same)."""
    target = min(target_tokens, engine.max_model_len - 2)
    prompts, i = [], 0
    for _ in range(rows):
        parts: list[str] = []
        while True:
            parts.append(questions[i % len(questions)])
            i += 1
            message = [{"role": "user", "content": "\n\n".join(parts)}]
            length = len(engine.tokenize(message))
            if length >= target:
                break
        if length > target:  # one question too many: keep the prompt under the limit
            if len(parts) > 1:
                parts.pop()
                i -= 1
                message = [{"role": "user", "content": "\n\n".join(parts)}]
        prompts.append(message)
    return prompts


def run_prefill(engine: LLMEngine, prompts) -> dict:
    """Prompts tokenized first, then generated with max_tokens=1: prompt tokens per wall / prefill second."""
    token_ids = [engine.tokenize(p) for p in prompts]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.generate(token_ids[:2], params)  # warm-up: first-call allocations on this shape range
    before = engine.stats().to_dict()
    t0 = time.perf_counter()
    outs = engine.generate(token_ids, params)
    wall = time.perf_counter() - t0
    after = engine.stats().to_dict()
    computed = after["num_prefill_tokens"] - before["num_prefill_tokens"]
    lengths = [len(t) for t in token_ids]
    result = {"rows": len(outs), "wall_s": wall, "prompt_tokens": sum(lengths),
              "computed_prompt_tokens": computed, "prompt_tok_s": computed / wall,
              "prompt_len_mean": sum(lengths) / len(lengths), "prompt_len_max": max(lengths),
              "steps": after["steps"] - before["steps"],
              "decode_tokens": after["num_decode_tokens"] - before["num_decode_tokens"],
              "errors": sum(o.error is not None for o in outs)}
    if "prefill_s" in after:
        prefill_s = after["prefill_s"] - before["prefill_s"]
        result.update(prefill_s=prefill_s, prompt_tok_per_prefill_s=computed / prefill_s if prefill_s else None,
                      schedule_s=after["schedule_s"] - before["schedule_s"])
    return result


def build_engine(args) -> LLMEngine:
    config = dict(max_num_seqs=256, enable_prefix_caching=False,  # sharing must come from n, not the cache
                  max_num_batched_tokens=args.max_num_batched_tokens)
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
    ap.add_argument("--only", nargs="*", help="workload names (n4, rows_x4, plain, json_schema, logprobs_5, "
                    "greedy_x2, sampled_x2, stop_strings, prefill); default all")
    ap.add_argument("--prompts", type=Path, default=None, help=f"default: shared/data/{PROMPTS_FILE}")
    ap.add_argument("--long-rows", type=int, default=32, help="prefill: number of long prompts")
    ap.add_argument("--long-tokens", type=int, default=1536, help="prefill: tokens per long prompt (about)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the engine's per-step token budget")
    args = ap.parse_args()
    path = args.prompts or find_prompts()
    engine = build_engine(args)
    results = {"model": "tiny" if args.tiny else args.model, "rows": args.rows, "max_tokens": args.max_tokens,
               "max_num_batched_tokens": args.max_num_batched_tokens, "prompts": str(path)}
    for name, (prompts, params) in workloads(load_prompts(path, args.rows), args.max_tokens,
                                             args.stop_tokens).items():
        if not args.only or name in args.only:
            results[name] = run(engine, prompts, params)
    if not args.only or "prefill" in args.only:
        long = long_prompts(engine, load_questions(path), args.long_rows, args.long_tokens)
        results["prefill"] = {"short": run_prefill(engine, load_prompts(path, args.rows)),
                              "long": run_prefill(engine, long)}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
