"""Int8 attention on CPU: ``sdpa(dq(q8), dq(k8), dq(v8), mask)`` → ``quantkit::int8_sdpa_cpu`` on the integers.

``W8A8Quantizer(QuantConfig(ops={..., "attention"}))`` quantizes the q, k and v inputs of
``scaled_dot_product_attention`` per tensor; ``quantkit.convert`` then leaves each of them as a
static ``quantize_per_tensor`` → ``dequantize_per_tensor``, usually followed by the head split
(``view`` / ``transpose``, moved below the quantize by the quantizer's propagation), and the SDPA
runs in float32 on the dequantized tensors: the reference. This pass hands the stored integers
to ``kernels/_int8_sdpa_cpu.py`` instead: the same shape ops are replayed on the integer tensor
(no float copy of q, k or v is made), ``Q.K^T`` is exact int32, the rest float32.

Left as it is (reference numerics): dynamic q/k/v (their qparams are graph values), dropout,
``enable_gqa``, q/k/v of different integer dtypes, and every SDPA when the kernel cannot be built
here (``kernel_status()`` says why). torchao 0.18's ``torchao::qscaled_dot_product`` is not used:
this build registers no CPU kernel for it (``torchao_qsdpa_status()`` probes it once), and it also
quantizes the softmax output, which the reference graph keeps in float.
"""

from __future__ import annotations

import functools

import torch
from torch.fx import GraphModule, Node

from quantkit.kernels import _int8_sdpa_cpu

from ._registry import LoweringContext, register_lowering

__all__ = ["lower_int8_sdpa", "lower_int8_sdpa_pass", "kernel_status", "torchao_qsdpa_status", "SHAPE_OPS"]

aten = torch.ops.aten
_Q = torch.ops.quantized_decomposed
_SDPA = aten.scaled_dot_product_attention.default
_DQ = _Q.dequantize_per_tensor.default  # static: python scale and zero point
# the head split between a quantize and the SDPA: ops that only move values (replayed on the integers)
SHAPE_OPS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
                       aten.transpose.int, aten.expand.default, aten.unsqueeze.default, aten.contiguous.default,
                       aten.clone.default})


def kernel_status():
    """Whether quantkit's int8 SDPA kernel runs here (a ``KernelStatus``; ``.describe()`` is one line)."""
    return _int8_sdpa_cpu.status()


@functools.cache
def torchao_qsdpa_status() -> str:
    """One line: whether ``torch.ops.torchao.qscaled_dot_product`` runs on CPU here (a tiny probe call)."""
    op = getattr(getattr(torch.ops, "torchao", None), "qscaled_dot_product", None)
    if op is None:
        return "torchao::qscaled_dot_product: not in this torchao"
    x = torch.full((1, 1, 2, 4), 128, dtype=torch.uint8)
    try:
        op(x, x, x, None, 0.0, False, None, 0.1, 128, 0.1, 128, 0.1, 128, 1 / 255, 0, 0.1, 128)
    except Exception as exc:  # noqa: BLE001  any refusal is the answer
        return f"torchao::qscaled_dot_product does not run on CPU here ({' '.join(str(exc).split())[:120]})"
    return "torchao::qscaled_dot_product runs on CPU here (not used: it also quantizes the softmax output)"


def _integer_source(arg):
    """``(dq node, [shape ops from the dq to arg])`` when ``arg`` is a static per-tensor int8/uint8
    dequantize seen through shape ops, else None."""
    chain = []
    node = arg
    while isinstance(node, Node) and node.op == "call_function" and node.target in SHAPE_OPS:
        if node.target is aten.clone.default and node.kwargs.get("memory_format") not in (None, torch.contiguous_format):
            return None
        chain.append(node)
        node = node.args[0]
    if not (isinstance(node, Node) and node.op == "call_function" and node.target is _DQ):
        return None
    if node.kwargs.get("out_dtype", torch.float32) != torch.float32 or len(node.args) < 6:
        return None
    _, scale, zp, _, _, dtype = node.args[:6]
    if dtype not in (torch.int8, torch.uint8) or isinstance(scale, Node) or isinstance(zp, Node):
        return None
    return node, chain[::-1]


def _match(node: Node):
    """``(sources of q, k, v, mask, scale, is_causal)`` for an SDPA this pass lowers, else None."""
    if node.op != "call_function" or node.target is not _SDPA:
        return None
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    args = dict(zip(names, node.args))
    args.update(node.kwargs)
    if args.get("dropout_p", 0.0) != 0.0 or args.get("enable_gqa", False):
        return None
    srcs = [_integer_source(args.get(n)) for n in names[:3]]
    if any(s is None for s in srcs) or len({s[0].args[5] for s in srcs}) != 1:
        return None
    return srcs, args.get("attn_mask"), args.get("scale"), bool(args.get("is_causal", False))


def _replay(graph, dq: Node, chain: list[Node]) -> Node:
    """The shape ops of ``chain`` applied to the integer tensor that ``dq`` dequantizes."""
    x = dq.args[0]
    for op in chain:
        x = graph.call_function(op.target, (x,) + tuple(op.args[1:]), dict(op.kwargs))
    return x


def lower_int8_sdpa(gm: GraphModule) -> dict[str, int]:
    """Rewrite every matching SDPA of ``gm`` (in place) into ``quantkit::int8_sdpa_cpu``; return
    ``{"int8_sdpa": count}``. The q/dq ops and shape ops it no longer reads are removed."""
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        m = _match(node)
        if m is None:
            continue
        srcs, mask, scale, causal = m
        (dq_q, ch_q), (dq_k, ch_k), (dq_v, ch_v) = srcs
        with graph.inserting_before(node):
            q, k, v = (_replay(graph, dq, ch) for dq, ch in srcs)
            if causal:  # lower-triangular: query t sees keys s <= t (SDPA's is_causal, no other mask then)
                t = graph.call_function(aten.sym_size.int, (q, 2))
                s = graph.call_function(aten.sym_size.int, (k, 2))
                ones = graph.call_function(aten.ones.default, ([t, s],), {"dtype": torch.bool})
                mask = graph.call_function(aten.tril.default, (ones,))
            out = graph.call_function(torch.ops.quantkit.int8_sdpa_cpu.default, (
                q, k, v, mask, float(dq_q.args[1]), int(dq_q.args[2]), float(dq_k.args[1]), int(dq_k.args[2]),
                float(dq_v.args[1]), int(dq_v.args[2]), None if scale is None else float(scale)))
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        count += 1
    if count:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    return {"int8_sdpa": count}


@register_lowering("int8_sdpa", order=150, devices=("cpu",))
def lower_int8_sdpa_pass(gm: GraphModule, ctx: LoweringContext) -> dict[str, int]:
    """The registered pass: on CPU unless ``cpu_kernels="reference"``, where the kernel builds here
    (else the graph keeps its reference attention: ``kernel_status()`` has the one-line reason)."""
    if ctx.cpu_kernels == "reference" or not any(n.target is _SDPA for n in gm.graph.nodes):
        return {}
    if not kernel_status().available:
        return {}
    counts = lower_int8_sdpa(gm)
    return {k: v for k, v in counts.items() if v}
