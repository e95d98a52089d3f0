"""Measure quantization schemes side by side: weight bytes, perplexity, greedy agreement, output tokens/s.

``model_factory(scheme)`` returns an engine with the ``jobrunner.engine.LLMEngine`` API (``generate``,
``stats``, ``model``) whose model was quantized with ``scheme`` at load time. Perplexity runs the engine's own
model once per text as a single prefill (``jobrunner.engine.scoring``), so it measures the very layers the
engine decodes with.

Run it with ``jobrunner bench --compare-quantization none,int8,int4 --quality-texts ...``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from jobrunner.engine.scoring import sequence_logits
from jobrunner.models.onednn_linear import OneDnnLinear
from jobrunner.models.packed_linear import PackedLinear
from jobrunner.quant.apply import QUANTIZED_LINEARS
from jobrunner.quant.w8a8 import W8A8Linear

GREEDY_TOKENS = 32
THROUGHPUT_BATCHES = (1, 8, 64)
MAX_PPL_TOKENS = 512


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the linear weights (quantized or not; a bf16 layer on oneDNN's reordered weight counts its 2 bytes
    per weight) and of all unique parameters and buffers."""
    linear = 0
    for module in model.modules():
        if isinstance(module, (*QUANTIZED_LINEARS, PackedLinear, OneDnnLinear)):
            linear += module.weight_bytes()
        elif isinstance(module, torch.nn.Linear):
            linear += module.weight.numel() * module.weight.element_size()
    unique = {id(t): t for t in list(model.parameters()) + list(model.buffers())}  # tied/shared: once
    total = sum(t.numel() * t.element_size() for t in unique.values())
    # plus the W8A8 kernels' own weight copies, which are not buffers (oneDNN's prepacked weight, our tiles)
    total += sum(m.kernel_bytes() for m in model.modules() if isinstance(m, W8A8Linear))
    return {"linear_weight_bytes": linear, "model_weight_bytes": total}


def perplexity(model: torch.nn.Module, tokenizer, texts: Sequence[str]) -> float:
    """Token-level perplexity over ``texts`` (each cut to :data:`MAX_PPL_TOKENS` tokens)."""
    return score_texts(model, tokenizer, texts)[0]


def score_texts(model: torch.nn.Module, tokenizer, texts: Sequence[str]) -> tuple[float, list[torch.Tensor]]:
    """Perplexity over ``texts`` and the argmax token at every position of each (for top-1 agreement); each text
    is cut to :data:`MAX_PPL_TOKENS` tokens, or to the model's positions if it has fewer."""
    total_nll, total_tokens = 0.0, 0
    top1: list[torch.Tensor] = []
    limit = min(MAX_PPL_TOKENS, model.rotary.max_positions)
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:limit]
        if len(ids) < 2:
            continue
        logits = sequence_logits(model, ids)[:-1]
        targets = torch.tensor(ids[1:], device=logits.device)
        total_nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        total_tokens += len(ids) - 1
        top1.append(logits.argmax(-1).cpu())
    return math.exp(total_nll / max(total_tokens, 1)), top1


