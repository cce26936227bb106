"""Measuring and recovering accuracy: metrics, per-layer sensitivity, automatic float fallback,
SmoothQuant, the weight rounding algorithms (GPTQ, AWQ: ``rounding/``) and the numeric debugger
behind ``quantkit.debug``.

Public entry points are re-exported by ``quantkit`` (``sensitivity``, ``auto_fallback``,
``smooth_quant``) and by ``quantkit.metrics`` / ``quantkit.debug``. Importing this package
registers GPTQ and AWQ as calibration hooks (``from . import rounding``), so that
``quantkit.calibrate`` runs them whenever ``quantkit`` is imported.
"""

from . import rounding  # registers the GPTQ/AWQ calibration hooks

__all__ = ["rounding"]
