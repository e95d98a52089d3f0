"""Where a CPU batch's time goes, per (dtype, scheme): torch.profiler over one ``generate`` call.

Loads SmolLM2 once per config, runs ``--batch`` prompts x ``--max-tokens`` greedy tokens (prefill included, as
``cpu_quant_bench.py`` does) under ``torch.profiler`` and prints, per config, the top operators by self CPU time
and the time inside each kind of linear layer (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``,
``lm_head``) and everything else, so the share the quantized GEMMs can win back is known.

    python scripts/cpu_w8a8_profile.py --threads 2 --configs bfloat16:none,bfloat16:w8a8 --batch 64
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def _time_modules(model: torch.nn.Module, totals: dict[str, float], batch: int) -> list:
    """Forward pre/post hooks adding each linear kind's wall time (seconds) into ``totals``, keyed
    ``(phase, kind)``: phase ``prefill`` for steps with more tokens than ``batch``, else ``decode``; kind
    ``step`` is the whole model forward."""
    handles, starts, phase = [], {}, ["decode"]

    def step_pre(_m, args):
        phase[0] = "prefill" if args[0].shape[0] > batch else "decode"
        starts["step"] = time.perf_counter()

    def step_post(_m, _a, _o):
        totals[phase[0], "step"] += time.perf_counter() - starts["step"]

    handles += [model.register_forward_pre_hook(step_pre), model.register_forward_hook(step_post)]
    for name, mod in model.named_modules():
        kind = name.rpartition(".")[2]
        if kind not in KINDS:
            continue

        def pre(_m, _a, key=name):
            starts[key] = time.perf_counter()

        def post(_m, _a, _o, key=name, kind=kind):
            totals[phase[0], kind] += time.perf_counter() - starts[key]

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return handles


def main() -> None:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", default=str(ROOT / "examples" / "data" / "prompts.parquet"))
    parser.add_argument("--configs", default="bfloat16:none,bfloat16:w8a8")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--profiler", action="store_true", help="also print torch.profiler's top operators")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from jobrunner.bench.prompts import as_chat
    from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams
    from jobrunner.io.prompt_file import read_prompts

    prompts = [as_chat(row, raw=False) for row in read_prompts(args.prompts, args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    config = EngineConfig(device="cpu", max_num_seqs=args.batch, num_kv_blocks=64 * args.batch // 4 + 64,
                          enable_prefix_caching=False)
    for name in args.configs.split(","):
        dtype, scheme = name.split(":")
        engine = LLMEngine.from_source(args.source, dtype=dtype, quantization=scheme, config=config)
        ids = [engine.tokenize(p)[:256] for p in prompts]
        ids = [ids[i % len(ids)] for i in range(args.batch)]
        engine.generate(ids[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        print(f"== {name}: {sum(map(len, ids))} prompt tokens, {args.batch} x {args.max_tokens} output tokens")
        plain = float("inf")
        for _ in range(2):  # the first run also builds oneDNN primitives for new shapes
            start = time.perf_counter()
            engine.generate(ids, params)
            plain = min(plain, time.perf_counter() - start)
        totals: dict[str, float] = defaultdict(float)
        handles = _time_modules(engine.model, totals, args.batch)
        start = time.perf_counter()
        engine.generate(ids, params)
        hooked = time.perf_counter() - start
        for h in handles:
            h.remove()
        print(f"wall {plain:.3f} s ({args.batch * args.max_tokens / plain:.1f} tok/s); with hooks {hooked:.3f} s")
        for phase in ("prefill", "decode"):
            step = totals[phase, "step"]
            print(f"  {phase}: model forward {step:.3f} s ({step / hooked * 100:.1f}% of the wall time)")
            for kind in KINDS:
                print(f"    {kind:13s} {totals[phase, kind]:7.3f} s  {totals[phase, kind] / hooked * 100:5.1f}%")
            rest = step - sum(totals[phase, k] for k in KINDS if k != "lm_head")
            print(f"    {'non-linear':13s} {rest:7.3f} s  {rest / hooked * 100:5.1f}% (attention, norms, ...)")
        outside = hooked - totals["prefill", "step"] - totals["decode", "step"] - sum(
            totals[p, "lm_head"] for p in ("prefill", "decode"))
        print(f"  outside the model (sampling, scheduling) {outside:.3f} s {outside / hooked * 100:.1f}%")
        if args.profiler:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                engine.generate(ids, params)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        del engine


if __name__ == "__main__":
    main()
