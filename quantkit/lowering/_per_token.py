"""CPU per-token dynamic int8: per-token linears rewritten into the form Inductor lowers to oneDNN.

``quantkit.convert`` writes a per-token layer as ``choose_qparams_per_token -> quantize_per_token
-> dequantize_per_token -> linear(dq_x, dequantize_per_channel(w_int8), bias)``. Inductor has no
pattern for that, so without this pass it runs as the reference graph (0.57x fp32 compiled on
MiniLM, issue 28). This pass writes each per-token linear whose activation is symmetric (zero
point 0: ``choose_qparams_per_token``) and whose weight is symmetric int8, per channel or per
tensor, as Inductor's own static qlinear pattern plus a per-row scale::

    q_u8 = clamp(round(x / s_x), -128, 127) + 128            (s_x: [..., 1], the per-token scale)
    y = linear(dequantize_per_tensor(q_u8, 1.0, 128), dequantize_per_channel(W_int8, s_w, 0))
    y = y * s_x [+ bias]

Inductor's freezing turns the ``linear`` into ``onednn.qlinear_pointwise`` (uint8 x int8, int32
accumulation, zero point 128 compensated from the weight's column sums, ``s_w`` applied inside,
weight prepacked once) and fuses the quantize into one C++ loop before it. The integers the GEMM
reads are the reference integers shifted by 128 (tested bit for bit).

Why uint8 and not ``aten._int_mm`` (int8 x int8, which Inductor also lowers to oneDNN): oneDNN's
fast int8 matmul on AVX-512 VNNI without AMX (``vpdpbusd``: unsigned x signed) takes a signed
activation only with an s8s8-compensated weight, which Inductor's prepack does not make, so an
int8 activation falls to oneDNN's reference ``ref_int8`` matmul -- measured on a Zen 4 (VNNI +
BF16, no AMX): 93 s for a 4096x384x1536 GEMM that ``brg_matmul:avx512_core_vnni`` runs in 50 ms.
The uint8 form runs the fast kernel on VNNI and on AMX alike, and it is the kernel the cost model
times (``accuracy/_costmodel.py``, ``qlinear``).

Numerics: ``sum_k (q_x + 128 - 128) q_w`` is an exact int32 (``|q| <= 128``, K < 2**16), so the
rewritten graph differs from the reference ``linear(q_x s_x, q_w s_w)`` only by float32 rounding
order (the reference rounds each product). Compiled, oneDNN is exact only where it accumulates in
int32: VNNI / AMX; on AVX2 its ``vpmaddubsw`` int16 pair sums saturate unless ``|w_int8| <= 64``
(``_onednn.exact_for_graph`` decides ``"auto"``).

Asymmetric activations (a zero point other than 0) keep their reference ops. Dynamic per-tensor
activations need nothing here: their ``dequantize_per_tensor.tensor -> linear`` is one of
Inductor's own qlinear patterns (the ``int8`` pass makes them uint8 first).

Linears reading one quantized activation (attention's q / k / v projections) share one GEMM over
their concatenated weights. Each weight is kept once, as the int8 buffer the GEMM reads; the
originals are dropped. Every node this pass writes has ``meta[INT8_KERNEL_META_KEY]`` (the names of
the linears it implements); see ``_Emitter`` for how they meet the int8-mixed-bf16 pass.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from .._graph import get_attr, unique_attr_name
from ._bf16 import KEEP_FLOAT32_META_KEY
from ._lower import Target
from ._match import LinearMatch, drop_unread_attrs, match_linear
from ._registry import LoweringContext, register_lowering

__all__ = ["INT8_KERNEL_META_KEY", "match_per_token_linear", "rewrite_per_token_linears", "lower_per_token"]

aten = torch.ops.aten
_Q = torch.ops.quantized_decomposed
_SHIFT = 128  # int8 -> uint8: oneDNN's fast int8 GEMMs on VNNI want an unsigned activation (see the module doc)
# node.meta key on every node this pass writes: the names of the linear nodes it replaced, comma-separated
INT8_KERNEL_META_KEY = "quantkit_int8_kernel"


def match_per_token_linear(gm: GraphModule, node: Node) -> Optional[LinearMatch]:
    """The per-token linear at ``node`` that this pass can rewrite, else None.

    Symmetric per-token int8 activation (``choose_qparams_per_token``), symmetric int8 weight
    (per output channel or per tensor), float32 output. A following relu/gelu is left in place.
    """
    m = match_linear(gm, node, fuse_requant=False)
    if m is None or not (m.act.per_token and m.act.symmetric and m.act.dtype == torch.int8):
        return None
    q = m.act.q
    x = q.args[0] if isinstance(q, Node) and q.op == "call_function" and q.args else None
    val = x.meta.get("val") if isinstance(x, Node) else None
    # float32 sources with example values only (fp16 inputs get fp16 arithmetic in torch's ops)
    if (q.target is not torch.ops.quantized_decomposed.quantize_per_token.default
            or tuple(q.args[3:6]) != (-128, 127, torch.int8)
            or not isinstance(val, torch.Tensor) or val.dtype != torch.float32 or val.dim() < 2):
        return None
    if m.bias is not None and not (isinstance(m.bias, Node) and m.bias.op == "get_attr"):
        return None
    return m


class _Emitter:
    """Writes nodes before ``anchor``, each tagged with ``meta[INT8_KERNEL_META_KEY] = tag`` and
    ``meta[KEEP_FLOAT32_META_KEY]``.

    The second tag makes the int8-mixed-bf16 pass (``_bf16.py``) leave the chain as it is: it
    casts none of its inputs and none of its nodes becomes bf16, so the quantize and the per-token
    scale stay the float32 reference arithmetic under ``float_dtype="bf16"`` too (an activation
    that an earlier op made bf16 is read through the chain's own float32 copy). The chain's results
    carry the replaced linears' float32 example values, so their readers cast them as they cast
    the linears' outputs.
    """

    def __init__(self, gm: GraphModule, anchor: Node, tag: str) -> None:
        self.gm, self.anchor, self.tag = gm, anchor, tag

    def __call__(self, target, *args, **kwargs) -> Node:
        with self.gm.graph.inserting_before(self.anchor):
            n = self.gm.graph.call_function(target, args, kwargs)
        n.meta[INT8_KERNEL_META_KEY] = self.tag
        n.meta[KEEP_FLOAT32_META_KEY] = True
        return n

    def buffer(self, base: str, value: torch.Tensor) -> Node:
        name = unique_attr_name(self.gm, base)
        self.gm.register_buffer(name, value)
        with self.gm.graph.inserting_before(self.anchor):
            n = self.gm.graph.get_attr(name)
        n.meta[INT8_KERNEL_META_KEY] = self.tag
        n.meta[KEEP_FLOAT32_META_KEY] = True
        return n


def _quantize(emit: _Emitter, x: Node) -> tuple[Node, Node]:
    """``choose_qparams_per_token`` + ``quantize_per_token`` of ``x`` written as aten ops, shifted to
    uint8: ``(q + 128 as uint8, scale)``.

    The same float32 operations in the same order as torch's decomposed implementations
    (``scale = clamp(amax|x|, min=1e-5) / 127``, ``q = clamp(round(x * (1 / scale)), -128, 127)``),
    so the integers and scales are the reference ones; the ``+ 128`` is exact. Why not keep the two
    ops: Inductor runs them as Python fallbacks (several eager passes over the activation), and the
    meta function of ``choose_qparams_per_token`` says float64 while the op returns float32 (torch
    2.13), so a fused kernel reading its scale would read float32 memory as float64. The explicit
    float32 copy first is a no-op on a float32 graph and keeps the arithmetic float32 where a later
    pass made ``x`` bf16 (the reference quantizes ``x.float()`` there too).
    """
    x = emit(aten._to_copy.default, x, dtype=torch.float32)
    scale = emit(aten.div.Tensor, emit(aten.clamp_min.default,
                                       emit(aten.amax.default, emit(aten.abs.default, x), [-1], True), 1e-5), 127)
    q = emit(aten.round.default, emit(aten.mul.Tensor, x, emit(aten.reciprocal.default, scale)))
    q = emit(aten.add.Tensor, emit(aten.clamp.default, q, -128, 127), _SHIFT)
    return emit(aten._to_copy.default, q, dtype=torch.uint8), scale


def _rewrite(gm: GraphModule, group: list[LinearMatch], old_weights: set) -> list[Node]:
    """Write one uint8 GEMM chain for the linears of ``group`` (one quantized input); return, per
    linear, the node whose value replaces it (a slice of the fused output when there are several)."""
    first = group[0]
    x = first.act.q.args[0]
    weights, scales = [], []
    for m in group:
        w = get_attr(gm, m.weight.target)
        w_nk = w.t() if m.weight_kn else w
        weights.append(w_nk)
        s = get_attr(gm, m.w_scale.target) if isinstance(m.w_scale, Node) else torch.tensor(float(m.w_scale))
        scales.append(s.reshape(-1).to(torch.float32).expand(w_nk.shape[0]))
        # the originals this chain replaces: weight, its qparams, a fused group's biases
        qparams = [a for dq in m.weight.users for a in dq.args[1:3]]  # the weight dequantize's scale, zero point
        old_weights.update(a.target for a in [m.weight, *qparams] if isinstance(a, Node) and a.op == "get_attr")
        if len(group) > 1 and m.bias is not None:
            old_weights.add(m.bias.target)
    sizes = [w.shape[0] for w in weights]
    anchor = min((m.linear for m in group), key=lambda n: _position(gm, n))
    emit = _Emitter(gm, anchor, ",".join(m.linear.name for m in group))
    q, scale = _quantize(emit, x)
    w_node = emit.buffer("_qk_weight_", torch.cat(weights, dim=0).contiguous())  # one int8 copy, [N, K]
    w_scale = emit.buffer("_qk_w_scale_", torch.cat(scales).contiguous())
    w_zp = emit.buffer("_qk_w_zp_", torch.zeros(sum(sizes), dtype=torch.int64))
    bias = first.bias
    if bias is not None and len(group) > 1:
        bias = emit.buffer("_qk_bias_", torch.cat([get_attr(gm, m.bias.target).to(torch.float32) for m in group]))
    # Inductor's static qlinear pattern: uint8 activation (zero point 128, scale 1: the integers
    # themselves), per-channel int8 weight, float32 out; the per-token scale is applied after it
    dq_x = emit(_Q.dequantize_per_tensor.default, q, 1.0, _SHIFT, 0, 255, torch.uint8)
    dq_w = emit(_Q.dequantize_per_channel.default, w_node, w_scale, w_zp, 0, -128, 127, torch.int8)
    y = emit(aten.mul.Tensor, emit(aten.linear.default, dq_x, dq_w), scale)  # [..., N] * [..., 1]
    if bias is not None:
        y = emit(aten.add.Tensor, y, bias)
    # float32 out, explicitly (a no-op here): readers cast it as they cast the linear's output
    y = emit(aten._to_copy.default, y, dtype=torch.float32)
    outs = [y]
    if len(group) > 1:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        outs = [emit(aten.slice.Tensor, y, -1, a, a + n) for a, n in zip(starts, sizes)]
    for m, out in zip(group, outs):
        if isinstance(m.linear.meta.get("val"), torch.Tensor):
            out.meta["val"] = m.linear.meta["val"]
        if len(group) > 1:
            for user in m.linear.users:  # a slice is not contiguous: a view merging its last dim would fail
                if user.target is aten.view.default:
                    user.target = aten.reshape.default
    return outs


def _position(gm: GraphModule, node: Node) -> int:
    for i, n in enumerate(gm.graph.nodes):
        if n is node:
            return i
    raise AssertionError(f"{node} is not in the graph")


def rewrite_per_token_linears(gm: GraphModule) -> int:
    """Rewrite every matching per-token linear of ``gm`` (in place) into the uint8 qlinear form.

    Linears that read one quantized activation (attention's query / key / value projections)
    share one GEMM over their concatenated int8 weights, then slices: each output element
    is the same integer dot product. Returns the number of linears rewritten. The original
    weights they read are deleted from ``gm`` once nothing reads them.
    """
    groups: dict[tuple, list[LinearMatch]] = {}
    for node in gm.graph.nodes:
        m = match_per_token_linear(gm, node)
        if m is None:
            continue
        groups.setdefault((m.act.q, m.bias is None), []).append(m)
    old_weights: set = set()
    count = 0
    for group in groups.values():
        for m, new in zip(group, _rewrite(gm, group, old_weights)):
            m.linear.replace_all_uses_with(new)
            count += 1
    if count:
        gm.graph.eliminate_dead_code()
        drop_unread_attrs(gm, old_weights)  # one int8 copy of each weight: the one the GEMM reads
        gm.graph.lint()
        gm.recompile()
    return count


@register_lowering("int8_per_token", order=150, devices=("cpu",))
def lower_per_token(gm: GraphModule, ctx: LoweringContext) -> dict[str, int]:
    """The registered pass: :func:`rewrite_per_token_linears` where ``compile`` chose oneDNN on CPU.

    Records ``per_token_linears`` (linears rewritten) and ``per_token_gemms`` (the GEMMs written:
    fewer where siblings share one)."""
    if ctx.target != Target.ONEDNN:  # an enum member or its string value
        return {}
    linears = rewrite_per_token_linears(gm)
    gemms = sum(1 for n in gm.graph.nodes if n.target is aten.linear.default and INT8_KERNEL_META_KEY in n.meta)
    return {"per_token_linears": linears, "per_token_gemms": gemms}
