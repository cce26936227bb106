"""``quantkit::sdpa_prefill_bf16``: scaled-dot-product attention that runs in bf16 from ``min_rows`` query rows on.

A KV-cache program has one graph for prefill and decode, so its attention cannot be lowered one way
for long query blocks and another for one token at graph-rewrite time: this op decides per call,
from the query's row count, like ``int4_linear_cpu``'s prefill path (``PREFILL_ROWS``). With
``min_rows`` query rows or more (a prompt) and float32 inputs, q, k, v and a float mask are rounded
to bf16, aten's SDPA runs in bf16 (oneDNN/AMX flash attention) and the result comes back as float32;
fewer rows (a decode step) run aten's float32 SDPA unchanged, where bf16 measured slower. A float
mask of another dtype than q (the bf16 additive mask ``lowering._prefill_attention`` shares between
layers) is cast to the dtype the call computes in.

Measured (2 threads, AMX Xeon; SmolLM2's grouped 3 KV heads x 64, a 1048-slot cache): a 1024-token
prompt's SDPA 12.9 -> 6.2 ms, a 128-token one 1.67 -> 0.79 ms; one decode token 0.04 ms in float32
against 0.11 ms with the bf16 casts.

Numerics: bf16 operands (relative rounding 2**-9) with float accumulation: the attention output
differs from float32's at bf16 level, as the int4 prefill GEMM's output does.
"""

from __future__ import annotations

import torch

from ._kernel_cache import define_cpu_op

__all__ = ["sdpa_prefill_bf16", "KERNEL"]

KERNEL = "quantkit::sdpa_prefill_bf16"


def _sdpa(q, k, v, attn_mask, scale):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def _impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
          scale: float | None, min_rows: int) -> torch.Tensor:
    if q.dim() < 2 or q.shape[-2] < min_rows or q.dtype != torch.float32:
        if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.dtype != q.dtype:
            attn_mask = attn_mask.to(q.dtype)  # a bf16 additive mask (0 / -inf: exact in either dtype)
        return _sdpa(q, k, v, attn_mask, scale)
    bf = torch.bfloat16
    mask = attn_mask.to(bf) if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
    return _sdpa(q.to(bf), k.to(bf), v.to(bf), mask, scale).to(q.dtype)


def _fake(q, k, v, attn_mask, scale, min_rows):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


_LIB = define_cpu_op("sdpa_prefill_bf16(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float? scale, int min_rows)"
                     " -> Tensor", _impl, _fake)


def sdpa_prefill_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                      scale: float | None = None, min_rows: int = 32) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, attn_mask, scale=scale)`` computed in bf16 when ``q`` has
    at least ``min_rows`` rows and is float32, else in ``q``'s dtype (``torch.ops.quantkit.sdpa_prefill_bf16``)."""
    return torch.ops.quantkit.sdpa_prefill_bf16(q, k, v, attn_mask, scale, min_rows)
