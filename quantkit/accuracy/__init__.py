"""Measuring and recovering accuracy: metrics, per-layer sensitivity, automatic float fallback,
SmoothQuant, and the numeric debugger behind ``quantkit.debug``.

Public entry points are re-exported by ``quantkit`` (``sensitivity``, ``auto_fallback``,
``smooth_quant``) and by ``quantkit.metrics`` / ``quantkit.debug``.
"""

__all__: list[str] = []
