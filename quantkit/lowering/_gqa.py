"""Grouped-query attention without the repeated K/V copies: ``sdpa(q, repeat_kv(k), repeat_kv(v))``
→ ``sdpa(q grouped by KV head, k, v)``.

Hugging Face's SDPA attention on CPU repeats each K/V head ``g = heads / kv_heads`` times before
``scaled_dot_product_attention`` (``unsqueeze(2) → expand → reshape``). Captured with a static KV
cache, that is ``g`` full copies of every layer's cache, written and read again at each decode
step. The same attention reads the cache once when the ``g`` query heads that share a KV head are
stacked on the sequence axis: ``q [B, H, L, D] → [B, KV, g·L, D]`` (head ``h = kv·g + j``, as
``repeat_kv`` orders them), the mask repeated ``g`` times along its rows, and the output reshaped
back to ``[B, H, L, D]``. Each query row still attends to the same keys with the same mask row, so
the result is the same attention (same row-wise math; float rounding of the kernel's blocking aside).

Measured (2 threads, an AMX Xeon, fp32, one decode token): SmolLM2's 9/3 heads over a 160-slot cache
47 → 14 us per SDPA; a Llama-1B shape's 32/8 heads over 1040 slots 864 → 109 us.

Left as it is: ``is_causal=True`` (its implicit mask would not follow the stacked rows), dropout,
``enable_gqa=True`` (already grouped), masks with a per-head dimension other than 1 or ``heads``,
and K/V that are not a ``repeat_kv`` of one ``[B, KV, S, D]`` tensor.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .._graph import example_value as _val
from ._registry import LoweringContext, register_lowering

__all__ = ["group_gqa_attention", "lower_gqa_attention"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
_COPIES = (aten.clone.default, aten.contiguous.default)
# scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _static(d) -> int | None:
    """A size as an int, or None where it is symbolic (a prefill's dynamic length)."""
    return int(d) if is_concrete_int(d) else None


def _repeated_source(node) -> tuple[Node, int] | None:
    """``(src, g)`` when ``node`` is ``reshape(expand(unsqueeze(src, 2), [B, KV, g, S, D]), [B, KV·g, S, D])``."""
    if not (isinstance(node, Node) and node.op == "call_function" and node.target in _RESHAPES):
        return None
    inner = node.args[0]
    while isinstance(inner, Node) and inner.op == "call_function" and inner.target in _COPIES:
        inner = inner.args[0]
    if not (isinstance(inner, Node) and inner.op == "call_function" and inner.target is aten.expand.default):
        return None
    unsq = inner.args[0]
    if not (isinstance(unsq, Node) and unsq.op == "call_function" and unsq.target is aten.unsqueeze.default
            and unsq.args[1] == 2):
        return None
    src, big, out = unsq.args[0], _val(inner), _val(node)
    s = _val(src)
    if s is None or big is None or out is None or s.dim() != 4 or big.dim() != 5 or out.dim() != 4:
        return None
    g = _static(big.shape[2])
    kv, heads = _static(s.shape[1]), _static(out.shape[1])
    if g is None or kv is None or heads is None or g < 2 or kv * g != heads:
        return None
    return src, g


def _sdpa_call(node: Node) -> dict | None:
    bound = dict(zip(_SDPA_ARGS, node.args))
    bound.update(node.kwargs)
    if bound.get("dropout_p", 0.0) not in (0, 0.0) or bound.get("is_causal", False) or bound.get("enable_gqa", False):
        return None
    return bound


def _fake(fn, *vals):
    """``fn`` on the fake example values (a new node's ``meta["val"]``), or None where that fails."""
    try:
        return fn(*vals)
    except Exception:  # noqa: BLE001  the value is a hint for later passes, not needed to run
        return None


def _node(graph, target, args, val, kwargs=None):
    n = graph.call_function(target, args, kwargs)
    if val is not None:
        n.meta["val"] = val
    return n


def _erase_unused_chain(graph, node, stop) -> None:
    while isinstance(node, Node) and node not in stop and not node.users and node.op == "call_function":
        up = node.args[0]
        graph.erase_node(node)
        node = up


def group_gqa_attention(gm: GraphModule) -> int:
    """Rewrite every repeated-K/V SDPA in ``gm`` into grouped form (see the module docstring), in place;
    return how many were rewritten."""
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        call = _sdpa_call(node)
        if call is None:
            continue
        q, k, v, mask = call.get("query"), call.get("key"), call.get("value"), call.get("attn_mask")
        rk, rv, qv = _repeated_source(k), _repeated_source(v), _val(q)
        if rk is None or rv is None or qv is None or qv.dim() != 4 or rk[1] != rv[1]:
            continue
        (ks, g), (vs, _) = rk, rv
        kv = _static(_val(ks).shape[1])
        batch, heads, dim = (_static(d) for d in (qv.shape[0], qv.shape[1], qv.shape[3]))
        if None in (batch, heads, dim) or heads != kv * g or _static(_val(vs).shape[1]) != kv:
            continue
        mv = _val(mask) if isinstance(mask, Node) else None
        if mask is not None:
            if mv is None or mv.dim() != 4:
                continue
            mb, mh, ml, ms = (_static(d) for d in mv.shape)
            if mb is None or ms is None or mh not in (1, heads):
                continue
        with graph.inserting_before(node):
            shape_q = [batch, kv, -1, dim]
            q2 = _node(graph, aten.reshape.default, (q, shape_q), _fake(lambda t: t.reshape(shape_q), qv))
            m2 = mask
            if mask is not None and mh == heads:
                shape_m = [mb, kv, -1, ms]
                m2 = _node(graph, aten.reshape.default, (mask, shape_m), _fake(lambda t: t.reshape(shape_m), mv))
            elif mask is not None and _static(mv.shape[2]) != 1:  # one row per position: repeat it g times
                u = _node(graph, aten.unsqueeze.default, (mask, 2), _fake(lambda t: t.unsqueeze(2), mv))
                e = _node(graph, aten.expand.default, (u, [mb, 1, g, -1, -1]),
                          _fake(lambda t: t.expand(mb, 1, g, -1, -1), _val(u)))
                shape_m = [mb, 1, -1, ms]
                m2 = _node(graph, aten.reshape.default, (e, shape_m), _fake(lambda t: t.reshape(shape_m), _val(e)))
            kwargs = {key: call[key] for key in ("scale",) if call.get(key) is not None}
            # SDPA's output: the query's shape with the value's last dimension
            out = _node(graph, _SDPA, (q2, ks, vs, m2), _fake(lambda a, c: a.new_empty((*a.shape[:-1], c.shape[-1])),
                                                               _val(q2), _val(vs)), kwargs)
            shape_o = [batch, heads, -1, dim]
            back = _node(graph, aten.reshape.default, (out, shape_o), _val(node))
        node.replace_all_uses_with(back)
        graph.erase_node(node)
        for r in (k, v):  # the repeat chains, where nothing else reads them
            _erase_unused_chain(graph, r, (ks, vs))
        done += 1
    if done:
        gm.recompile()
    return done


@register_lowering("gqa_attention", order=160)
def lower_gqa_attention(gm: GraphModule, ctx: LoweringContext) -> dict[str, int]:
    """The lowering pass: after the int8 SDPA pass (150), which keeps the SDPAs it takes over."""
    n = group_gqa_attention(gm)
    return {"gqa_attention": n} if n else {}
