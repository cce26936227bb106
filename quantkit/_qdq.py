"""The quantize/dequantize core of converted graphs: graph ops, granularity names, node builders.

- ``quantkit::unpack_int4`` / ``quantkit::dequantize_nf4`` / ``quantkit::quantize_group`` /
  ``quantkit::dequantize_group`` (remainder groups) / ``quantkit::dequantize_scales`` (NF4 double
  quantization): the graph ops of the weight-only representation, registered with ``torch.library`` (with fake implementations, so graphs holding
  them export, save, load and compile) when this module is imported (moved here from
  ``quantkit/pipeline/_groupwise_ops.py``);
- granularity names observers declare (``granularity``): :data:`PER_TENSOR`, :data:`PER_CHANNEL`,
  :data:`PER_TOKEN`, :data:`PER_GROUP`;
- :func:`kind_from_attributes`: the convert kind (``qkind``) that an observer's declared attributes
  give, the rule quantkit's observers follow and :func:`quantkit.pipeline.emit.qkind_of` applies to
  observers that declare no ``qkind``;
- :func:`emit_dynamic`: run-time choose-qparams + quantize + dequantize nodes, used by convert's
  dynamic emitter and by observers' torchao-style ``convert(model, node)`` hook.

Core: imports only ``_qmath`` and ``_errors`` from quantkit.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from . import _qmath
from ._errors import ConvertError
from ._qmath import FLOAT8_DTYPES, underlying_dtype

__all__ = [
    "unpack_int4", "dequantize_nf4", "quantize_group", "dequantize_group", "dequantize_scales", "PER_TENSOR", "PER_CHANNEL", "PER_TOKEN", "PER_GROUP",
    "SUPPORTED_DTYPES", "CHOOSE_QPARAMS", "kind_from_attributes", "emit_dynamic",
]

PER_TENSOR = "per-tensor"
PER_CHANNEL = "per-channel"  # one scale per index of ``ch_axis``
PER_TOKEN = "per-token"      # one scale per row of the last dimension (dynamic only)
PER_GROUP = "per-group"      # one scale per group of ``group_size`` input features (weights only)

_OPS = torch.ops.quantized_decomposed
# static quantization dtypes (torchao's convert_pt2e SUPPORTED_QDTYPES): float8 ones take the
# same quantize/dequantize_per_tensor/_per_channel ops with the float8 dtype argument
SUPPORTED_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32) + FLOAT8_DTYPES
# the run-time qparams op of a dynamic per-tensor qscheme
CHOOSE_QPARAMS = {
    torch.per_tensor_affine: _OPS.choose_qparams.tensor,
    torch.per_tensor_symmetric: _OPS.choose_qparams_symmetric.tensor,
}


# --- graph ops of the weight-only representation ---------------------------------------------
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


# remainder groups (``K % group_size != 0``: a last group of the remainder) and NF4 double
# quantization: torch's ``*_per_channel_group`` ops need whole groups, so these layers carry
# quantkit's own ops, whose math is ``_qmath``'s (the same per-element arithmetic as torch's ops)
@torch.library.custom_op("quantkit::quantize_group", mutates_args=())
def quantize_group(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int, quant_max: int,
                   dtype: torch.dtype, group_size: int) -> torch.Tensor:
    """Group-wise quantize of ``x`` ``[N, K]`` with ``scale``/``zero_point`` ``[N, ceil(K / g)]``."""
    return _qmath.quantize_group(x, scale, zero_point, quant_min, quant_max, dtype, group_size)


@quantize_group.register_fake
def _(x, scale, zero_point, quant_min, quant_max, dtype, group_size):
    return x.new_empty(x.shape, dtype=underlying_dtype(dtype))


@torch.library.custom_op("quantkit::dequantize_group", mutates_args=())
def dequantize_group(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int,
                     quant_max: int, dtype: torch.dtype, group_size: int,
                     output_dtype: torch.dtype) -> torch.Tensor:
    """``(q - zero_point) * scale`` per group of ``group_size``, the last group the remainder of K."""
    return _qmath.dequantize_group(q, scale, zero_point, quant_min, quant_max, dtype, group_size, output_dtype)


@dequantize_group.register_fake
def _(q, scale, zero_point, quant_min, quant_max, dtype, group_size, output_dtype):
    return q.new_empty(q.shape, dtype=output_dtype)


@torch.library.custom_op("quantkit::dequantize_scales", mutates_args=())
def dequantize_scales(codes: torch.Tensor, block_scale: torch.Tensor, offset: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """NF4 double quantization: ``float(codes) * block_scale + offset`` (float8 codes ``[N, G]``,
    one fp32 block scale per ``block_size`` codes, one fp32 offset): the fp32 scales ``[N, G]``."""
    return _qmath.dequantize_scales(codes, block_scale, offset, block_size)


@dequantize_scales.register_fake
def _(codes, block_scale, offset, block_size):
    return codes.new_empty(codes.shape, dtype=torch.float32)


# --- the kind an observer's attributes declare -------------------------------------------------
def kind_from_attributes(obs) -> str:
    """The convert kind that ``obs``'s declared attributes give, first match wins:

    ``"groupwise"`` (``granularity == "per-group"``), ``"float8"`` (``float8_rounding``: the float8
    grid itself), ``"float16"`` (``dtype`` float16: a cast pair), ``"passthrough"`` (any other dtype
    that is not a quantized one, e.g. float32: nothing to do), ``"dynamic"`` (``is_dynamic``: run-time
    qparams), else ``"affine"`` (static qparams from ``calculate_qparams``).
    """
    if getattr(obs, "granularity", None) == PER_GROUP:
        return "groupwise"
    if getattr(obs, "float8_rounding", False):
        return "float8"
    dtype = underlying_dtype(getattr(obs, "dtype", torch.float32))
    if dtype == torch.float16:
        return "float16"
    if dtype not in SUPPORTED_DTYPES:
        return "passthrough"
    if getattr(obs, "is_dynamic", False):
        return "dynamic"
    return "affine"


# --- node builders -----------------------------------------------------------------------------
def _scalar(value) -> float:
    return float(value.reshape(-1)[0]) if isinstance(value, torch.Tensor) else float(value)


def emit_dynamic(graph: Graph, node: Node, obs) -> Node:
    """Insert, before the observer call ``node``, the run-time quantization of its input that
    the dynamic observer ``obs`` describes; return the dequantized value.

    Per tensor (``obs.qscheme`` affine or symmetric): ``choose_qparams[_symmetric].tensor``
    then ``quantize/dequantize_per_tensor.tensor`` (torchao's ``convert_pt2e`` emits the same);
    per token (``obs.granularity == "per-token"``): ``choose_qparams_per_token`` then
    ``quantize/dequantize_per_token``.

    Raises:
        ConvertError: for a dtype other than int8/uint8, or a qscheme that is not per tensor.
    """
    src = node.args[0]
    dtype = underlying_dtype(getattr(obs, "dtype", torch.float32))
    if dtype not in (torch.int8, torch.uint8):
        raise ConvertError(f"dynamic quantization supports int8 and uint8, got {dtype} at node '{node.name}'")
    val = src.meta.get("val") if isinstance(src, Node) else None
    float_out = val.dtype if isinstance(val, torch.Tensor) and val.is_floating_point() else torch.float32
    with graph.inserting_before(node):
        if getattr(obs, "granularity", None) == PER_TOKEN:
            choose = graph.call_function(_OPS.choose_qparams_per_token.default, (src, dtype))
            scale = graph.call_function(operator.getitem, (choose, 0))
            zp = graph.call_function(operator.getitem, (choose, 1))
            qargs = (scale, zp, obs.quant_min, obs.quant_max, dtype)
            q = graph.call_function(_OPS.quantize_per_token.default, (src,) + qargs)
            return graph.call_function(_OPS.dequantize_per_token.default, (q,) + qargs + (float_out,))
        qscheme = getattr(obs, "qscheme", torch.per_tensor_affine)
        if qscheme not in CHOOSE_QPARAMS:
            raise ConvertError(
                f"dynamic quantization supports per-tensor qschemes only, got {qscheme} at node '{node.name}'"
            )
        eps = _scalar(getattr(obs, "eps", torch.finfo(torch.float32).eps))
        choose = graph.call_function(CHOOSE_QPARAMS[qscheme], (src, obs.quant_min, obs.quant_max, eps, dtype))
        scale = graph.call_function(operator.getitem, (choose, 0))
        zp = graph.call_function(operator.getitem, (choose, 1))
        qargs = (scale, zp, obs.quant_min, obs.quant_max, dtype)
        q = graph.call_function(_OPS.quantize_per_tensor.tensor, (src,) + qargs)
        kwargs = {} if float_out == torch.float32 else {"out_dtype": float_out}
        return graph.call_function(_OPS.dequantize_per_tensor.tensor, (q,) + qargs, kwargs)
