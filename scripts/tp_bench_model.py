"""A random model with SmolLM2-135M's shape that splits over 2, 4 or 8 tensor-parallel ranks, for `jobrunner bench`
at engine.tensor_parallel_size > 1 (SmolLM2-135M's own 9 q heads / 3 KV heads split over 3 ranks only, and vLLM
refuses it at 2). 30 layers, hidden 576, intermediate 1536, vocabulary 49,152 (tied), SmolLM2's tokenizer and chat
template; 8 q heads and 4 KV heads of 64 instead of 9 and 3 (the same 134.5 M parameters). Seeded random weights:
the texts mean nothing, the work per token is SmolLM2's (bench with --ignore-eos).

    .venv/bin/python scripts/tp_bench_model.py OUT_DIR
    .venv/bin/jobrunner bench --model OUT_DIR --prompts PROMPTS --ignore-eos --engine jobrunner,vllm \\
        --tensor-parallel-size 2
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main(out: str) -> None:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from jobrunner.models.sources import resolve_model_dir

    source = Path(resolve_model_dir("smollm2-135m-instruct"))
    config = AutoConfig.from_pretrained(source)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 4, 64
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, Path(out) / name)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")


if __name__ == "__main__":
    main(sys.argv[1])
