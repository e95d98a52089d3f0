"""What ``model.quantization: int8`` runs: the int8 scheme that is fastest on this machine, unless pinned.

``int8`` stores int8 per-channel weights. How the activations meet them is a speed / quality trade the machine
decides:

* on CPUs with int8 dot-product hardware and bf16 activations (capability ``avx512_bf16``: AMD Zen 4 / Zen 5;
  ``amx``: Sapphire Rapids and later), ``w8a8``: each row quantized to int8 per token and one int8 GEMM (the
  AVX-512 VNNI kernel on ``avx512_bf16``, oneDNN's AMX-INT8 GEMM on ``amx``), ~2x the int8 products per
  instruction of the bf16 ones. Measured (48 ShareGPT prompts x 32 tokens, EOS ignored, SmolLM2-135M, 2 cores):
  on a Zen 4 w8a8 1.47x / 1.55x of bf16 where int8 weight-only ran 0.69x-0.75x; on a Sapphire Rapids (issue 50's
  measurement, before the VNNI kernel) w8a8 0.63x where int8 weight-only ran 0.41x. Its quality cost on
  SmolLM2-135M against float32 (docs/quantization.md): perplexity +1.94% and teacher-forced top-1 92.0%, where
  int8 weight-only gives +0.15% and 96.9%;
* elsewhere (no VNNI / AMX, float32 models, CUDA), int8 weight-only, as before.

``model.quantization: int8_weight_only`` pins weight-only everywhere (bf16 activations, the smaller quality
cost); ``w8a8`` asks for per-token activations everywhere they have a kernel. The choice is a pure function of the
capability, the device and the dtype (never a timing) and is recorded in the manifest's model info
(``quantization`` the scheme run, ``quantization_requested``, ``quantization_choice`` the reason).
"""

from __future__ import annotations

import torch

from jobrunner.quant.dispatch import dispatch_for

INT8_WEIGHT_ONLY = "int8_weight_only"
# capabilities where w8a8 was measured faster than int8 weight-only at decode batches (module doc)
W8A8_FOR_INT8 = ("avx512_bf16", "amx")


def resolve_int8(scheme: str, device: torch.device, dtype: torch.dtype,
                 capability: str | None = None) -> tuple[str, str | None]:
    """``(the scheme the load runs, why it differs from scheme)``: ``int8`` -> ``w8a8`` where it is faster
    (module doc), ``int8_weight_only`` -> ``int8``; any other scheme unchanged (reason None)."""
    if scheme == INT8_WEIGHT_ONLY:
        return "int8", f"{INT8_WEIGHT_ONLY}: int8 weights, activations in {str(dtype).removeprefix('torch.')}"
    if scheme != "int8" or device.type != "cpu" or dtype != torch.bfloat16:
        return scheme, None
    dispatch = dispatch_for(device, capability)
    if dispatch.capability not in W8A8_FOR_INT8 or dispatch.w8a8_kernel is None:
        return scheme, None
    return "w8a8", (f"int8 on {dispatch.capability}: w8a8 (per-token int8 activations, {dispatch.w8a8_kernel} "
                    f"GEMM), faster than int8 weight-only at every batch measured; model.quantization: "
                    f"{INT8_WEIGHT_ONLY} keeps bf16 activations")
