"""Quantizers decide what is quantized and how, with torchao's PT2E annotation protocol.

The protocol classes are re-exported from ``torchao.quantization.pt2e.quantizer``, so
torchao's quantizers (``X86InductorQuantizer``, ...) work with ``quantkit.prepare``
and quantkit's quantizers work with torchao's ``prepare_pt2e``.

Schemes are registered units (``_scheme.py``): each config (``QuantConfig``, ``FP8Config``,
``WeightOnlyConfig``) is a :class:`SchemeConfig` that serializes to JSON and back and builds its
quantizer (``config.quantizer()``); presets (``w8a8``, ``w4a16``, ``fp8``, ...) are registered
beside their configs and listed by :func:`available_schemes`.
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

from ._scheme import (
    SchemeConfig,
    SchemeError,
    SchemeInfo,
    as_config,
    available_schemes,
    get_scheme,
    quantizer_for,
    register_scheme,
    scheme_info,
    unregister_scheme,
)
from ._config import QUANTIZABLE_OPS, ActivationScheme, Granularity, QuantConfig
from ._embedding import EmbeddingQuantizer
from ._w8a8 import W8A8Quantizer
# in this order: the presets register as they import (w8a8..., then w4a16, w8a16, nf4, then fp8, fp8-dynamic)
from ._weight_only import GroupSizeError, WeightOnlyConfig, WeightOnlyQuantizer
from ._fp8 import FP8Config, FP8Quantizer

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
    "SchemeConfig",
    "SchemeError",
    "SchemeInfo",
    "register_scheme",
    "unregister_scheme",
    "get_scheme",
    "scheme_info",
    "available_schemes",
    "as_config",
    "quantizer_for",
]
