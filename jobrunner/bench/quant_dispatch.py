"""Engine output tokens/s per quantization config at batch 1, 8 and 64, per CPU capability, each in a fresh process.

``jobrunner bench --quant-dispatch native,avx2 --compare-quantization float32:none,bfloat16:none,bfloat16:int4``
loads one engine per config (:mod:`jobrunner.bench.quant_configs`: a bare scheme runs on ``--dtype``; greedy,
EOS ignored, prefix caching and speculation off) side by side and, for each batch size, runs the configs in turn
twice, keeping the best. It does that once per capability, each in a fresh process: ``native`` (this machine's
own); ``avx2``: ``JOBRUNNER_CPU_CAPABILITY=avx2`` plus torch's and oneDNN's/MKL's own ISA caps
(``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``), which makes an
AVX512 machine choose and run the kernels an AVX2-only CPU would (bf16 GEMM then runs without bf16 instructions,
as on an AMD EPYC); any other capability of :data:`jobrunner.kernels.CPU_CAPABILITIES`
(``avx512_vnni``: what a Cascade Lake would choose) forces our dispatch only. With held-out texts it also
scores each config's perplexity and teacher-forced top-1 against the first config, in that capability's process
(a forced capability changes the kernels, so the numbers: w8a8 runs int8 weight-only without VNNI).

It prints one table per capability with each config's ratio to the best unquantized config at that batch size
and the targets: faster than it at batch 1, at most 15% slower at batch 64.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from jobrunner.kernels import CAPABILITY_ENV, CPU_CAPABILITIES

AVX2_ENV = {CAPABILITY_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
CAPABILITIES = ("native", *CPU_CAPABILITIES)
MAX_PROMPT_TOKENS = 256  # keeps the KV cache of several side-by-side engines small
TARGET_B1 = 1.0  # quantized / best float output tok/s at batch 1: must be above
TARGET_B64 = 0.85  # ... at batch 64: must be at least
TARGET_SCHEMES = ("int8", "int4", "w8a8")  # fp8 on CPU is a correctness fallback, not a speed path


def measure_here(source: str, schemes: Sequence[str], batches: Sequence[int], max_tokens: int,
                 prompts: Sequence[Any], rounds: int, dtype: str = "float32",
                 texts: Sequence[str] | None = None) -> dict[str, Any]:
    """Best output tok/s per (config, batch size) in this process, configs interleaved per round; with
    ``texts``, also each config's perplexity and top-1 (:func:`jobrunner.bench.quant_measure.quality_by_name`).
    ``schemes`` are :mod:`jobrunner.bench.quant_configs` names; a bare scheme runs on ``dtype``."""
    import torch

    from jobrunner.bench.quant_configs import parse_configs
    from jobrunner.bench.quant_measure import quality_by_name
    from jobrunner.quant.dispatch import cpu_profile

    configs = parse_configs(schemes, dtype)
    token_ids = _token_ids(source, prompts)
    engines = _load_side_by_side(source, configs, token_ids, max(batches), max_tokens)
    best = _best_tok_s(engines, token_ids, batches, max_tokens, rounds)
    result = {"profile": cpu_profile().to_dict(), "threads": torch.get_num_threads(), "tok_s": best,
              "dispatch": {s: e.model_info.get("quant_dispatch") for s, e in engines.items()},
              "dtype": {s: e.model_info.get("dtype") for s, e in engines.items()}}
    if texts:
        result["quality"] = quality_by_name(engines, texts)
    return result


def _token_ids(source: str, prompts: Sequence[Any]) -> list[list[int]]:
    """Each prompt's token ids (cut to :data:`MAX_PROMPT_TOKENS`), from a probe engine's tokenizer."""
    from jobrunner.engine import EngineConfig, LLMEngine

    probe = LLMEngine.from_source(source, dtype="float32", config=EngineConfig(device="cpu", num_kv_blocks=4))
    return [probe.tokenize(p)[:MAX_PROMPT_TOKENS] for p in prompts]


def _load_side_by_side(source: str, configs: Sequence[Any], token_ids: list[list[int]], max_batch: int,
                       max_tokens: int) -> dict[str, Any]:
    """One engine per config, each with KV blocks for the largest batch, warmed up."""
    from jobrunner.bench.quant_configs import comparison_config, load_engine
    from jobrunner.bench.quant_measure import output_tokens_per_s

    blocks = sum(-(-(len(ids) + max_tokens) // 16) + 1 for ids in _batch(token_ids, max_batch))
    engine_config = comparison_config(device="cpu", max_num_seqs=max_batch, num_kv_blocks=blocks)
    engines = {}
    for config in configs:
        engines[config.name] = load_engine(source, config, engine_config)
        output_tokens_per_s(engines[config.name], token_ids, 2, 2)  # warm-up: first-call allocations, JIT
    return engines


def _best_tok_s(engines: dict[str, Any], token_ids: list[list[int]], batches: Sequence[int], max_tokens: int,
                rounds: int) -> dict[str, dict[str, float]]:
    """Per config and batch size, the best output tok/s of ``rounds`` runs, the engines taking turns."""
    from jobrunner.bench.quant_measure import output_tokens_per_s

    best: dict[str, dict[str, float]] = {name: {} for name in engines}
    for b in batches:
        for _ in range(rounds):
            for name, engine in engines.items():
                tok_s = output_tokens_per_s(engine, _batch(token_ids, b), b, max_tokens)["output_tokens_per_s"]
                best[name][str(b)] = max(best[name].get(str(b), 0.0), tok_s)
    return best


def _batch(token_ids: list[list[int]], size: int) -> list[list[int]]:
    return [token_ids[i % len(token_ids)] for i in range(size)]


def check_capabilities(capabilities: Sequence[str]) -> list[str]:
    """``capabilities`` if each is ``native`` or a forced CPU capability, else ``ValueError``."""
    if not capabilities or any(c not in CAPABILITIES for c in capabilities):
        raise ValueError(f"{','.join(capabilities)!r}: comma-separated, of {'|'.join(CAPABILITIES)}")
    return list(capabilities)


def capability_env(capability: str, base: dict[str, str]) -> dict[str, str]:
    """``base`` (the parent's environment) for a child that runs as ``capability`` (see the module docstring)."""
    env = {k: v for k, v in base.items() if k not in AVX2_ENV}
    if capability == "avx2":
        env.update(AVX2_ENV)
    elif capability != "native":
        env[CAPABILITY_ENV] = capability
    return env


def run_dispatch(source: str, schemes: Sequence[str], batches: Sequence[int], max_tokens: int,
                 prompts: Sequence[Any], rounds: int, capabilities: Sequence[str],
                 log: Any = None, dtype: str = "float32",
                 texts: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """:func:`measure_here` once per capability, each in a fresh process."""
    job = {"source": source, "schemes": list(schemes), "batches": list(batches), "max_tokens": max_tokens,
           "prompts": list(prompts), "rounds": rounds, "dtype": dtype, "texts": list(texts or [])}
    results = {}
    for capability in check_capabilities(capabilities):
        if log is not None:
            log(f"[quant dispatch {time.strftime('%H:%M:%S')}] {capability} ...")
        results[capability] = run_child(capability, job)
    return results


def run_child(capability: str, job: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`measure_here` in a fresh process as ``capability`` and return its JSON."""
    check_capabilities([capability])
    env = capability_env(capability, dict(os.environ))
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
                                  job["prompts"], job["rounds"], job["dtype"], job["texts"])))


def render(label: str, result: dict[str, Any]) -> str:
    """One capability's table: tok/s and the ratio to the best unquantized config per batch size, the targets,
    and perplexity / top-1 when measured."""
    tok_s, quality = result["tok_s"], result.get("quality") or {}
    batches = list(next(iter(tok_s.values())))
    best_float = _best_float(tok_s)
    profile = result["profile"]
    lines = [f"## {label}: capability {profile['capability']} (forced {profile['forced']}), fast bf16 "
             f"{profile['fast_bf16']}, threads {result['threads']}, calibration {profile['calibration']}",
             "| config | " + " | ".join(f"tok/s b{b}" for b in batches) + " | "
             + " | ".join(f"vs best float b{b}" for b in batches) + " | targets |"
             + (" perplexity | Δppl | top-1 |" if quality else ""),
             "|---" * (2 * len(batches) + 2 + (3 if quality else 0)) + "|"]
    for name, row in tok_s.items():
        ratios = {b: row[b] / best_float[b] for b in batches}
        lines.append(f"| {name} | " + " | ".join(f"{row[b]:.1f}" for b in batches) + " | "
                     + " | ".join(f"{ratios[b]:.2f}x" for b in batches) + f" | {_targets(name, ratios)} |"
                     + (_quality_cells(quality, name) if quality else ""))
    return "\n".join(lines + _dispatch_notes(result))


def _best_float(tok_s: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per batch size, the best tok/s of the unquantized configs (the first config is one)."""
    from jobrunner.bench.quant_configs import parse_config

    floats = [row for name, row in tok_s.items() if not parse_config(name).is_quantized]
    return {b: max(row[b] for row in floats) for b in next(iter(tok_s.values()))}


def _quality_cells(quality: dict[str, dict[str, Any]], name: str) -> str:
    """`` perplexity | Δ vs the first config | top-1 |`` of one config."""
    row, ref = quality[name], next(iter(quality.values()))
    delta = (row["perplexity"] / ref["perplexity"] - 1) * 100
    return f" {row['perplexity']:.4f} | {delta:+.2f}% | {row['teacher_forced_top1_agreement']:.1%} |"


def _dispatch_notes(result: dict[str, Any]) -> list[str]:
    """One line per quantized config: how far its weight-only kernel runs and the dtype of its tiles."""
    from jobrunner.bench.quant_configs import parse_config

    lines = []
    for name, dispatch in result["dispatch"].items():
        if dispatch:
            limit = dispatch["max_kernel_tokens"].get(parse_config(name).scheme)
            kernel = f"weight-only kernel up to {limit} tokens, then " if limit is not None else ""
            lines.append(f"* {name} (model {result['dtype'][name]}): {kernel}dequantized tiles in "
                         f"{dispatch['dequant_dtype']}" + (" (fp8: _scaled_mm)" if dispatch["fp8_native"] else ""))
    return lines


def _targets(name: str, ratios: dict[str, float]) -> str:
    """``b1 ok, b64 MISSED``: a quantized config's ratios against :data:`TARGET_B1` and :data:`TARGET_B64`."""
    from jobrunner.bench.quant_configs import parse_config

    scheme = parse_config(name).scheme
    if scheme == "none":
        return "float"
    if scheme not in TARGET_SCHEMES:
        return "—"
    checks = []
    if "1" in ratios:
        checks.append(f"b1 {'ok' if ratios['1'] > TARGET_B1 else 'MISSED'}")
    if "64" in ratios:
        checks.append(f"b64 {'ok' if ratios['64'] >= TARGET_B64 else 'MISSED'}")
    return ", ".join(checks) or "—"
