"""The quantization pipeline: capture, prepare (annotations to observers, BN folding), calibrate, convert.

Also the graph helpers those steps share: normalising inputs, module scopes, quantizable layers,
and variants of one model that keep chosen layers float. The public entry points are re-exported
by ``quantkit`` itself (``quantkit.quantize``, ``prepare``, ``calibrate``, ``convert``, ``capture``).

The calibration seam is public here: :func:`register_calibration_hook` (``before_pass``,
``after_block``, ``after_pass``; see ``_hooks``), through which GPTQ and AWQ join ``calibrate``.
"""

from ._hooks import WHEN, BlockRun, CalibrationRun, calibration_hooks, register_calibration_hook

__all__ = ["WHEN", "BlockRun", "CalibrationRun", "calibration_hooks", "register_calibration_hook"]
