"""Kind ``"affine"``: static qparams, ``quantized_decomposed`` quantize/dequantize per tensor or channel.

Per tensor: ``quantize/dequantize_per_tensor.default`` with scalar qparams; per channel
(``is_per_channel(obs.qscheme)``): ``*_per_channel.default`` with qparam buffers
``_qk_scale_<i>`` / ``_qk_zero_point_<i>``. A constant input (a weight) is folded when
``ctx.fold``: the graph keeps the integer buffer ``_frozen_param<i>`` and its dequantize only.
Static float8 specs (without ``float8_rounding``) take the same ops with the float8 dtype, per
tensor only (torchao's ``convert_pt2e`` does the same).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..._errors import ConvertError
from ..._graph import FOLDED_PREFIX
from ..._qmath import FLOAT8_DTYPES, is_per_channel, underlying_dtype
from ._context import ConvertContext
from ._registry import Emitter, register_emitter

__all__ = ["AffineEmitter", "refuse_float8_qdq"]

_OPS = torch.ops.quantized_decomposed
# rows quantized at once by quantized_weight: the quantize ops make float temporaries the size of their input
_CHUNK_BYTES = 16 << 20


def refuse_float8_qdq(node: Node, obs) -> None:
    """Refuse a float8 dtype that is per channel or dynamic on the ``quantized_decomposed`` ops:
    torch's ``dequantize_per_channel`` subtracts int64 zero points from the float8 tensor, which
    torch cannot promote (the model could not run); ``choose_qparams`` is integer-only."""
    dtype = underlying_dtype(getattr(obs, "dtype", torch.float32))
    dynamic = getattr(obs, "is_dynamic", False)
    if dtype in FLOAT8_DTYPES and (is_per_channel(getattr(obs, "qscheme", None)) or dynamic):
        kind = "dynamic" if dynamic else "per-channel"
        raise ConvertError(
            f"{kind} {str(dtype).replace('torch.', '')} quantization at node "
            f"'{getattr(obs, 'node_name', node.name)}' has no quantized_decomposed ops; "
            "use a static per-tensor spec for float8"
        )


@register_emitter("affine")
class AffineEmitter(Emitter):
    """Static affine or symmetric qparams (``obs.calculate_qparams()``), folded for constants."""

    def check(self, gm: GraphModule, node: Node, obs) -> None:
        refuse_float8_qdq(node, obs)

    def folds_weight(self, obs) -> bool:
        return True

    def emit(self, ctx: ConvertContext, node: Node, obs) -> None:
        graph = ctx.graph
        src = node.args[0]
        const = ctx.constant(src)
        dtype = underlying_dtype(getattr(obs, "dtype", torch.float32))
        out_kwargs = {}
        val = src.meta.get("val") if isinstance(src, Node) else None
        if isinstance(val, torch.Tensor) and val.dtype != torch.float32:
            out_kwargs = {"out_dtype": val.dtype}
        with graph.inserting_before(node):
            scale, zp = obs.calculate_qparams()
            if is_per_channel(obs.qscheme):
                axis = int(obs.ch_axis)
                scale_node = ctx.new_attr("_qk_scale_", scale.detach().clone())
                zp_node = ctx.new_attr("_qk_zero_point_", zp.detach().clone())
                qargs = (scale_node, zp_node, axis, obs.quant_min, obs.quant_max, dtype)
                q_op, dq_op = _OPS.quantize_per_channel.default, _OPS.dequantize_per_channel.default
            else:
                qargs = (float(scale), int(zp), obs.quant_min, obs.quant_max, dtype)
                q_op, dq_op = _OPS.quantize_per_tensor.default, _OPS.dequantize_per_tensor.default
            if isinstance(const, torch.Tensor) and ctx.fold:
                # fold: store the integer tensor, keep only the dequantize in the graph
                qvalue = q_op(const.detach(), *[ctx.literal(a) for a in qargs])
                q = ctx.new_attr(FOLDED_PREFIX, qvalue)
            else:
                q = graph.call_function(q_op, (src,) + qargs)
            out = graph.call_function(dq_op, (q,) + qargs, out_kwargs)
            ctx.records.append({
                "node": getattr(obs, "node_name", node.name),
                "kind": "weight" if isinstance(const, torch.Tensor) else "activation",
                "dtype": str(dtype).replace("torch.", ""),
                "qscheme": str(obs.qscheme).replace("torch.", ""),
                "scale": scale.detach().reshape(-1).tolist(),
                "zero_point": zp.detach().reshape(-1).tolist(),
                "quant_min": obs.quant_min,
                "quant_max": obs.quant_max,
            })
        ctx.finish(node, obs, out)

    def quantized_weight(self, obs, const: torch.Tensor) -> torch.Tensor:
        """The integer tensor :meth:`emit` folds for ``const``: the same qparams and quantize op,
        run on slices of at most 16 MiB of input (element-wise ops: the same values, without
        full-size float temporaries)."""
        dtype = underlying_dtype(obs.dtype)
        scale, zp = obs.calculate_qparams()
        const = const.detach()
        per_channel = is_per_channel(obs.qscheme)
        axis = int(obs.ch_axis) if per_channel else 0
        if const.dim() == 0:
            return _OPS.quantize_per_tensor.default(const, float(scale), int(zp), obs.quant_min, obs.quant_max, dtype)
        out = torch.empty(const.shape, dtype=dtype)
        step = max(1, _CHUNK_BYTES // max(1, const.numel() // max(1, const.shape[axis]) * const.element_size()))
        for start in range(0, const.shape[axis], step):
            part = const.narrow(axis, start, min(step, const.shape[axis] - start))
            if per_channel:
                q = _OPS.quantize_per_channel.default(part, scale[start:start + step].detach().clone(),
                                                      zp[start:start + step].detach().clone(), axis,
                                                      obs.quant_min, obs.quant_max, dtype)
            else:
                q = _OPS.quantize_per_tensor.default(part, float(scale), int(zp), obs.quant_min, obs.quant_max,
                                                     dtype)
            out.narrow(axis, start, q.shape[axis]).copy_(q)
        return out
