"""Kind ``"float8"``: FP8 observers (``float8_rounding``) become torchao's float8 quantize/dequantize ops.

The ``quantized_decomposed`` ops with a float8 dtype round ``x / scale`` to an integer before
the cast (torch's ``_decomposed.py``), which throws away E4M3's finer steps below 16; torchao's
``quantize_affine_float8_non_decomposed`` / ``dequantize_affine_float8_non_decomposed`` (the ops
torchao's own x86 FP8 PT2E flow uses) round to the float8 grid itself, with a scale tensor that
broadcasts: ``[1]`` per tensor, ``[N, 1]`` per output channel, ``[..., 1]`` per token.
Dynamic scales: torchao's ``choose_scale_float8`` per token (one block per row), ``amax`` per
tensor (its block size would be the whole, batch-dependent, shape).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..._errors import ConvertError
from ..._graph import FOLDED_PREFIX
from ..._graph import example_value as _val
from ..._qdq import PER_TOKEN
from ..._qmath import float8_max, is_per_channel, quantize_float8, underlying_dtype
from ._context import ConvertContext
from ._registry import Emitter, register_emitter

__all__ = ["Float8Emitter", "emit_float8"]

_AO = torch.ops.torchao
aten = torch.ops.aten


def emit_float8(conv: ConvertContext, node: Node, obs, const) -> Node:
    """Insert before the observer call ``node`` the float8 quantize/dequantize of its input that
    ``obs`` describes (static per tensor / per channel, dynamic per tensor / per token) and return
    the dequantized value. A constant input (a weight) is folded into a float8 buffer when
    ``conv.fold``; static qparams are recorded in ``conv.records``."""
    graph = conv.graph
    src = node.args[0]
    dtype = underlying_dtype(obs.dtype)
    fmax = float8_max(dtype)
    val = _val(src) if const is None else const
    out_dtype = val.dtype if val is not None and val.is_floating_point() else torch.float32
    name = getattr(obs, "node_name", node.name)
    with graph.inserting_before(node):
        if getattr(obs, "is_dynamic", False):
            # scale = max(amax, eps * fmax) / fmax: never 0 (an all-zero token stays 0)
            floor = float(obs.eps) * fmax
            if getattr(obs, "granularity", None) == PER_TOKEN:
                if val is None or not isinstance(val.shape[-1], int):
                    raise ConvertError(f"per-token FP8 at node '{name}' needs a static last dimension")
                block = [1] * (val.dim() - 1) + [int(val.shape[-1])]
                scale = graph.call_function(_AO.choose_scale_float8.default,
                                            (src, block, dtype, torch.float32, floor, None))
            else:
                amax = graph.call_function(aten.amax.default, (graph.call_function(aten.abs.default, (src,)),))
                scale = graph.call_function(aten.div.Tensor, (
                    graph.call_function(aten.clamp_min.default, (amax, floor)), fmax))
            q = graph.call_function(_AO.quantize_affine_float8_non_decomposed.default, (src, scale, dtype))
            return graph.call_function(_AO.dequantize_affine_float8_non_decomposed.default, (q, scale, out_dtype))
        scale, _ = obs.calculate_qparams()
        scale = scale.detach().float().reshape(-1)
        if is_per_channel(obs.qscheme):
            if val is None:
                raise ConvertError(f"per-channel FP8 at node '{name}' has no shape to lay its scales along")
            axis = int(obs.ch_axis) % val.dim()
            shape = [1] * val.dim()
            shape[axis] = scale.numel()
            scale = scale.reshape(shape)
        scale_node = conv.new_attr("_qk_scale_", scale.clone())
        if isinstance(const, torch.Tensor) and conv.fold:
            q = conv.new_attr(FOLDED_PREFIX, quantize_float8(const.detach(), scale, dtype))
        else:
            q = graph.call_function(_AO.quantize_affine_float8_non_decomposed.default, (src, scale_node, dtype))
        out = graph.call_function(_AO.dequantize_affine_float8_non_decomposed.default, (q, scale_node, out_dtype))
    record = {
        "node": name,
        "kind": "weight" if isinstance(const, torch.Tensor) else "activation",
        "dtype": str(dtype).replace("torch.", ""),
        "qscheme": str(obs.qscheme).replace("torch.", ""),
        "scale": scale.reshape(-1).tolist(),
        "zero_point": [0] * scale.numel(),
        "quant_min": obs.quant_min,
        "quant_max": obs.quant_max,
    }
    if is_per_channel(obs.qscheme):
        record["axis"] = int(obs.ch_axis)
    if isinstance(const, torch.Tensor):  # rtn, or gptq/awq (the codes calibrate chose)
        record["algorithm"] = getattr(obs, "weight_algorithm", None) or "rtn"
    conv.records.append(record)
    return out


@register_emitter("float8")
class Float8Emitter(Emitter):
    """FP8 on the float8 grid, static (per tensor / per channel) or dynamic (per tensor / per token)."""

    def emit(self, ctx: ConvertContext, node: Node, obs) -> None:
        ctx.finish(node, obs, emit_float8(ctx, node, obs, ctx.constant(node.args[0])))
