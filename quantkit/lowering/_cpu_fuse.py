"""CPU int8 graph clean-ups before Inductor: fewer q/dq round trips, fewer and larger GEMMs.

Two exact rewrites of a ``quantkit.convert`` graph, run by the oneDNN lowering before
Inductor's freezing patterns see it:

- ``collapse_requantize_chains``: the quantizer shares one set of qparams across shape ops
  (reshape / transpose / view between SDPA and the output projection), so ``convert`` writes
  ``q -> dq -> reshape -> q -> dq -> transpose -> q -> dq -> linear``. A dequantized value
  quantized again with the same qparams is the same integer (``(i - z) * s / s`` is within
  ``|i - z| * 2**-23`` of ``i - z`` in float32, far from a rounding boundary), so the shape ops
  move onto the integers: ``q -> reshape -> transpose -> dq -> linear``: one quantize, one
  dequantize, and the shape ops copy uint8 instead of float.
- ``fuse_sibling_linears``: linears that read the same quantized activation (attention's
  query / key / value projections) become one linear over the concatenated int8 weights
  (per output channel: scales, zero points and biases concatenate too) followed by slices:
  one oneDNN GEMM with N = 3 * hidden instead of three, and the activation read once. Each
  output element is the same dot product; on oneDNN the int32 accumulation makes it exact.

Both work in place on the graph module and return a count.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from .._graph import get_attr, unique_attr_name
from ._match import drop_unread_attrs

__all__ = ["collapse_requantize_chains", "fuse_sibling_linears"]

aten = torch.ops.aten
_Q = torch.ops.quantized_decomposed
# ops that only rearrange elements (no arithmetic): valid on the integers as on the floats
_SHAPE_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.flatten.using_ints, aten.t.default,
}
# float32 -> integer -> float32 round trip is exact only while |i - z| * 2**-23 << 0.5
_INT_DTYPES = (torch.uint8, torch.int8)


def _is(node, target) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def _retype(node: Node, dtype: torch.dtype) -> None:
    """Make ``node``'s example value say it now carries ``dtype`` (later passes read it)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        try:
            node.meta["val"] = val.to(dtype)
        except Exception:  # a fake tensor outside its mode: drop the stale example
            node.meta.pop("val", None)


def collapse_requantize_chains(gm: GraphModule) -> int:
    """Rewrite ``quantize(shape_ops(dequantize(i)))`` with equal qparams as ``shape_ops(i)``; in place.

    Only static per-tensor q/dq with python-number qparams (``convert``'s static activations)
    are touched; every shape op in the chain must have one user. Returns the number of
    quantize/dequantize pairs removed.
    """
    graph, count = gm.graph, 0
    for q2 in list(graph.nodes):
        if not _is(q2, _Q.quantize_per_tensor.default) or q2.args[5] not in _INT_DTYPES:
            continue
        chain, n = [], q2.args[0]
        while isinstance(n, Node) and n.op == "call_function" and n.target in _SHAPE_OPS and len(n.users) == 1:
            chain.append(n)
            n = n.args[0]
        if not _is(n, _Q.dequantize_per_tensor.default) or len(n.users) != 1 or tuple(n.args[1:6]) != tuple(q2.args[1:6]):
            continue
        if n.kwargs.get("out_dtype") not in (None, torch.float32):
            continue
        ints = n.args[0]  # the integer tensor dequantized at the head of the chain
        if chain:
            chain[-1].args = (ints,) + tuple(chain[-1].args[1:])
            for c in chain:
                _retype(c, q2.args[5])
            q2.replace_all_uses_with(chain[0])
        else:
            q2.replace_all_uses_with(ints)
        graph.erase_node(q2)
        graph.erase_node(n)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def _linear_parts(gm: GraphModule, lin: Node):
    """(activation dq, weight int8, scale, zero point, bias tensor or None, weight dq args) or None."""
    if len(lin.args) < 2:
        return None
    x, wdq = lin.args[0], lin.args[1]
    bias = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
    if not _is(x, _Q.dequantize_per_tensor.default) or len(x.users) != 1:
        return None
    if not _is(wdq, _Q.dequantize_per_channel.default) or len(wdq.users) != 1 or wdq.kwargs:
        return None
    w, s, z, axis = wdq.args[:4]
    if axis != 0 or not all(isinstance(a, Node) and a.op == "get_attr" for a in (w, s, z)):
        return None
    if bias is not None and not (isinstance(bias, Node) and bias.op == "get_attr"):
        return None
    return (x, get_attr(gm, w.target), get_attr(gm, s.target), get_attr(gm, z.target),
            None if bias is None else get_attr(gm, bias.target), tuple(wdq.args[4:]))


