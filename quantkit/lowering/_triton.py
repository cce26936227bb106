"""CUDA target: rewrite matched linears and attention matmuls into quantkit's Triton ops.

``torch.ops.quantkit.int8_linear`` / ``int8_bmm`` are ``triton_op``s, so Inductor sees the
Triton kernels themselves and schedules them with the surrounding fused code.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from quantkit.kernels import DECOMPOSED  # importing quantkit.kernels registers torch.ops.quantkit.*

from .._graph import get_attr, unique_attr_name
from ._match import ActQ, LinearMatch, MatmulMatch, _getitem_source

__all__ = ["emit_linear", "emit_matmul", "fuse_per_token_quantize"]


def _buffer(gm: GraphModule, base: str, value: torch.Tensor, before: Node) -> Node:
    """Register ``value`` as the buffer ``{base}{i}`` (first free ``i``); its get_attr node before ``before``."""
    name = unique_attr_name(gm, base)
    gm.register_buffer(name, value)
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(name)


def _qparams(gm: GraphModule, act: ActQ, before: Node, device) -> tuple[Node, Node | None]:
    """Scale and zero point of ``act`` as graph tensors (zero point None when known to be 0)."""
    if act.dynamic:
        return act.scale, None if act.symmetric else act.zero_point
    scale = _buffer(gm, "_qk_act_scale_", torch.tensor([float(act.scale)], device=device), before)
    zp = None
    if int(act.zero_point) != 0:
        zp = _buffer(gm, "_qk_act_zp_", torch.tensor([int(act.zero_point)], dtype=torch.int32, device=device), before)
    return scale, zp


def emit_linear(gm: GraphModule, m: LinearMatch) -> Node:
    weight = get_attr(gm, m.weight.target)
    device = weight.device
    scale, zp = _qparams(gm, m.act, m.linear, device)
    w_node = m.weight
    if m.weight_kn:  # [K, N] (addmm): the kernel takes [N, K]; keep one transposed int8 copy
        w_node = _buffer(gm, "_qk_weight_nk_", weight.t().contiguous(), m.linear)
    if isinstance(m.w_scale, Node):
        w_scale = m.w_scale
    else:
        w_scale = _buffer(gm, "_qk_w_scale_", torch.tensor([float(m.w_scale)], device=device), m.linear)
    with gm.graph.inserting_before(m.linear):
        return gm.graph.call_function(
            torch.ops.quantkit.int8_linear.default,
            (m.act.q, scale, zp, w_node, w_scale, m.bias, m.activation, m.out_dtype,
             m.out_scale, m.out_zero_point),
        )


def emit_matmul(gm: GraphModule, m: MatmulMatch, device) -> Node:
    sa, za = _qparams(gm, m.a, m.matmul, device)
    sb, zb = _qparams(gm, m.b, m.matmul, device)
    with gm.graph.inserting_before(m.matmul):
        return gm.graph.call_function(
            torch.ops.quantkit.int8_bmm.default, (m.a.q, sa, za, m.b.q, sb, zb, torch.float32)
        )


def fuse_per_token_quantize(gm: GraphModule) -> int:
    """Replace ``choose_qparams_per_token`` + ``quantize_per_token`` pairs whose integers only
    feed the int8 kernels (every dequantize was rewritten away) by the one-pass
    ``quantkit.quantize_per_token`` kernel, with the decomposed ops' scale formula so the
    integers and scales are the same. fp32 inputs only (the decomposed ops compute fp16
    inputs' scales in fp16). Returns the number of pairs fused."""
    q_ops = torch.ops.quantized_decomposed
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not q_ops.quantize_per_token.default:
            continue
        x, scale, zp = node.args[:3]
        choose = _getitem_source(scale)
        val = x.meta.get("val") if isinstance(x, Node) else None
        if (choose is None or choose.target is not q_ops.choose_qparams_per_token.default
                or choose.args[0] is not x or _getitem_source(zp) is not choose
                or tuple(node.args[3:6]) != (-128, 127, torch.int8)
                or not isinstance(val, torch.Tensor) or val.dtype != torch.float32
                or any(u.target is q_ops.dequantize_per_token.default for u in node.users)
                or set(zp.users) != {node}):
            continue
        with gm.graph.inserting_before(node):
            op = gm.graph.call_function(torch.ops.quantkit.quantize_per_token.default, (x,), dict(DECOMPOSED))
            q_new = gm.graph.call_function(operator.getitem, (op, 0))
            s_new = gm.graph.call_function(operator.getitem, (op, 1))
        node.replace_all_uses_with(q_new)
        scale.replace_all_uses_with(s_new)
        fused += 1
    return fused
