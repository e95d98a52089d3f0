"""jobrunner.quant: int8 / int4 weight-only, CPU W8A8 and fp8 quantization (module swap), dispatched per machine.

Imports only torch.

``quantize_model(model, "int8" | "int4" | "fp8" | "w8a8" | "none", group_size=None, skip=())``
returns a :class:`QuantReport`.
"""

from jobrunner.quant.apply import DEFAULT_GROUP_SIZE, SCHEMES, check_scheme, quantize_model
from jobrunner.quant.dispatch import QuantDispatch, choose_cpu_dtype, cpu_profile, dispatch_for
from jobrunner.quant.embedding import Int8Embedding
from jobrunner.quant.fp8 import Fp8Linear
from jobrunner.quant.int4 import Int4WeightOnlyLinear
from jobrunner.quant.int8 import Int8WeightOnlyLinear
from jobrunner.quant.primitives import quantize_fp8_per_channel, quantize_int4_groupwise, quantize_int8_per_channel
from jobrunner.quant.report import LayerQuant, QuantReport
from jobrunner.quant.w8a8 import W8A8Linear

__all__ = [
    "DEFAULT_GROUP_SIZE", "SCHEMES", "Fp8Linear", "Int4WeightOnlyLinear", "Int8Embedding", "Int8WeightOnlyLinear",
    "LayerQuant", "QuantDispatch", "QuantReport", "W8A8Linear",
    "check_scheme", "choose_cpu_dtype", "cpu_profile", "dispatch_for", "quantize_fp8_per_channel",
    "quantize_int4_groupwise", "quantize_int8_per_channel", "quantize_model",
]
