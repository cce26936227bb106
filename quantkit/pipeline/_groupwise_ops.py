"""Graph ops of the weight-only representation, registered with ``torch.library``.

``quantkit::unpack_int4`` turns the packed int4 weights a converted graph stores (two values per
byte, see :func:`quantkit._qmath.pack_int4`) back into one integer per byte for the ecosystem's
``quantized_decomposed.dequantize_per_channel_group``; ``quantkit::dequantize_nf4`` is NF4's table
look-up. Both have fake (meta) implementations, so graphs holding them export, save, load and
compile. They are registered when ``quantkit`` is imported (loading an artifact needs them).
"""

from __future__ import annotations

import torch

from .. import _qmath

__all__ = ["unpack_int4", "dequantize_nf4"]


@torch.library.custom_op("quantkit::unpack_int4", mutates_args=())
def unpack_int4(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    """``[..., K // 2]`` uint8 → ``[..., K]`` int8 in [-8, 7] (``signed``) or uint8 in [0, 15]."""
    return _qmath.unpack_int4(packed, signed)


@unpack_int4.register_fake
def _(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    torch._check(packed.dtype == torch.uint8, lambda: f"unpack_int4 expects uint8, got {packed.dtype}")
    shape = (*packed.shape[:-1], packed.shape[-1] * 2)
    return packed.new_empty(shape, dtype=torch.int8 if signed else torch.uint8)


@torch.library.custom_op("quantkit::dequantize_nf4", mutates_args=())
def dequantize_nf4(codes: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, group_size: int,
                   output_dtype: torch.dtype) -> torch.Tensor:
    """``table[codes] * scale`` per group of ``group_size`` (``codes`` ``[N, K]``, ``scale`` ``[N, K // g]``)."""
    return _qmath.dequantize_nf4(codes, table, scale, group_size, output_dtype)


@dequantize_nf4.register_fake
def _(codes, table, scale, group_size, output_dtype):
    return codes.new_empty(codes.shape, dtype=output_dtype)
