"""Pre-quantized checkpoints loaded as they are: compressed-tensors FP8, GPTQ and AWQ int4 (torch only).

:func:`read_checkpoint_quant` reads (or refuses, in one line) a config.json's ``quantization_config``;
:func:`resolve_scheme` checks it against the spec's ``model.quantization``; :func:`build_int4` /
:func:`build_fp8` make our layer for one (fused) linear from its checkpoint tensors. The streamed loader's
transform that calls them is ``jobrunner.models.prequantized.PrequantizedLoad`` (quant imports no model code).
"""

from jobrunner.quant.prequantized.formats import CheckpointQuant, read_checkpoint_quant, resolve_scheme
from jobrunner.quant.prequantized.layers import ExactInt4Linear, build_fp8, build_int4

__all__ = ["CheckpointQuant", "ExactInt4Linear", "build_fp8", "build_int4", "read_checkpoint_quant",
           "resolve_scheme"]
