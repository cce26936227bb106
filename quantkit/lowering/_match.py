"""Find the q/dq patterns that ``quantkit.convert`` emits around linear and matmul nodes.

A match is data: which nodes feed the int8 kernel and which node its result replaces.
Matching reads the aten-level graph of ``torch.export(...).module()`` as ``convert`` left it
(each dequantize has one user), so the patterns are few and exact.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from .._graph import get_attr
from .._qmath import default_qrange

__all__ = ["ActQ", "LinearMatch", "MatmulMatch", "match_linear", "match_matmul", "drop_unread_attrs"]

aten = torch.ops.aten
_Q = torch.ops.quantized_decomposed
_DQ_ACT = (_Q.dequantize_per_tensor.default, _Q.dequantize_per_tensor.tensor)
_ACTIVATIONS = {aten.relu.default: "relu", aten.gelu.default: "gelu"}


def drop_unread_attrs(gm: GraphModule, targets) -> None:
    """Delete each dotted attribute of ``targets`` that no ``get_attr`` node of ``gm`` reads any more
    (the originals a rewrite replaced: one copy of each weight stays)."""
    still_read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for target in set(targets) - still_read:
        module, _, name = target.rpartition(".")
        delattr(gm.get_submodule(module) if module else gm, name)


@dataclass
class ActQ:
    """A quantized activation: the integer tensor and its per-tensor qparams.

    ``scale``/``zero_point`` are python numbers (static) or graph nodes (dynamic);
    ``symmetric`` means the zero point is known to be 0 (int8 from choose_qparams_symmetric
    or choose_qparams_per_token). ``per_token``: ``scale`` is a ``[..., 1]`` node, one scale
    per row of the last dimension.
    """

    q: Node
    scale: object
    zero_point: object
    dtype: torch.dtype
    dynamic: bool
    symmetric: bool
    per_token: bool = False


@dataclass
class LinearMatch:
    linear: Node
    act: ActQ
    weight: Node                 # get_attr of the int8 [N, K] weight
    w_scale: object              # get_attr of the float32 [N] scale, or a python float (per tensor)
    bias: Optional[Node]
    activation: str = "none"
    weight_kn: bool = False        # weight stored [K, N] (addmm, HF Conv1D): transpose for the kernel
    out_dtype: torch.dtype = torch.float32
    out_scale: float = 1.0
    out_zero_point: int = 0
    output: Optional[Node] = None  # the node whose uses the fused op takes over


@dataclass
class MatmulMatch:
    matmul: Node
    a: ActQ
    b: ActQ


def _full_range(qmin, qmax, dtype) -> bool:
    return dtype in (torch.int8, torch.uint8) and (qmin, qmax) == default_qrange(dtype)


def _getitem_source(node) -> Optional[Node]:
    """The multi-output node that ``node = source[i]`` reads, else None."""
    if isinstance(node, Node) and node.op == "call_function" and node.target is operator.getitem:
        return node.args[0]
    return None


def _act_q_per_token(node: Node) -> Optional[ActQ]:
    """``dequantize_per_token(q, scales, zps, ...)`` with qparams from ``choose_qparams_per_token``
    (symmetric int8, zero points all 0): the form ``quantkit.convert`` emits for per-token layers."""
    q, scale, zp, _, _, dtype = node.args[:6]
    out_dtype = node.args[6] if len(node.args) > 6 else node.kwargs.get("output_dtype", torch.float32)
    if dtype != torch.int8 or out_dtype != torch.float32 or len(node.users) != 1:
        return None
    choose = _getitem_source(scale)
    if choose is None or choose is not _getitem_source(zp) or choose.target is not _Q.choose_qparams_per_token.default:
        return None
    return ActQ(q, scale, zp, dtype, dynamic=True, symmetric=True, per_token=True)


def _act_q(node) -> Optional[ActQ]:
    if isinstance(node, Node) and node.op == "call_function" and node.target is _Q.dequantize_per_token.default:
        return _act_q_per_token(node)
    if not isinstance(node, Node) or node.op != "call_function" or node.target not in _DQ_ACT:
        return None
    if node.kwargs.get("out_dtype", torch.float32) != torch.float32 or len(node.users) != 1:
        return None
    q, scale, zp, qmin, qmax, dtype = node.args[:6]
    if dtype not in (torch.int8, torch.uint8):
        return None
    dynamic = node.target is _Q.dequantize_per_tensor.tensor
    symmetric = False
    if dynamic:
        # zero point from choose_qparams_symmetric(int8) is 0 by construction
        choose = _getitem_source(zp)
        symmetric = (choose is not None and choose.target is _Q.choose_qparams_symmetric.tensor
                     and dtype == torch.int8)
    else:
        symmetric = int(zp) == 0
    return ActQ(q, scale, zp, dtype, dynamic, symmetric)


def _weight(gm: GraphModule, node, axis_out: int = 0) -> Optional[tuple[Node, object]]:
    """(int8 weight get_attr, scale) for a symmetric int8 weight dequantize, else None.

    ``axis_out`` is the weight's output-channel dim: 0 for linear's ``[N, K]``, 1 for
    addmm's ``[K, N]``; a per-channel scale must run along it."""
    if not isinstance(node, Node) or node.op != "call_function" or len(node.users) != 1:
        return None
    if node.target is _Q.dequantize_per_channel.default:
        w, scale, zp, axis, _, _, dtype = node.args[:7]
        if axis != axis_out or not all(isinstance(n, Node) and n.op == "get_attr" for n in (w, scale, zp)):
            return None
        if bool(get_attr(gm, zp.target).any()):
            return None
    elif node.target is _Q.dequantize_per_tensor.default:
        w, scale, zp, _, _, dtype = node.args[:6]
        if not (isinstance(w, Node) and w.op == "get_attr") or int(zp) != 0:
            return None
    else:
        return None
    if dtype != torch.int8 or get_attr(gm, w.target).dim() != 2 or node.kwargs.get("out_dtype", torch.float32) != torch.float32:
        return None
    return w, scale


