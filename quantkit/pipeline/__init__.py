"""The quantization pipeline: capture, prepare (annotations to observers, BN folding), calibrate, convert.

Also the graph helpers those steps share: normalising inputs, module scopes, quantizable layers,
and variants of one model that keep chosen layers float. The public entry points are re-exported
by ``quantkit`` itself (``quantkit.quantize``, ``prepare``, ``calibrate``, ``convert``, ``capture``).

The calibration seam is public here: :func:`register_calibration_hook` (``before_pass``,
``after_block``, ``after_pass``; see ``_hooks``), through which GPTQ and AWQ join ``calibrate``.

Causal LMs captured for generation (``capture(..., max_cache_len=N)``, ``_kv_capture``) hold a static
KV cache (``_kv_cache``) as buffers; :func:`kv_cache_info` describes it, :class:`KVCacheError` is a
call that does not fit it, :func:`calibrate_kv_scales` measures the scales of an int8/FP8 cache
(:class:`KVScales`) and :func:`cache_bytes` counts a program's cache.
"""

from ._hooks import WHEN, BlockRun, CalibrationRun, calibration_hooks, register_calibration_hook
from ._kv_cache import KVScales, cache_bytes, calibrate_kv_scales
from ._kv_capture import KVCacheError, kv_cache_info

__all__ = ["WHEN", "BlockRun", "CalibrationRun", "calibration_hooks", "register_calibration_hook", "KVCacheError",
           "kv_cache_info", "KVScales", "cache_bytes", "calibrate_kv_scales"]