def fuse_sibling_linears(gm: GraphModule) -> int:
    """Merge linears that read one quantized activation into one linear + slices; in place.

    A group is every ``linear(dequantize(q), dequantize_per_channel(w_int8, axis 0), bias)``
    whose activation dequantizes the same quantize node ``q`` with the same qparams, with
    int8 weights of one shape ``[*, K]``, one weight quantization range, and biases on all or
    none. Returns the number of linears removed (a group of three counts two).
    """
    graph, removed = gm.graph, 0
    groups: dict[tuple, list] = {}
    for lin in graph.nodes:
        if not _is(lin, aten.linear.default):
            continue
        parts = _linear_parts(gm, lin)
        if parts is None:
            continue
        x, w, s, z, b, wrange = parts
        if w.dtype != torch.int8 or x.args[5] not in _INT_DTYPES:  # int8 GEMMs only (not FP8)
            continue
        key = (x.args[0], tuple(x.args[1:]), w.shape[1:], w.dtype, wrange, b is None)
        groups.setdefault(key, []).append((lin, parts))
    old_attrs = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        first = members[0][0]
        ws = [p[1] for _, p in members]
        w = torch.cat(ws)
        s = torch.cat([p[2].reshape(-1).expand(len(p[1])) for _, p in members])
        z = torch.cat([p[3].reshape(-1).expand(len(p[1])) for _, p in members])
        b = None if members[0][1][4] is None else torch.cat([p[4] for _, p in members])
        names = {}
        for label, t in (("weight", w), ("scale", s), ("zero_point", z), ("bias", b)):
            if t is not None:
                names[label] = unique_attr_name(gm, f"_qk_fused_{label}", sep="_")
                gm.register_buffer(names[label], t.contiguous())
        with graph.inserting_before(first):
            get = {k: graph.get_attr(v) for k, v in names.items()}
            wdq = graph.call_function(_Q.dequantize_per_channel.default,
                                      (get["weight"], get["scale"], get["zero_point"], 0) + members[0][1][5])
            x = first.args[0]
            fused = graph.call_function(aten.linear.default, (x, wdq, get.get("bias")))
            start = 0
            for lin, (_, wi, *_rest) in members:
                sl = graph.call_function(aten.slice.Tensor, (fused, -1, start, start + wi.shape[0]))
                sl.meta.update(lin.meta)
                start += wi.shape[0]
                old_attrs.update(a.target for a in lin.args[1].args[:3] if isinstance(a, Node))
                if len(lin.args) > 2 and isinstance(lin.args[2], Node):
                    old_attrs.add(lin.args[2].target)
                lin.replace_all_uses_with(sl)
                for user in sl.users:  # a slice is not contiguous: a view merging its last dim would fail
                    if user.target is aten.view.default:
                        user.target = aten.reshape.default
        val = first.meta.get("val")
        if isinstance(val, torch.Tensor):
            try:
                fused.meta["val"] = torch.cat([lin.meta["val"] for lin, _ in members], dim=-1)
            except Exception:
                pass
        removed += len(members) - 1
    if removed:
        graph.eliminate_dead_code()
        drop_unread_attrs(gm, old_attrs)  # one int8 copy of each weight
        graph.lint()
        gm.recompile()
    return removed