def _top1_agreement(top1: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Share of positions whose argmax equals the reference's: greedy agreement under teacher forcing,
    where one early flip cannot derail every later token (unlike :func:`agreement` on generations)."""
    same = sum(int((a == b).sum()) for a, b in zip(top1, reference, strict=True))
    return same / max(sum(len(a) for a in top1), 1)


def quality_by_name(engines: dict[str, Any], texts: Sequence[str]) -> dict[str, dict[str, float | int]]:
    """Perplexity of each engine's model on ``texts`` and its teacher-forced top-1 agreement with the first
    engine's (one prefill per text, as :func:`measure_quantization` scores them)."""
    out: dict[str, dict[str, float | int]] = {}
    reference: list[torch.Tensor] | None = None
    for name, engine in engines.items():
        ppl, top1 = score_texts(engine.model, engine.tokenizer, texts)
        reference = reference or top1
        out[name] = {"perplexity": ppl, "teacher_forced_top1_agreement": _top1_agreement(top1, reference),
                     "num_tokens": sum(len(t) for t in top1)}
    return out


def forced_decisions(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                     generated: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Feed each prompt plus its ``generated`` continuation; at every generated position return the model's
    own greedy choice and its top-1 minus top-2 logit gap (how close that decision was to a tie)."""
    choices: list[list[int]] = []
    gaps: list[list[float]] = []
    for prompt, gen in zip(prompt_ids, generated, strict=True):
        if not gen:
            choices.append([])
            gaps.append([])
            continue
        ids = list(prompt) + list(gen)
        logits = sequence_logits(model, ids)[len(prompt) - 1:len(ids) - 1]  # the logits that chose gen
        top2 = logits.topk(2, dim=-1)
        choices.append(top2.indices[:, 0].tolist())
        gaps.append((top2.values[:, 0] - top2.values[:, 1]).tolist())
    return choices, gaps


def decision_agreement(reference: Sequence[Sequence[int]], choices: Sequence[Sequence[int]],
                       reference_gaps: Sequence[Sequence[float]]) -> dict[str, float | int | None]:
    """Greedy agreement on the reference's own generated tokens.

    Both models read the same text (prompt + the reference's greedy tokens), so a single flip cannot derail
    the rest of the row as it does in free-running generation. ``gap_at_differences_*``: the reference's
    top-1 minus top-2 logit gap where the candidate chose differently (small = a near-tie).
    """
    flags = [a == b for ref, cand in zip(reference, choices, strict=True) for a, b in zip(ref, cand, strict=True)]
    all_gaps = [g for row in reference_gaps for g in row]
    differ = sorted(g for g, same in zip(all_gaps, flags, strict=True) if not same)
    return {"agreement": sum(flags) / max(len(flags), 1), "num_tokens": len(flags), "num_different": len(differ),
            "gap_at_differences_median": _median(differ), "gap_at_differences_max": differ[-1] if differ else None,
            "gap_median_all": _median(sorted(all_gaps))}


def _median(sorted_values: Sequence[float]) -> float | None:
    return sorted_values[len(sorted_values) // 2] if sorted_values else None


def greedy_tokens(engine, prompts: Sequence[Any], max_tokens: int = GREEDY_TOKENS) -> list[list[int]]:
    """The first ``max_tokens`` greedy tokens of each prompt (EOS ignored: every row has that length)."""
    from jobrunner.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(out.output_token_ids) for out in engine.generate(list(prompts), params)]


def agreement(reference: list[list[int]], candidate: list[list[int]]) -> dict[str, float]:
    """How far each candidate row follows the reference row.

    ``prefix``: mean share of tokens before the first difference (strict: one early flip counts as all
    later tokens lost); ``positional``: share of equal tokens position by position; ``exact``: share of rows
    that are identical.
    """
    prefix = positional = exact = 0.0
    for ref, cand in zip(reference, candidate, strict=True):
        n = max(len(ref), 1)
        same = [a == b for a, b in zip(ref, cand, strict=False)]
        first_diff = same.index(False) if False in same else len(same)
        prefix += first_diff / n
        positional += sum(same) / n
        exact += float(ref == cand)
    rows = max(len(reference), 1)
    return {"prefix": prefix / rows, "positional": positional / rows, "exact": exact / rows}


def output_tokens_per_s(engine, prompts: Sequence[Any], batch_size: int,
                        max_tokens: int = GREEDY_TOKENS) -> dict[str, float]:
    """Generate ``max_tokens`` for ``batch_size`` prompts at once; output tokens per wall second."""
    from jobrunner.engine import SamplingParams

    chosen = [prompts[i % len(prompts)] for i in range(batch_size)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = engine.stats().to_dict()
    start = time.perf_counter()
    outputs = engine.generate(chosen, params)
    wall_s = time.perf_counter() - start
    after = engine.stats().to_dict()
    num_out = sum(len(o.output_token_ids) for o in outputs)
    decode_s = after["decode_s"] - before["decode_s"]
    decode_tokens = after["num_decode_tokens"] - before["num_decode_tokens"]
    return {"output_tokens_per_s": num_out / wall_s, "wall_s": wall_s,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else float("nan")}


def measure_quantization(model_factory: Callable[[str], Any], tokenizer, texts: Sequence[str],
                         prompts: Sequence[Any], schemes: Sequence[str] = ("none", "int8", "int4"),
                         batch_sizes: Sequence[int] = THROUGHPUT_BATCHES,
                         max_tokens: int = GREEDY_TOKENS) -> dict[str, Any]:
    """Measure each scheme and compare it with the first one (normally ``none``); returns a JSON-able dict.

    Per scheme: weight bytes (linear and whole model, plus the quantization report summary when the engine
    records one), perplexity on ``texts``, greedy agreement of the first ``max_tokens`` tokens on ``prompts``
    against the first scheme (free-running, and as decisions on the first scheme's own tokens: see
    :func:`decision_agreement`), and output tokens/s at each batch size.
    """
    results: dict[str, Any] = {"schemes": {}}
    reference: list[list[int]] | None = None
    reference_top1: list[torch.Tensor] | None = None
    reference_gaps: list[list[float]] = []
    prompt_ids: list[list[int]] = []
    for scheme in schemes:
        _log(f"{scheme}: loading")
        engine = model_factory(scheme)
        prompt_ids = prompt_ids or [engine.tokenize(p) for p in prompts]
        row: dict[str, Any] = weight_bytes(engine.model)
        row["quantization_report"] = getattr(engine, "model_info", {}).get("quantization_report")
        ppl, top1 = score_texts(engine.model, tokenizer, texts)
        reference_top1 = reference_top1 or top1
        row["perplexity"] = ppl
        row["teacher_forced_top1_agreement"] = _top1_agreement(top1, reference_top1)
        _log(f"{scheme}: perplexity {ppl:.4f}, top-1 {row['teacher_forced_top1_agreement']:.4f}")
        generated = greedy_tokens(engine, prompt_ids, max_tokens)
        reference = reference or generated
        row["greedy_agreement"] = agreement(reference, generated)
        choices, gaps = forced_decisions(engine.model, prompt_ids, reference)
        reference_gaps = reference_gaps or gaps
        row["greedy_decision_agreement"] = decision_agreement(reference, choices, reference_gaps)
        _log(f"{scheme}: greedy agreement {row['greedy_agreement']}, "
             f"decisions {row['greedy_decision_agreement']}")
        row["throughput"] = {}
        for b in batch_sizes:
            row["throughput"][str(b)] = output_tokens_per_s(engine, prompt_ids, b, max_tokens)
            _log(f"{scheme}: batch {b}: {row['throughput'][str(b)]}")
        results["schemes"][scheme] = row
        del engine
    _add_ratios(results["schemes"], schemes[0])
    return results


def to_markdown(result: dict[str, Any]) -> str:
    """A side-by-side table of a :func:`measure_quantization` result (for reports and ``bench`` output)."""
    rows = result["schemes"]
    batches = sorted({b for row in rows.values() for b in row["throughput"]}, key=int)
    head = ["scheme", "linear MB", "model MB", "perplexity", "Δppl", "top-1 (teacher-forced)",
            "greedy decisions", "greedy prefix", "greedy positional", "exact rows"] + [f"tok/s b{b}" for b in batches]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in rows.items():
        agree = row["greedy_agreement"]
        cells = [name, f"{row['linear_weight_bytes'] / 1e6:.1f}", f"{row['model_weight_bytes'] / 1e6:.1f}",
                 f"{row['perplexity']:.4f}", f"{(row['perplexity_vs_base'] - 1) * 100:+.2f}%",
                 f"{row.get('teacher_forced_top1_agreement', float('nan')):.1%}",
                 f"{row.get('greedy_decision_agreement', {}).get('agreement', float('nan')):.1%}",
                 f"{agree['prefix']:.1%}",
                 f"{agree['positional']:.1%}", f"{agree['exact']:.1%}"]
        cells += [f"{row['throughput'][b]['output_tokens_per_s']:.2f}" if b in row["throughput"] else "—"
                  for b in batches]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _log(message: str) -> None:
    import sys

    print(f"[measure {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _add_ratios(rows: dict[str, dict[str, Any]], base: str) -> None:
    ref = rows[base]
    for row in rows.values():
        row["perplexity_vs_base"] = row["perplexity"] / ref["perplexity"]
        row["linear_bytes_vs_base"] = row["linear_weight_bytes"] / ref["linear_weight_bytes"]
        row["model_bytes_vs_base"] = row["model_weight_bytes"] / ref["model_weight_bytes"]


def engine_factory(source: str, dtype: str = "auto", device: str = "auto", max_num_seqs: int | None = None,
                   max_num_batched_tokens: int | None = None) -> Callable[[str], Any]:
    """A ``name -> LLMEngine`` function for :func:`measure_quantization`, prefix caching and speculation off.

    Names are :mod:`jobrunner.bench.quant_configs` configs: ``none`` | ``int8`` | ``int4`` | ``fp8`` | ``w8a8`` on
    ``dtype``; ``bf16``: unquantized in bfloat16, a control that shows how far a float dtype change alone moves
    the numbers; ``bfloat16:int4``: a dtype of its own; ``int4/lm_head=int8``: per-layer overrides;
    ``int4@int4=8``: crossovers of its own.
    """
    from jobrunner.bench.quant_configs import comparison_config, load_engine, parse_config

    config = comparison_config(device=device, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)

    def factory(name: str) -> Any:
        return load_engine(source, parse_config(name, dtype), config)

    return factory
