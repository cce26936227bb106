"""Errors raised by quantkit for user mistakes.

Every message is one line: what is wrong, then what to do about it.
"""

__all__ = ["QuantkitError", "CaptureError", "CalibrationError", "ConvertError", "DistributedError", "KVCacheError"]


class QuantkitError(ValueError):
    """Base class of quantkit's user-facing errors."""


class CaptureError(QuantkitError):
    """The model could not be captured with torch.export."""


class CalibrationError(QuantkitError):
    """Calibration could not run, or saw data that cannot be quantized (NaN, inf, nothing)."""


class ConvertError(QuantkitError):
    """The prepared model cannot be converted (for example, it was never calibrated)."""


class DistributedError(QuantkitError):
    """The ranks of a distributed run disagree (weights, recipe, data), or a rank failed or stopped."""


class KVCacheError(QuantkitError):
    """A call does not fit a program's static KV cache (too long, past its end, wrong batch)."""
