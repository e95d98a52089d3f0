"""Random PEFT LoRA adapters for the LoRA tests (engine parity and jobs), made by peft itself."""

from __future__ import annotations

import torch

from tests.components import require_import


def save_random_adapter(base: torch.nn.Module, out_dir, seed: int, scale: float = 0.3, **config) -> torch.nn.Module:
    """A peft LoRA of ``base`` (``config``: LoraConfig fields) with random A and B (peft starts B at zero), saved
    to ``out_dir``; the peft model, in eval mode. peft is a promised test dependency: missing, it skips the test
    on a developer's machine and fails it under CI."""
    peft = require_import("peft", "LoRA tests make their adapters with peft (the [test] extra)")
    model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(str(out_dir))
    return model.eval()
