"""`jobrunner bench --compare-quantization`: quantization schemes side by side with the float model.

For each config (:mod:`jobrunner.bench.quant_configs`: ``int4``, ``bfloat16:int4``, ...; the first is the
unquantized reference, normally ``none``): weight bytes, perplexity on held-out text,
greedy agreement of the first 32 tokens on the bench prompts (free-running, and as decisions on the
reference's own tokens), and output tokens/s at a few batch sizes. The measuring itself lives in
:mod:`jobrunner.bench.quant_measure`; this module feeds it the bench's prompt rows and options.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobrunner.bench.ours import EngineOptions
from jobrunner.bench.prompts import PromptRow, as_chat
from jobrunner.bench.quant_configs import parse_configs
from jobrunner.bench.quant_measure import GREEDY_TOKENS, engine_factory, measure_quantization

QUALITY_SCHEMES = ("none", "int8", "int4")
QUALITY_BATCHES = (1, 8, 64)


def run_quality(engine: EngineOptions, prompts: Sequence[PromptRow], texts: Sequence[str],
                schemes: Sequence[str] = QUALITY_SCHEMES, batch_sizes: Sequence[int] = QUALITY_BATCHES,
                raw_prompts: bool = False, max_tokens: int = GREEDY_TOKENS) -> dict[str, Any]:
    """Measure ``schemes`` on ``engine``'s model; the result of :func:`measure_quantization` plus settings."""
    parse_configs(schemes, engine.dtype)  # ValueError on a bad name, or a first config that is quantized
    factory = engine_factory(engine.model, engine.dtype, engine.device, engine.max_num_seqs,
                             engine.max_num_batched_tokens)
    tokenizer = factory("none").tokenizer
    chats = [as_chat(row, raw_prompts) for row in prompts]
    result = measure_quantization(factory, tokenizer, texts, chats, schemes, batch_sizes, max_tokens)
    result["settings"] = {"model": engine.model, "dtype": engine.dtype, "device": engine.device,
                          "num_prompts": len(chats), "num_texts": len(texts), "greedy_tokens": max_tokens,
                          "batch_sizes": list(batch_sizes), "prefix_caching": False, "speculative": "off"}
    return result
