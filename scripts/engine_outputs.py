"""Greedy tokens and logprobs of the embedded model on every kernel path the switches choose on this CPU, as JSON.

For checking that a refactor of the native kernels (or of the engine's step loop) changes no output bit: run it
before and after, then compare the two files (``--compare``). Each path runs in its own child process (the
libraries and choices are cached per process), with its ``JOBRUNNER_*`` variables set:

* the CPU capabilities this machine can run (``JOBRUNNER_CPU_CAPABILITY``: its own, ``avx512``, ``avx2``,
  ``default``; a forced capability also compiles the C for that ISA and picks the dtype by it);
* each on/off switch that applies without AMX (native attention, its fast kernels, shared-prefix decodes,
  bf16 SDPA, native argmax, fused ops, oneDNN / packed linears, huge pages);
* int8 / int4 / w8a8 quantization with and without the native quant code, deterministic mode, n-gram drafts.

AMX-only switches (AMX GEMM, AMX attention, the layer loop) are skipped on a CPU without AMX (listed as such).
Runs take one thread by default (``--threads``); compare files made with the same thread count.

    .venv/bin/python scripts/engine_outputs.py --out before.json
    .venv/bin/python scripts/engine_outputs.py --out after.json
    .venv/bin/python scripts/engine_outputs.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's jobrunner, not an installed one
MODEL = "smollm2-135m-instruct"
NUM_TOKENS = 16
SHARED = ("You are a careful assistant who answers questions about arithmetic, history and science in short, "
          "plain sentences. Always show the steps of a calculation, name the units of every quantity, and say "
          "when a question has no single answer. Keep each answer under fifty words and never invent sources. "
          "If the question is ambiguous, pick the most common reading and say which one you picked. ") * 2
QUESTIONS = ["What is 17 times 23?", "Who built the first steam engine?", "Why is the sky blue?",
             "How many seconds are in a day?"]
ALONE = "Write one sentence about the sea."

# name -> (env, engine options); every run also sets speculative off unless it names another mode
PATHS: dict[str, tuple[dict[str, str], dict]] = {
    "detected": ({}, {}),
    "detected_float32": ({}, {"dtype": "float32"}),
    "cap_avx512": ({"JOBRUNNER_CPU_CAPABILITY": "avx512"}, {}),
    "cap_avx2": ({"JOBRUNNER_CPU_CAPABILITY": "avx2"}, {}),
    "cap_default": ({"JOBRUNNER_CPU_CAPABILITY": "default"}, {}),
    "cap_avx512_bf16_forced": ({"JOBRUNNER_CPU_CAPABILITY": "avx512_bf16"}, {}),
    "attention_native_off": ({"JOBRUNNER_ATTENTION_NATIVE": "0"}, {}),
    "attention_fast_off": ({"JOBRUNNER_ATTENTION_FAST": "0"}, {}),
    "attention_shared_off": ({"JOBRUNNER_ATTENTION_SHARED": "0"}, {}),
    "attention_bf16_sdpa_on": ({"JOBRUNNER_ATTENTION_BF16_SDPA": "1"}, {}),
    "attention_torch_backend": ({}, {"attention_backend": "torch"}),
    "native_argmax_off": ({"JOBRUNNER_NATIVE_ARGMAX": "0"}, {}),
    "fused_ops_off": ({"JOBRUNNER_FUSED_OPS": "0"}, {}),
    "fused_ops_off_float32": ({"JOBRUNNER_FUSED_OPS": "0"}, {"dtype": "float32"}),
    "onednn_linear_on": ({"JOBRUNNER_ONEDNN_LINEAR": "1"}, {}),
    "packed_gemm_on_float32": ({"JOBRUNNER_PACKED_GEMM": "1"}, {"dtype": "float32"}),
    "avx2_packed_gemm_off": ({"JOBRUNNER_CPU_CAPABILITY": "avx2", "JOBRUNNER_PACKED_GEMM": "0"}, {}),
    "huge_pages_all": ({"JOBRUNNER_HUGE_PAGES": "all"}, {}),
    "avx2_huge_pages_weights": ({"JOBRUNNER_CPU_CAPABILITY": "avx2", "JOBRUNNER_HUGE_PAGES": "weights"}, {}),
    "int8": ({}, {"quantization": "int8"}),
    "int8_quant_native_off": ({"JOBRUNNER_QUANT_NATIVE": "0"}, {"quantization": "int8"}),
    "int4": ({}, {"quantization": "int4"}),
    "int4_quant_native_off": ({"JOBRUNNER_QUANT_NATIVE": "0"}, {"quantization": "int4"}),
    "int4_no_w4a8": ({"JOBRUNNER_QUANT_KERNEL_TOKENS": "int4_int8=0"}, {"quantization": "int4"}),
    "w8a8": ({}, {"quantization": "w8a8"}),
    "avx2_int8": ({"JOBRUNNER_CPU_CAPABILITY": "avx2"}, {"quantization": "int8"}),
    "avx2_int4": ({"JOBRUNNER_CPU_CAPABILITY": "avx2"}, {"quantization": "int4"}),
    "avx2_int4_quant_native_off": ({"JOBRUNNER_CPU_CAPABILITY": "avx2", "JOBRUNNER_QUANT_NATIVE": "0"},
                                   {"quantization": "int4"}),
    "deterministic": ({}, {"deterministic": True}),
    "avx2_deterministic": ({"JOBRUNNER_CPU_CAPABILITY": "avx2"}, {"deterministic": True}),
    "fp8_kv_cache": ({}, {"kv_cache_dtype": "fp8_e4m3"}),
    "speculative_ngram": ({}, {"speculative": "ngram"}),
}
AMX_ONLY = ["JOBRUNNER_AMX_GEMM", "JOBRUNNER_ATTENTION_AMX", "JOBRUNNER_ATTENTION_AMX_DECODE", "JOBRUNNER_LAYER_LOOP"]


def run_path(options: dict) -> dict:
    """Generate greedily under the current environment: the shared-prefix prompt first alone (so the others
    find its blocks cached: prompt chunks after a cached prefix, decodes sharing prefix blocks), then the rest
    together, in chunks of at most 64 tokens (chunked prefill)."""
    import torch

    from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams

    torch.manual_seed(0)
    options = dict(options)
    dtype = options.pop("dtype", "auto")
    quantization = options.pop("quantization", "none")
    options.setdefault("speculative", "off")
    config = EngineConfig(device="cpu", max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=256, **options)
    engine = LLMEngine.from_source(MODEL, dtype=dtype, quantization=quantization, config=config)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [SHARED + q for q in QUESTIONS]
    outputs = engine.generate(prompts[:1], params) + engine.generate(prompts[1:] + [ALONE], params)
    info = engine.model_info
    return {
        "dtype": str(next(engine.model.parameters()).dtype),
        "info": {k: info[k] for k in ("dtype", "dtype_choice", "quant_dispatch", "attention_backend") if k in info},
        "outputs": [{"tokens": out.output_token_ids,
                     "logprobs": [lp.logprob for lp in out.logprobs or []],
                     "top": [[(t.token_id, t.logprob) for t in lp.top_logprobs] for lp in out.logprobs or []]}
                    for out in outputs],
    }


def run_all(names: list[str], out: Path, threads: int) -> None:
    results: dict[str, dict] = {"_skipped_amx_only": AMX_ONLY, "_threads": threads}
    has_amx = _detected() == "amx"
    for name in names:
        env_extra, options = PATHS[name]
        env = {k: v for k, v in os.environ.items() if not k.startswith("JOBRUNNER_") or k == "JOBRUNNER_CACHE"}
        env.update(env_extra, OMP_NUM_THREADS=str(threads))
        if has_amx and not env_extra.get("JOBRUNNER_CPU_CAPABILITY"):
            env.setdefault("JOBRUNNER_AMX_GEMM", "1")
        start = time.monotonic()
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(options)], env=env,
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            results[name] = {"env": env_extra, "options": options, "error": proc.stderr[-2000:]}
            print(f"{name}: FAILED\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results[name] = {"env": env_extra, "options": options, **result}
        first = result["outputs"][0]["tokens"][:6]
        print(f"{name}: {time.monotonic() - start:.1f}s dtype {result['dtype']} first tokens {first}", flush=True)
        out.write_text(json.dumps(results, indent=1) + "\n")


def _detected() -> str:
    try:
        from jobrunner.kernels import detect_cpu_capability
    except ImportError:  # before the kernels package existed
        from jobrunner.quant.capability import detect_cpu_capability
    return detect_cpu_capability()[0]


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name.startswith("_"):
            continue
        if name not in a or name not in b:
            print(f"{name}: only in {'after' if name in b else 'before'}")
            bad += 1
            continue
        same = a[name].get("outputs") == b[name].get("outputs") and "error" not in a[name] | b[name]
        print(f"{name}: {'identical' if same else 'DIFFERENT'}")
        bad += not same
    print(f"{bad} of {len([n for n in a if not n.startswith('_')])} paths differ")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("engine_outputs.json"))
    parser.add_argument("--paths", default="", help="comma-separated path names (default: all)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--threads", type=int, default=1,
                        help="OpenMP / torch threads per run (1 by default: on a loaded 2-core machine two threads "
                        "spin-wait each other and a run takes minutes; use 2 to cover the kernels' thread splits)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(run_path(json.loads(args.child))))
        return 0
    if args.compare:
        return compare(*args.compare)
    names = [n for n in args.paths.split(",") if n] or list(PATHS)
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}; known: {', '.join(PATHS)}")
    run_all(names, args.out, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
