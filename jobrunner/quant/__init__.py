"""jobrunner.quant: int8 / int4 weight-only quantization (state-dict transform + module swap).

Imports only torch.

``quantize_model(model, "int8" | "int4" | "none", group_size=None, skip=())`` returns a :class:`QuantReport`.
"""

from jobrunner.quant.apply import DEFAULT_GROUP_SIZE, SCHEMES, check_scheme, quantize_model
from jobrunner.quant.embedding import Int8Embedding
from jobrunner.quant.int4 import Int4WeightOnlyLinear, quantize_int4_groupwise
from jobrunner.quant.int8 import Int8WeightOnlyLinear, quantize_int8_per_channel
from jobrunner.quant.report import LayerQuant, QuantReport

__all__ = [
    "DEFAULT_GROUP_SIZE", "SCHEMES", "Int4WeightOnlyLinear", "Int8Embedding", "Int8WeightOnlyLinear",
    "LayerQuant", "QuantReport",
    "check_scheme", "quantize_int4_groupwise", "quantize_int8_per_channel", "quantize_model",
]
