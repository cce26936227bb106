"""CUDA target: rewrite matched linears and attention matmuls into quantkit's Triton ops.

``torch.ops.quantkit.int8_linear`` / ``int8_bmm`` are ``triton_op``s, so Inductor sees the
Triton kernels themselves and schedules them with the surrounding fused code.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ._match import ActQ, LinearMatch, MatmulMatch, attr

__all__ = ["emit_linear", "emit_matmul"]


def _buffer(gm: GraphModule, base: str, value: torch.Tensor, before: Node) -> Node:
    i = 0
    while hasattr(gm, f"{base}{i}"):
        i += 1
    gm.register_buffer(f"{base}{i}", value)
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(f"{base}{i}")


def _qparams(gm: GraphModule, act: ActQ, before: Node, device) -> tuple[Node, Node | None]:
    """Scale and zero point of ``act`` as graph tensors (zero point None when known to be 0)."""
    if act.dynamic:
        return act.scale, None if act.symmetric else act.zero_point
    scale = _buffer(gm, "_qk_act_scale_", torch.tensor([float(act.scale)], device=device), before)
    zp = None
    if int(act.zero_point) != 0:
        zp = _buffer(gm, "_qk_act_zp_", torch.tensor([int(act.zero_point)], dtype=torch.int32, device=device), before)
    return scale, zp


def _register_ops() -> None:
    import quantkit.kernels  # noqa: F401  (registers torch.ops.quantkit.*; imports triton)


def emit_linear(gm: GraphModule, m: LinearMatch) -> Node:
    _register_ops()
    weight = attr(gm, m.weight.target)
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
    _register_ops()
    sa, za = _qparams(gm, m.a, m.matmul, device)
    sb, zb = _qparams(gm, m.b, m.matmul, device)
    with gm.graph.inserting_before(m.matmul):
        return gm.graph.call_function(
            torch.ops.quantkit.int8_bmm.default, (m.a.q, sa, za, m.b.q, sb, zb, torch.float32)
        )
