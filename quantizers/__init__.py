"""Quantizers decide what is quantized and how, with torchao's PT2E annotation protocol.

The protocol classes are re-exported from ``torchao.quantization.pt2e.quantizer``, so
torchao's quantizers (``X86InductorQuantizer``, ...) work with ``quantkit.prepare``
and quantkit's quantizers work with torchao's ``prepare_pt2e``.
"""

from torchao.quantization.pt2e.quantizer import (
    DerivedQuantizationSpec,
    EdgeOrNode,
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    QuantizationSpecBase,
    Quantizer,
    SharedQuantizationSpec,
)

from ._config import QUANTIZABLE_OPS, ActivationScheme, Granularity, QuantConfig
from ._embedding import EmbeddingQuantizer
from ._fp8 import FP8Config, FP8Quantizer
from ._w8a8 import W8A8Quantizer
from ._weight_only import GroupSizeError, WeightOnlyConfig, WeightOnlyQuantizer

__all__ = [
    "Quantizer",
    "QuantizationSpecBase",
    "QuantizationSpec",
    "SharedQuantizationSpec",
    "DerivedQuantizationSpec",
    "FixedQParamsQuantizationSpec",
    "QuantizationAnnotation",
    "EdgeOrNode",
    "W8A8Quantizer",
    "EmbeddingQuantizer",
    "FP8Quantizer",
    "FP8Config",
    "WeightOnlyQuantizer",
    "WeightOnlyConfig",
    "GroupSizeError",
    "QuantConfig",
    "ActivationScheme",
    "Granularity",
    "QUANTIZABLE_OPS",
]
