"""Engine output tokens/s per quantization scheme at batch 1, 8 and 64: this CPU's dispatch, then AVX2 forced.

``jobrunner bench --quant-dispatch native,avx2 --compare-quantization none,int8,int4`` loads one engine per
scheme side by side (float32 model, greedy, EOS ignored) and, for each batch size, runs the schemes in turn
twice, keeping the best. It does
that twice, each in a fresh process: with this machine's own capability (``native``), and with
``JOBRUNNER_CPU_CAPABILITY=avx2`` plus torch's and oneDNN's/MKL's own ISA caps (``ATEN_CPU_CAPABILITY=avx2``,
``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``), which makes an AVX512 machine choose and run
the kernels an AVX2-only CPU would (bf16 GEMM then runs without bf16 instructions, as on an AMD EPYC).
It prints one table per capability with each scheme's ratio to float32 and the targets: faster than float32
at batch 1, at most 15% slower at batch 64.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

AVX2_ENV = {"JOBRUNNER_CPU_CAPABILITY": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
MAX_PROMPT_TOKENS = 256  # keeps the KV cache of four side-by-side engines small
TARGET_B1 = 1.0  # quantized / float32 output tok/s at batch 1: must be above
TARGET_B64 = 0.85  # ... at batch 64: must be at least


def measure_here(source: str, schemes: Sequence[str], batches: Sequence[int], max_tokens: int,
                 prompts: Sequence[Any], rounds: int, dtype: str = "float32") -> dict[str, Any]:
    """Best output tok/s per (scheme, batch size) in this process, schemes interleaved per round."""
    import torch

    from jobrunner.bench.quant_measure import output_tokens_per_s
    from jobrunner.engine import EngineConfig, LLMEngine
    from jobrunner.quant.dispatch import cpu_profile

    engines: dict[str, Any] = {}
    token_ids: list[list[int]] = []
    for scheme in schemes:
        if not token_ids:
            probe = LLMEngine.from_source(source, dtype=dtype, config=EngineConfig(device="cpu", num_kv_blocks=4))
            token_ids = [probe.tokenize(p)[:MAX_PROMPT_TOKENS] for p in prompts]
            del probe
        blocks = sum(-(-(len(ids) + max_tokens) // 16) + 1 for ids in _batch(token_ids, max(batches)))
        config = EngineConfig(device="cpu", max_num_seqs=max(batches), num_kv_blocks=blocks,
                              enable_prefix_caching=False)
        engines[scheme] = LLMEngine.from_source(source, dtype=dtype, quantization=scheme, config=config)
        output_tokens_per_s(engines[scheme], token_ids, 2, 2)  # warm-up: first-call allocations, JIT
    best: dict[str, dict[str, float]] = {s: {} for s in schemes}
    for b in batches:
        for _ in range(rounds):
            for scheme, engine in engines.items():
                tok_s = output_tokens_per_s(engine, _batch(token_ids, b), b, max_tokens)["output_tokens_per_s"]
                best[scheme][str(b)] = max(best[scheme].get(str(b), 0.0), tok_s)
    return {"profile": cpu_profile().to_dict(), "threads": torch.get_num_threads(), "tok_s": best,
            "dispatch": {s: e.model_info.get("quant_dispatch") for s, e in engines.items()},
            "dtype": {s: e.model_info.get("dtype") for s, e in engines.items()}}


def _batch(token_ids: list[list[int]], size: int) -> list[list[int]]:
    return [token_ids[i % len(token_ids)] for i in range(size)]


def run_dispatch(source: str, schemes: Sequence[str], batches: Sequence[int], max_tokens: int,
                 prompts: Sequence[Any], rounds: int, capabilities: Sequence[str],
                 log: Any = None) -> dict[str, dict[str, Any]]:
    """:func:`measure_here` once per capability (``native``, ``avx2``), each in a fresh process."""
    job = {"source": source, "schemes": list(schemes), "batches": list(batches), "max_tokens": max_tokens,
           "prompts": list(prompts), "rounds": rounds}
    results = {}
    for capability in capabilities:
        if log is not None:
            log(f"[quant dispatch {time.strftime('%H:%M:%S')}] {capability} ...")
        results[capability] = run_child(capability, job)
    return results


def run_child(capability: str, job: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`measure_here` in a fresh process (``native`` or ``avx2``) and return its JSON."""
    if capability not in ("native", "avx2"):
        raise ValueError(f"capability {capability!r}: native or avx2")
    env = dict(os.environ)
    for name in AVX2_ENV:
        env.pop(name, None)
    if capability == "avx2":
        env.update(AVX2_ENV)
    code = "import sys; from jobrunner.bench.quant_dispatch import child; child(sys.stdin.read())"
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(job), env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{capability} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(job_json: str) -> None:
    """The child process of :func:`run_child`: measure here, print one JSON line."""
    job = json.loads(job_json)
    print(json.dumps(measure_here(job["source"], job["schemes"], job["batches"], job["max_tokens"],
                                  job["prompts"], job["rounds"])))


def render(label: str, result: dict[str, Any], base: str = "none") -> str:
    """One capability's table: tok/s, ratio to ``base`` (float32) per batch size, and the targets."""
    tok_s = result["tok_s"]
    batches = list(tok_s[base])
    profile = result["profile"]
    lines = [f"## {label}: capability {profile['capability']} (forced {profile['forced']}), fast bf16 "
             f"{profile['fast_bf16']}, threads {result['threads']}, calibration {profile['calibration']}",
             "| scheme | " + " | ".join(f"tok/s b{b}" for b in batches) + " | "
             + " | ".join(f"vs float32 b{b}" for b in batches) + " | targets |",
             "|---" * (2 * len(batches) + 2) + "|"]
    for scheme, row in tok_s.items():
        ratios = {b: row[b] / tok_s[base][b] for b in batches}
        lines.append(f"| {scheme} | " + " | ".join(f"{row[b]:.1f}" for b in batches) + " | "
                     + " | ".join(f"{ratios[b]:.2f}x" for b in batches) + f" | {_targets(scheme, ratios)} |")
    for scheme, dispatch in result["dispatch"].items():
        if dispatch:
            limit = dispatch["max_kernel_tokens"].get(scheme)
            kernel = f"weight-only kernel up to {limit} tokens, then " if limit is not None else ""
            lines.append(f"* {scheme} (model {result['dtype'][scheme]}): {kernel}dequantized tiles in "
                         f"{dispatch['dequant_dtype']}" + (" (fp8: _scaled_mm)" if dispatch["fp8_native"] else ""))
    return "\n".join(lines)


def _targets(scheme: str, ratios: dict[str, float]) -> str:
    if scheme == "none":
        return "reference"
    if scheme not in ("int8", "int4"):
        return "—"  # the targets are for the weight-only schemes; fp8 on CPU is a correctness fallback
    checks = []
    if "1" in ratios:
        checks.append(f"b1 {'ok' if ratios['1'] > TARGET_B1 else 'MISSED'}")
    if "64" in ratios:
        checks.append(f"b64 {'ok' if ratios['64'] >= TARGET_B64 else 'MISSED'}")
    return ", ".join(checks) or "—"
