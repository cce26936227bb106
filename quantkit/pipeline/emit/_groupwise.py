"""Kind ``"groupwise"``: what a ``"per-group"`` weight observer becomes.

int4 / int8: ``dequantize_per_channel_group(q, scale, zero_point, ...)`` (torch's
``quantized_decomposed`` op) on a folded integer weight; int4 weights are stored packed two per
byte and read through ``quantkit.unpack_int4``. NF4: packed 4-bit codes, the 16-value table and
per-group absmax scales behind ``quantkit.dequantize_nf4``.

A group size that does not divide K leaves a last group of the remainder (576 = 4 x 128 + 64): such
weights carry ``quantkit::dequantize_group`` (and ``quantkit::quantize_group`` unfolded), the same
arguments and per-element math as torch's ops with ``[N, ceil(K / g)]`` qparams. NF4 with
``double_quant``: the scales are ``quantkit::dequantize_scales(fp8 codes, block scales, offset, 256)``.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ... import _qdq  # noqa: F401  (registers quantkit::unpack_int4 / dequantize_nf4)
from ... import _qmath
from ..._errors import ConvertError
from ..._graph import FOLDED_PREFIX
from ._context import ConvertContext
from ._registry import Emitter, register_emitter

__all__ = ["GroupwiseEmitter", "emit_groupwise"]

_OPS = torch.ops.quantized_decomposed
_QK = torch.ops.quantkit


def _qparams(obs, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The observer's qparams shaped ``[N, ceil(K / g)]`` (a last group of the remainder when g does not
    divide K): scale float32, zero point int8 (small in artifacts)."""
    scale, zp = obs.calculate_qparams()
    groups = (shape[0], _qmath.group_count(shape[1], obs.group_size))
    scale = scale.detach().float().reshape(groups).contiguous()
    # int8 zero points for 4-bit ranges keep an int4 g128 artifact small; int32 for 8-bit ranges,
    # whose q - zero_point would overflow int8
    zp_dtype = torch.int8 if obs.quant_max - obs.quant_min <= 15 else torch.int32
    zp = torch.round(zp.detach().double()).to(zp_dtype).reshape(groups).contiguous()
    return scale, zp


def emit_groupwise(conv: ConvertContext, node: Node, obs) -> None:
    """Replace the observer call ``node`` (on a constant ``[N, K]`` weight) of ``conv``'s graph by
    its group-wise dequantize; the weight is quantized with the qparams ``obs`` gives for it."""
    name = getattr(obs, "node_name", node.name)
    src = node.args[0]
    const = conv.constant(src)
    if not isinstance(const, torch.Tensor):
        raise ConvertError(f"group-wise observer at node '{name}' does not watch a constant weight; "
                           "group-wise quantization is for weights only")
    obs.observe_weight(const.detach())  # qparams describe the weight being folded
    scale, zp = _qparams(obs, const.shape)
    g, lo, hi = obs.group_size, obs.quant_min, obs.quant_max
    dtype = _qmath.underlying_dtype(obs.dtype)
    four_bit = hi - lo == 15
    remainder = const.shape[1] % g
    # whole groups: torch's per-group ops (what torchao and the exports read); a remainder group: quantkit's
    quant_op = _QK.quantize_group.default if remainder else _OPS.quantize_per_channel_group.default
    dequant_op = _QK.dequantize_group.default if remainder else _OPS.dequantize_per_channel_group.default
    double_quant = obs.scheme == "nf4" and bool(getattr(obs, "double_quant", False))
    extra = {}
    graph = conv.graph
    with graph.inserting_before(node):
        if double_quant:  # QLoRA: the absmax scales stored as fp8 codes, an fp32 scale per block and an offset
            codes8, block_scale, offset = _qmath.double_quantize_scales(scale)
            scale_node = graph.call_function(_QK.dequantize_scales.default, (
                conv.new_attr("_qk_scale_fp8_", codes8), conv.new_attr("_qk_scale_block_", block_scale),
                conv.new_attr("_qk_scale_offset_", offset), _qmath.DOUBLE_QUANT_BLOCK))
            extra = {"double_quant": True, "double_quant_block": _qmath.DOUBLE_QUANT_BLOCK}
        else:
            scale_node = conv.new_attr("_qk_scale_", scale)
        if obs.scheme == "nf4":
            # codes from the fp32 absmax (QLoRA quantizes the weight, then its scales)
            codes = _qmath.quantize_nf4(const.detach(), scale, g)
            table = conv.new_attr("_qk_nf4_table_", torch.tensor(_qmath.NF4_VALUES, dtype=torch.float32))
            packed = conv.new_attr(FOLDED_PREFIX, _qmath.pack_int4(codes))
            q = graph.call_function(_QK.unpack_int4.default, (packed, False))
            out = graph.call_function(_QK.dequantize_nf4.default, (q, table, scale_node, g, const.dtype))
            kind = "nf4"
        else:
            zp_node = conv.new_attr("_qk_zero_point_", zp)
            qargs = (scale_node, zp_node, lo, hi, dtype)
            if conv.fold:
                qvalue = _qmath.quantize_group(const.detach(), scale, zp, lo, hi, dtype, g)
                if four_bit:
                    packed = conv.new_attr(FOLDED_PREFIX, _qmath.pack_int4(qvalue))
                    q = graph.call_function(_QK.unpack_int4.default, (packed, dtype == torch.int8))
                else:
                    q = conv.new_attr(FOLDED_PREFIX, qvalue)
            else:
                q = graph.call_function(quant_op, (src,) + qargs + (g,))
            out = graph.call_function(dequant_op, (q,) + qargs + (g, const.dtype))
            kind = ("int4" if dtype == torch.int8 else "uint4") if four_bit else str(dtype).replace("torch.", "")
    conv.records.append({
        "node": name, "kind": "weight", "dtype": kind, "qscheme": "per_channel_group", "group_size": g,
        "symmetric": bool(obs.symmetric), "algorithm": getattr(obs, "weight_algorithm", "rtn"),
        "shape": list(const.shape), "quant_min": lo, "quant_max": hi, **extra,
    })
    node.replace_all_uses_with(out)
    graph.erase_node(node)


@register_emitter("groupwise")
class GroupwiseEmitter(Emitter):
    """Weight-only int4 / int8 / NF4: one scale per group of input features, folded."""

    def emit(self, ctx: ConvertContext, node: Node, obs) -> None:
        emit_groupwise(ctx, node, obs)

    def emits_from_weight(self, obs) -> bool:
        return True
