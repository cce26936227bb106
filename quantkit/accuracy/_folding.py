"""Folding per-input-channel factors into the op before a group of linears (SmoothQuant, AWQ).

For linears ``y = x Wᵀ`` that read the same activation ``x`` and a factor ``s`` per input
channel, ``y = (x / s) (W s)ᵀ`` exactly. The ``1/s`` goes into the op that produces ``x`` where
that op feeds only these linears and owns its parameters (a LayerNorm/RMSNorm's affine weight
and bias, or a linear's output rows): :func:`fold_target`; otherwise an explicit
``x * (1/s)`` is inserted before them: :func:`insert_mul`. Both work on the graph in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .._graph import get_attr, unique_attr_name

__all__ = ["NORMS", "FoldGroup", "attr_use_counts", "own_attr", "fold_target", "insert_mul"]

aten = torch.ops.aten
NORMS = {aten.layer_norm.default: (2, 3)}  # target -> indices of (weight, bias) among args
if hasattr(aten, "rms_norm"):
    NORMS[aten.rms_norm.default] = (2, None)


@dataclass
class FoldGroup:
    """Linears (or the observers before them) that read the activation ``source``."""

    source: Node
    linears: list[Node]


def attr_use_counts(gm: GraphModule) -> dict[str, int]:
    """How many ``get_attr`` nodes of ``gm`` read each target."""
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            counts[str(n.target)] = counts.get(str(n.target), 0) + 1
    return counts


def own_attr(node, counts: dict) -> bool:
    """``node`` is a get_attr used by one node only, and no other get_attr reads the same tensor
    (``counts``: :func:`attr_use_counts`)."""
    return isinstance(node, Node) and node.op == "get_attr" and len(node.users) == 1 and counts[str(node.target)] == 1


def fold_target(gm: GraphModule, group: FoldGroup, counts: dict) -> tuple[str, list[tuple[torch.Tensor, bool]]] | None:
    """Where ``1/s`` can be folded: ``(kind, [(tensor, scale_rows), ...])`` with kind ``"norm"``
    or ``"linear"`` (divide each tensor by ``s``, along its rows where ``scale_rows``), or None."""
    src = group.source
    if set(src.users) != set(group.linears) or src.op != "call_function":
        return None
    if src.target in NORMS:
        wi, bi = NORMS[src.target]
        w = src.args[wi] if len(src.args) > wi else None
        b = src.args[bi] if bi is not None and len(src.args) > bi else None
        if not own_attr(w, counts) or (b is not None and not own_attr(b, counts)):
            return None
        return "norm", [(get_attr(gm, w.target), False)] + ([(get_attr(gm, b.target), False)] if b is not None else [])
    if src.target is aten.linear.default:
        w = src.args[1]
        b = src.args[2] if len(src.args) > 2 else None
        if not own_attr(w, counts) or (b is not None and not own_attr(b, counts)):
            return None
        return "linear", [(get_attr(gm, w.target), True)] + ([(get_attr(gm, b.target), False)] if b is not None else [])
    return None


def insert_mul(gm: GraphModule, group: FoldGroup, inv_s: torch.Tensor, index: int) -> None:
    """Insert ``source * inv_s`` before the group's linears; ``inv_s`` becomes the buffer
    ``_qk_smooth_inv_{i}``, the first free ``i`` from ``index``."""
    name = unique_attr_name(gm, "_qk_smooth_inv_", start=index)
    gm.register_buffer(name, inv_s)
    src = group.source
    with gm.graph.inserting_after(src):
        inv = gm.graph.get_attr(name)
    with gm.graph.inserting_after(inv):
        mul = gm.graph.call_function(aten.mul.Tensor, (src, inv))
    # the quantizer reads shapes and module scopes from node meta
    mul.meta["val"] = src.meta["val"]
    stack = group.linears[0].meta.get("nn_module_stack")
    if stack is not None:
        mul.meta["nn_module_stack"] = dict(stack)
    for lin in group.linears:
        lin.replace_input_with(src, mul)
