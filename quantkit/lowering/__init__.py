"""Lowering of converted q/dq graphs to fused int8 kernels, and ``quantkit.compile``.

``lower`` rewrites a converted GraphModule for a :class:`Target` (oneDNN on CPU, Triton on CUDA);
``_compile`` applies it and hands the graph to ``torch.compile``.
"""

from ._lower import Target, lower

__all__ = ["Target", "lower"]
