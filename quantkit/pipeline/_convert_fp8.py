"""Former home of convert's FP8 path; it lives in :mod:`quantkit.pipeline.emit._float8` (kind
``"float8"``) and the op sets in :mod:`quantkit._graph`. These names stay importable from here."""

from __future__ import annotations

from .._graph import FLOAT8_CHOOSE_OPS, FLOAT8_DEQUANTIZE_OPS, FLOAT8_QUANTIZE_OPS
from .emit._float8 import emit_float8

__all__ = ["emit_float8", "FLOAT8_QUANTIZE_OPS", "FLOAT8_DEQUANTIZE_OPS", "FLOAT8_CHOOSE_OPS", "is_float8_observer"]


def is_float8_observer(obs) -> bool:
    """Whether ``obs`` declares that it quantizes onto the float8 grid (``float8_rounding``)."""
    return bool(getattr(obs, "float8_rounding", False))
