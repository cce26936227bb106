"""Numeric debugging: where a quantized model loses accuracy, layer by layer.

Example:
    >>> report = quantkit.debug.compare(model, qmodel, [(x,)])
    >>> print(report)          # table in graph order, with each layer's rank
    >>> report.worst.layer     # the layer with the lowest SQNR
"""

from .accuracy._numeric_debug import ActivationRange, LayerReport, LayerRow, compare

__all__ = ["compare", "LayerReport", "LayerRow", "ActivationRange"]
