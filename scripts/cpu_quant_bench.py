"""CPU quantization end to end: output tok/s at batch 1/8/64 per (dtype, scheme), ratios to the best float
dtype, perplexity and teacher-forced top-1 on held-out text; this CPU's capability and forced ones.

Each capability runs in a fresh process (``avx2`` also caps torch's, oneDNN's and MKL's ISA, as
``jobrunner.quant.bench_dispatch`` does, so an AVX512 machine chooses and runs AVX2's kernels). In a process the
engines are loaded side by side and, per batch size, run in turn ``--rounds`` times (best kept).

    python scripts/cpu_quant_bench.py --threads 2 \\
        --configs float32:none,bfloat16:none,bfloat16:int8,bfloat16:w8a8,bfloat16:int4 --capabilities native \\
        --quality-texts ../shared/data/mt_bench_turn2_ref.prompts.jsonl --out cpu_quant.json
    python scripts/cpu_quant_bench.py --threads 2 --capabilities avx2 \\
        --configs float32:none,bfloat16:none,float32:int8,float32:w8a8,float32:int4

A config may carry its own crossovers (``JOBRUNNER_QUANT_KERNEL_TOKENS`` while that engine loads, ``+`` for
``,``): ``bfloat16:int4@int4=8+int4_int8=4096``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

AVX2_ENV = {"JOBRUNNER_CPU_CAPABILITY": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
ROOT = Path(__file__).resolve().parents[1]
MAX_PROMPT_TOKENS = 256
CROSSOVER_ENV = "JOBRUNNER_QUANT_KERNEL_TOKENS"
MAX_PPL_TOKENS = 512


def _engines(source: str, configs: list[str], max_num_seqs: int, token_ids: list[list[int]], max_tokens: int,
             speculative: str = "off"):
    from jobrunner.engine import EngineConfig, LLMEngine

    blocks = sum(-(-(len(ids) + max_tokens) // 16) + 1 for ids in _batch(token_ids, max_num_seqs))
    # speculation off by default: with it, tokens per step depend on the text each scheme generates (a scheme
    # that repeats itself gets more n-gram drafts accepted), not only on its kernels
    config = EngineConfig(device="cpu", max_num_seqs=max_num_seqs, num_kv_blocks=blocks, enable_prefix_caching=False,
                          speculative=speculative)
    out = {}
    for name in configs:
        dtype, scheme = name.split(":")
        scheme, _, crossover = scheme.partition("@")  # "int4@int4=8+int4_int8=4096": this engine's crossovers
        saved = os.environ.get(CROSSOVER_ENV)
        if crossover:
            os.environ[CROSSOVER_ENV] = crossover.replace("+", ",")
        try:
            out[name] = LLMEngine.from_source(source, dtype=dtype, quantization=scheme, config=config)
        finally:
            if saved is None:
                os.environ.pop(CROSSOVER_ENV, None)
            else:
                os.environ[CROSSOVER_ENV] = saved
    return out


def _batch(token_ids: list[list[int]], size: int) -> list[list[int]]:
    return [token_ids[i % len(token_ids)] for i in range(size)]


def _tok_s(engine, prompts: list[list[int]], max_tokens: int) -> float:
    from jobrunner.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    return sum(len(o.output_token_ids) for o in outputs) / (time.perf_counter() - start)


def _quality(engines: dict[str, Any], texts: list[str]) -> dict[str, dict[str, float]]:
    """Perplexity per config and top-1 agreement with the first config, teacher-forced, one prefill per text."""
    import torch

    from jobrunner.engine.scoring import sequence_logits

    tokenizer = next(iter(engines.values())).tokenizer
    ids_list = [ids for ids in (tokenizer(t, add_special_tokens=False)["input_ids"][:MAX_PPL_TOKENS] for t in texts)
                if len(ids) >= 2]
    reference: list[torch.Tensor] = []
    out = {}
    for name, engine in engines.items():
        nll, count, same, top1 = 0.0, 0, 0, []
        with torch.no_grad():
            for ids in ids_list:
                logits = sequence_logits(engine.model, ids)[:-1].float()
                target = torch.tensor(ids[1:])
                nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
                count += len(ids) - 1
                top1.append(logits.argmax(-1))
        if not reference:
            reference = top1
        same = sum(int((a == b).sum()) for a, b in zip(top1, reference, strict=True))
        out[name] = {"perplexity": math.exp(nll / count), "top1_vs_first": same / count, "tokens": count}
    return out


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Measure in this process (one capability)."""
    import torch

    from jobrunner.bench.prompts import as_chat, held_out_texts
    from jobrunner.io.prompt_file import read_prompts
    from jobrunner.quant.dispatch import cpu_profile

    if args.threads:
        torch.set_num_threads(args.threads)
    configs = args.configs.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [as_chat(row, raw=False) for row in read_prompts(args.prompts, args.num_prompts)]
    from jobrunner.engine import EngineConfig, LLMEngine

    probe = LLMEngine.from_source(args.source, dtype="float32", config=EngineConfig(device="cpu", num_kv_blocks=4))
    token_ids = [probe.tokenize(p)[:MAX_PROMPT_TOKENS] for p in prompts]
    del probe
    engines = _engines(args.source, configs, max(batches), token_ids, args.max_tokens, args.speculative)
    for engine in engines.values():
        _tok_s(engine, token_ids[:2], 2)  # warm-up
    best: dict[str, dict[str, float]] = {c: {} for c in configs}
    for b in batches:
        for _ in range(args.rounds):
            for name, engine in engines.items():
                value = _tok_s(engine, _batch(token_ids, b), args.max_tokens)
                best[name][str(b)] = max(best[name].get(str(b), 0.0), value)
            print(f"[{time.strftime('%H:%M:%S')}] b{b}: " + ", ".join(f"{c} {best[c][str(b)]:.1f}" for c in configs),
                  file=sys.stderr, flush=True)
    result = {"profile": cpu_profile().to_dict(), "threads": torch.get_num_threads(), "tok_s": best,
              "dispatch": {c: e.model_info.get("quant_kernels") for c, e in engines.items()}}
    if args.quality_texts:
        texts = held_out_texts(read_prompts(args.quality_texts, args.num_texts))
        result["quality"] = _quality(engines, texts)
    return result


