"""CPU per-token dynamic int8: per-token linears rewritten into the form Inductor lowers to oneDNN.

``quantkit.convert`` writes a per-token layer as ``choose_qparams_per_token -> quantize_per_token
-> dequantize_per_token -> linear(dq_x, dequantize_per_channel(w_int8), bias)``. Inductor has no
pattern for that, so without this pass it runs as the reference graph (0.57x fp32 compiled on
MiniLM, issue 28). Inductor's freezing does have a pattern for torchao's int8 dynamic linear
(``_register_smooth_quant_int_mm_pattern``, torch 2.13 ``fx_passes/quantization.py``)::

    reshape(x_int8, [M, K]) -> aten._int_mm(., W_int8[K, N] constant) -> to(float32)
      -> mul(x_scale [M, 1]) -> mul(w_scale [N]) -> reshape([..., N]) [-> add(bias)]

which becomes ``onednn.qlinear_pointwise`` (int8 x int8, int32 accumulation, ``w_scale``
applied inside, weight prepacked once at freezing) followed by the ``x_scale`` multiply and the
bias add. This pass writes exactly that form for each per-token linear whose activation is
symmetric (zero point 0: ``choose_qparams_per_token``) and whose weight is symmetric int8,
per channel or per tensor. The graph's ``choose_qparams_per_token`` / ``quantize_per_token`` pair
is written out as the aten ops of torch's own implementation (``_quantize``: Inductor fuses them
into one C++ loop), so the integers the GEMM reads are the reference integers (tested bit for bit).

Numerics: ``sum_k q_x q_w`` is an exact int32 (``|q| <= 127``, K < 2**17), so the rewritten
graph differs from the reference ``linear(q_x s_x, q_w s_w)`` only by float32 rounding order
(the reference rounds each product). Run eagerly, ``aten._int_mm`` is exact on CPU. Compiled, oneDNN
is exact only where it accumulates in int32: VNNI / AMX; on AVX2 its ``vpmaddubsw`` int16 pair
sums saturate unless ``|w_int8| <= 64`` (``_onednn.exact_for_graph`` decides ``"auto"``).

Asymmetric activations (a zero point other than 0) keep their reference ops. Dynamic per-tensor
activations need nothing here: their ``dequantize_per_tensor.tensor -> linear`` is one of
Inductor's own qlinear patterns (the ``int8`` pass makes them uint8 first).

Each weight is kept once, as the ``[K, N]`` int8 buffer ``_int_mm`` reads; the ``[N, K]``
original is dropped. Every node this pass writes has ``meta[INT8_KERNEL_META_KEY]`` (the names of
the linears it implements); see ``_Emitter`` for how they meet the int8-mixed-bf16 pass.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node

from .._graph import get_attr, unique_attr_name
from ._lower import Target
from ._match import LinearMatch, drop_unread_attrs, match_linear
from ._registry import LoweringContext, register_lowering

__all__ = ["INT8_KERNEL_META_KEY", "match_per_token_linear", "rewrite_per_token_linears", "lower_per_token"]

aten = torch.ops.aten
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
    """Writes nodes before ``anchor``, each tagged with ``meta[INT8_KERNEL_META_KEY] = tag``.

    The nodes carry no example value (``meta["val"]``): their dtypes are fixed by the chain itself
    (int8 -> int32 -> float32), and the int8-mixed-bf16 pass (``_bf16.py``) then leaves them as they
    are -- it casts only the inputs whose example value says float32 and marks bf16 only nodes
    that have one -- so the integers stay the float32 reference ones under ``float_dtype="bf16"`` too.
    Only the float32 results that replace the linears get the linears' example values.
    """

    def __init__(self, gm: GraphModule, anchor: Node, tag: str) -> None:
        self.gm, self.anchor, self.tag = gm, anchor, tag

    def __call__(self, target, *args, **kwargs) -> Node:
        with self.gm.graph.inserting_before(self.anchor):
            n = self.gm.graph.call_function(target, args, kwargs)
        n.meta[INT8_KERNEL_META_KEY] = self.tag
        return n

    def buffer(self, base: str, value: torch.Tensor) -> Node:
        name = unique_attr_name(self.gm, base)
        self.gm.register_buffer(name, value)
        with self.gm.graph.inserting_before(self.anchor):
            n = self.gm.graph.get_attr(name)
        n.meta[INT8_KERNEL_META_KEY] = self.tag
        return n


def _quantize(emit: _Emitter, x: Node) -> tuple[Node, Node]:
    """``choose_qparams_per_token`` + ``quantize_per_token`` of ``x`` written as aten ops: (int8, scale).

    The same float32 operations in the same order as torch's decomposed implementations
    (``scale = clamp(amax|x|, min=1e-5) / 127``, ``q = clamp(round(x * (1 / scale)), -128, 127)``),
    so the integers and scales are the reference ones. Why not keep the two ops: Inductor runs
    them as Python fallbacks (several eager passes over the activation), and the meta function
    of ``choose_qparams_per_token`` says float64 while the op returns float32 (torch 2.13), so a
    fused kernel reading its scale would read float32 memory as float64. The explicit float32
    copy first is a no-op on a float32 graph and keeps the arithmetic float32 where a later pass
    made ``x`` bf16 (the reference quantizes ``x.float()`` there too).
    """
    x = emit(aten._to_copy.default, x, dtype=torch.float32)
    scale = emit(aten.div.Tensor, emit(aten.clamp_min.default,
                                       emit(aten.amax.default, emit(aten.abs.default, x), [-1], True), 1e-5), 127)
    q = emit(aten.round.default, emit(aten.mul.Tensor, x, emit(aten.reciprocal.default, scale)))
    return emit(aten._to_copy.default, emit(aten.clamp.default, q, -128, 127), dtype=torch.int8), scale


def _rewrite(gm: GraphModule, group: list[LinearMatch], old_weights: set) -> list[Node]:
    """Write one ``_int_mm`` chain for the linears of ``group`` (one quantized input); return, per
    linear, the node whose value replaces it (a slice of the fused output when there are several)."""
    first = group[0]
    x = first.act.q.args[0]
    rank = x.meta["val"].dim()
    weights, scales = [], []
    for m in group:
        w = get_attr(gm, m.weight.target)
        w_kn = w if m.weight_kn else w.t()
        weights.append(w_kn)
        s = get_attr(gm, m.w_scale.target) if isinstance(m.w_scale, Node) else torch.tensor(float(m.w_scale))
        scales.append(s.reshape(-1).to(torch.float32).expand(w_kn.shape[1]))
        # the originals this chain replaces: weight, its qparams, a fused group's biases
        qparams = [a for dq in m.weight.users for a in dq.args[1:3]]  # the weight dequantize's scale, zero point
        old_weights.update(a.target for a in [m.weight, *qparams] if isinstance(a, Node) and a.op == "get_attr")
        if len(group) > 1 and m.bias is not None:
            old_weights.add(m.bias.target)
    k = weights[0].shape[0]
    sizes = [w.shape[1] for w in weights]
    anchor = min((m.linear for m in group), key=lambda n: _position(gm, n))
    emit = _Emitter(gm, anchor, ",".join(m.linear.name for m in group))
    q, scale = _quantize(emit, x)
    w_node = emit.buffer("_qk_weight_kn_", torch.cat(weights, dim=1).contiguous())  # one int8 copy, [K, N]
    w_scale = emit.buffer("_qk_w_scale_", torch.cat(scales).contiguous())
    bias = first.bias
    if bias is not None and len(group) > 1:
        bias = emit.buffer("_qk_bias_", torch.cat([get_attr(gm, m.bias.target).to(torch.float32) for m in group]))
    if rank != 2:  # [..., K] -> [M, K]; leading sizes read from the input so a dynamic batch stays symbolic
        lead = [emit(aten.sym_size.int, q, d) for d in range(rank - 1)]
        q = emit(aten.reshape.default, q, [-1, k])
        scale = emit(aten.reshape.default, scale, [-1, 1])
    y = emit(aten._to_copy.default, emit(aten._int_mm.default, q, w_node), dtype=torch.float32)
    y = emit(aten.mul.Tensor, emit(aten.mul.Tensor, y, scale), w_scale)  # per token (row), then per channel
    if rank != 2:
        y = emit(aten.reshape.default, y, lead + [sum(sizes)])
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
    """Rewrite every matching per-token linear of ``gm`` (in place) into the ``_int_mm`` form.

    Linears that read one quantized activation (attention's query / key / value projections)
    share one GEMM over their concatenated ``[K, N]`` weights, then slices: each output element
    is the same integer dot product. Returns the number of linears rewritten. The ``[N, K]``
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
        drop_unread_attrs(gm, old_weights)  # one int8 copy of each weight: the [K, N] one
        gm.graph.lint()
        gm.recompile()
    return count


@register_lowering("int8_per_token", order=150, devices=("cpu",))
def lower_per_token(gm: GraphModule, ctx: LoweringContext) -> dict[str, int]:
    """The registered pass: :func:`rewrite_per_token_linears` where ``compile`` chose oneDNN on CPU.

    Records ``per_token_int_mm`` (linears rewritten) and ``per_token_gemms`` (``_int_mm`` nodes:
    fewer where siblings share one)."""
    if ctx.target != Target.ONEDNN:  # an enum member or its string value
        return {}
    linears = rewrite_per_token_linears(gm)
    gemms = sum(1 for n in gm.graph.nodes if n.target is aten._int_mm.default and INT8_KERNEL_META_KEY in n.meta)
    return {"per_token_int_mm": linears, "per_token_gemms": gemms}