def _single_user(node: Node) -> Optional[Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def match_linear(gm: GraphModule, node: Node, fuse_requant: bool = True) -> Optional[LinearMatch]:
    """Match ``linear(dq(x), dq(w_int8), bias)``, ``addmm(bias, dq(x), dq(w_int8[K, N]))``
    (HF Conv1D) or ``mm/matmul(dq(x), dq(w_int8[K, N]))``, then ``[-> relu|gelu]
    [-> quantize_per_tensor]``."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        x, w = node.args[:2]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        kn = False
    elif node.target is aten.addmm.default:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return None
        bias, x, w = node.args[:3]
        kn = True
        if not (isinstance(bias, Node) and bias.op == "get_attr" and get_attr(gm, bias.target).dim() == 1):
            return None
    elif node.target in (aten.mm.default, aten.matmul.default) and len(node.args) == 2:
        x, w = node.args  # x @ W with W a [K, N] parameter (an activation @ activation is match_matmul's)
        bias, kn = None, True
    else:
        return None
    act, weight = _act_q(x), _weight(gm, w, axis_out=1 if kn else 0)
    if act is None or weight is None:
        return None
    m = LinearMatch(node, act, weight[0], weight[1], bias, weight_kn=kn, output=node)
    user = _single_user(node)
    if user is not None and user.op == "call_function" and user.target in _ACTIVATIONS:
        approx = user.kwargs.get("approximate", user.args[1] if len(user.args) > 1 else "none")
        m.activation = _ACTIVATIONS[user.target] + ("_tanh" if approx == "tanh" else "")
        m.output = user
    user = _single_user(m.output)
    if (fuse_requant and user is not None and user.op == "call_function"
            and user.target is _Q.quantize_per_tensor.default):
        _, scale, zp, qmin, qmax, dtype = user.args[:6]
        if _full_range(qmin, qmax, dtype):
            m.out_dtype, m.out_scale, m.out_zero_point, m.output = dtype, float(scale), int(zp), user
    return m


def _val(node: Node):
    """Example value of a dequantize's result: convert's new q/dq nodes carry none, their source does."""
    for n in (node, node.args[0], node.args[0].args[0] if node.args[0].args else None):
        val = n.meta.get("val") if isinstance(n, Node) else None
        if isinstance(val, torch.Tensor):
            return val
    return None


def match_matmul(node: Node) -> Optional[MatmulMatch]:
    """Match ``matmul(dq(a), dq(b))`` of two quantized activations with equal batch dims
    (attention). The left operand may be per token (one scale per row); the right one is
    per tensor (a per-row scale of ``b`` would vary along K)."""
    if node.op != "call_function" or node.target not in (aten.matmul.default, aten.bmm.default):
        return None
    a, b = _act_q(node.args[0]), _act_q(node.args[1])
    if a is None or b is None or b.per_token:
        return None
    sa, sb = _val(node.args[0]), _val(node.args[1])
    if sa is None or sb is None or sa.dim() < 3 or sa.dim() != sb.dim() or sa.shape[:-2] != sb.shape[:-2]:
        return None
    return MatmulMatch(node, a, b)