def render(label: str, result: dict[str, Any]) -> str:
    """One markdown table: tok/s, ratio to the best float config per batch size, perplexity, top-1."""
    tok_s, quality = result["tok_s"], result.get("quality", {})
    batches = list(next(iter(tok_s.values())))
    floats = [c for c in tok_s if c.endswith(":none")]
    best_float = {b: max(tok_s[c][b] for c in floats) for b in batches}
    ref_ppl = quality.get(floats[0], {}).get("perplexity") if quality else None
    lines = [f"## {label}: capability {result['profile']['capability']} (forced {result['profile']['forced']}), "
             f"threads {result['threads']}",
             "| dtype:scheme | " + " | ".join(f"b{b} tok/s" for b in batches) + " | "
             + " | ".join(f"b{b} vs best float" for b in batches) + " | perplexity | Δ | top-1 |",
             "|---" * (2 * len(batches) + 4) + "|"]
    for name, row in tok_s.items():
        q = quality.get(name, {})
        ppl = f"{q['perplexity']:.4f}" if q else "—"
        delta = f"{(q['perplexity'] / ref_ppl - 1) * 100:+.2f}%" if q and ref_ppl else "—"
        top1 = f"{q['top1_vs_first'] * 100:.1f}%" if q else "—"
        lines.append(f"| {name} | " + " | ".join(f"{row[b]:.1f}" for b in batches) + " | "
                     + " | ".join(f"{row[b] / best_float[b]:.2f}x" for b in batches) + f" | {ppl} | {delta} | {top1} |")
    lines += [f"* {c}: {d}" for c, d in result["dispatch"].items() if d]
    return "\n".join(lines)


def main() -> None:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", default=str(ROOT / "examples" / "data" / "prompts.parquet"))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--configs", default="float32:none,bfloat16:none,bfloat16:int8,bfloat16:w8a8,bfloat16:int4")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--speculative", default="off", help="engine.speculative for every config (default off: "
                        "the same work per step for every scheme)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--capabilities", default="native", help="native | avx2 | a forced capability, comma list; "
                        "'native:int4=16' also sets JOBRUNNER_QUANT_KERNEL_TOKENS")
    parser.add_argument("--quality-texts", default=None, help="held-out texts (.jsonl prompts) for perplexity")
    parser.add_argument("--num-texts", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    results = {}
    for capability in args.capabilities.split(","):
        env = {k: v for k, v in os.environ.items() if k not in AVX2_ENV}
        capability, _, crossover = capability.partition(":")  # "native:int4=16" also moves a crossover
        if crossover:
            env[CROSSOVER_ENV] = crossover
        if capability == "avx2":
            env.update(AVX2_ENV)
        elif capability != "native":
            env["JOBRUNNER_CPU_CAPABILITY"] = capability
        argv = [a for a in sys.argv[1:]] + ["--child"]
        done = subprocess.run([sys.executable, __file__, *argv], env=env, stdout=subprocess.PIPE, text=True,
                              check=False)
        if done.returncode != 0:
            raise SystemExit(f"{capability}: child failed ({done.returncode})")
        label = capability + (f" ({crossover})" if crossover else "")
        results[label] = json.loads(done.stdout.strip().splitlines()[-1])
        print(render(label, results[label]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
