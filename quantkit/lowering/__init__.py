"""Lowering of converted q/dq graphs to fused kernels, and ``quantkit.compile``.

``lower`` rewrites a converted GraphModule for a :class:`Target` (oneDNN on CPU, Triton on CUDA);
``_compile`` runs every registered lowering pass (``_registry``: int8, weight-only, FP8, bf16, and any
pass a scheme adds with :func:`register_lowering`) and hands the graph to ``torch.compile``.
"""

from . import _bf16, _fp8, _gqa, _per_token, _per_token_fuse, _prefill_attention, _qsdpa, _weight_only  # noqa: F401  (their passes register on import; _lower's below)
from ._lower import Target, lower
from ._registry import (Lowering, LoweringContext, LoweringError, register_lowering, registered_lowerings,
                        unregister_lowering)

__all__ = ["Target", "lower", "register_lowering", "unregister_lowering", "registered_lowerings", "Lowering",
           "LoweringContext", "LoweringError"]
