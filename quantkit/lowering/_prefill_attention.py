"""A KV-cache program's attention runs in bf16 for prompts, in float32 for decode steps (AMX CPUs).

Every float32 ``scaled_dot_product_attention`` of a KV-cache program (``quantkit.capture(...,
max_cache_len=N)``) becomes ``quantkit::sdpa_prefill_bf16``, which computes in bf16 from
``PREFILL_ROWS`` query rows on (a prompt: one call over many positions) and in float32 below (a decode
step's 1 row, or ``heads / kv_heads`` rows once ``gqa_attention`` has grouped them). The int4
kernel switches to its bf16 GEMM at the same row count, so a prompt is bf16 arithmetic throughout
its GEMMs and attention while decode keeps float32 attention.

Only on CPUs with AMX (``_bf16.bf16_float_ops_pay``): measured there, SmolLM2-135M w4a16 prefill
829 -> 558 ms at 1024 tokens, 1.18x at 128 (2 threads, ``benchmarks/bench_decode.py`` row
``quantkit-w4a16-fp32-prompt-attn`` against ``quantkit-w4a16``, BENCHMARKS.md); without AMX (Zen 4: AVX-512 BF16 alone) bf16 float ops measured
slower than float32 for the int8 graphs, and this path is not measured there. An explicit
``float_dtype="fp32"`` keeps float32 attention. SDPAs with dropout, ``is_causal`` or ``enable_gqa``,
and attention the bf16 pass already runs in bf16, are left alone.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from quantkit.kernels._int4_cpu import PREFILL_ROWS
from quantkit.kernels._prefill_sdpa import sdpa_prefill_bf16 as _register_op  # noqa: F401  (defines the op)

from .._graph import example_value as _val
from ..pipeline._kv_capture import kv_cache_info
from ._bf16 import bf16_float_ops_pay
from ._registry import LoweringContext, register_lowering

__all__ = ["prefill_attention_bf16", "lower_prefill_attention"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _float32(node) -> bool:
    val = _val(node) if isinstance(node, Node) else None
    return isinstance(val, torch.Tensor) and val.dtype == torch.float32


_VIEWS = (aten.reshape.default, aten.view.default, aten.expand.default, aten.unsqueeze.default,
          aten._unsafe_view.default, aten.clone.default, aten.contiguous.default)


def _signature(node):
    """A hashable description of ``node`` through view-like ops down to the first other node: two
    layers' masks with one signature hold the same values (``gqa_attention`` builds one chain per layer
    from the same causal mask). A size read from another node (a symbolic length) compares by that
    node's identity."""
    parts = []
    while isinstance(node, Node) and node.op == "call_function" and node.target in _VIEWS:
        rest = tuple(a if not isinstance(a, (list, tuple)) else tuple(a) for a in node.args[1:])  # sizes read
        parts.append((node.target, rest, tuple(sorted(node.kwargs.items()))))
        node = node.args[0]
    return node, tuple(parts)


def _erase_dead(graph, node) -> None:
    while isinstance(node, Node) and node.op == "call_function" and not node.users and node.target in _VIEWS:
        up = node.args[0]
        graph.erase_node(node)
        node = up


def _additive_bf16(graph, mask: Node) -> Node:
    """``where(mask, 0, -inf)`` in bf16, right after ``mask``: 0 and -inf are exact in bf16, so the
    float32 path reads the same mask through a cast and the bf16 path reads it as it is."""
    with graph.inserting_after(mask):
        add = graph.call_function(aten.where.Scalar, (mask, 0.0, float("-inf")))
    with graph.inserting_after(add):
        out = graph.call_function(aten._to_copy.default, (add,), {"dtype": torch.bfloat16})
    val = _val(mask)
    if isinstance(val, torch.Tensor):
        try:
            add.meta["val"] = val.new_empty(val.shape, dtype=torch.float32)
            out.meta["val"] = val.new_empty(val.shape, dtype=torch.bfloat16)
        except Exception:  # noqa: BLE001  a hint for later passes only
            pass
    return out


def prefill_attention_bf16(gm: GraphModule, min_rows: int = PREFILL_ROWS) -> int:
    """Rewrite every float32 SDPA of ``gm`` into ``quantkit::sdpa_prefill_bf16``; returns how many.

    A boolean mask becomes one additive bf16 mask per distinct mask (computed once per call and read
    by every layer): converting it inside each attention call measured 6 ms of a 12 ms bf16 SDPA at
    1024 tokens, and the per-layer copies of ``gqa_attention``'s repeated mask 8 ms each."""
    graph, done = gm.graph, 0
    shared: dict = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        bound = dict(zip(_SDPA_ARGS, node.args))
        bound.update(node.kwargs)
        if (bound.get("dropout_p", 0.0) not in (0, 0.0) or bound.get("is_causal", False)
                or bound.get("enable_gqa", False)):
            continue
        q, k, v, mask = bound["query"], bound["key"], bound["value"], bound.get("attn_mask")
        if not all(_float32(t) for t in (q, k, v)):
            continue
        old_mask = None
        mval = _val(mask) if isinstance(mask, Node) else None
        if isinstance(mval, torch.Tensor) and mval.dtype == torch.bool:
            key = _signature(mask)
            if key not in shared:
                shared[key] = _additive_bf16(graph, mask)
            elif shared[key].args[0].args[0] is not mask:
                old_mask = mask
            mask = shared[key]
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.quantkit.sdpa_prefill_bf16.default,
                                      (q, k, v, mask, bound.get("scale"), int(min_rows)))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        _erase_dead(graph, old_mask)
        done += 1
    if done:
        gm.recompile()
    return done


@register_lowering("prefill_attention_bf16", order=430, devices=("cpu",))
def lower_prefill_attention(gm: GraphModule, ctx: LoweringContext) -> dict[str, int]:
    """The lowering pass: last on CPU (after ``bf16`` at 400, whose bf16 attention it leaves alone)."""
    if ctx.requested_float_dtype == "fp32" or kv_cache_info(gm) is None or not bf16_float_ops_pay():
        return {}
    n = prefill_attention_bf16(gm)
    return {"prefill_attention_bf16": n} if n else {}
