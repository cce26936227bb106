"""Folding per-input-channel factors into the op before a group of linears (SmoothQuant, AWQ).

For linears ``y = x Wᵀ`` that read the same activation ``x`` and a factor ``s`` per input
channel, ``y = (x / s) (W s)ᵀ`` exactly. The ``1/s`` goes into the op that produces ``x`` where
that op feeds only these linears and owns its parameters: :func:`fold_target`. Those ops are

- a LayerNorm/RMSNorm (its affine weight and bias);
- a linear (its output rows and bias);
- a product with a constant per-channel vector, ``w * x̂``: the last op of a norm that
  torch.export decomposed (HF's ``LlamaRMSNorm`` and its relatives), the vector divided;
- a product with a linear's output that nothing else reads, ``g * (x Uᵀ)``: a gated MLP's
  ``act(gate) * up``, the ``up`` linear's output rows divided.

Otherwise an explicit ``x * (1/s)`` is inserted before them: :func:`insert_mul`. Both work on
the graph in place. A linear's weight may sit behind an observer in a prepared graph: callers
pass ``unwrap`` to see through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from .._graph import INPUT_SCALE_PREFIX, example_value, get_attr, set_attr, unique_attr_name

__all__ = ["NORMS", "FoldGroup", "attr_use_counts", "own_attr", "fold_target", "apply_fold", "insert_mul"]

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


def _identity(node):
    return node


def _linear_rows(lin: Node, counts: dict, unwrap) -> list[tuple[str, bool]] | None:
    """The weight (rows) and bias of the linear ``lin`` when it owns both, else None."""
    w = unwrap(lin.args[1])
    b = lin.args[2] if len(lin.args) > 2 else None
    b = unwrap(b) if isinstance(b, Node) else b
    if not own_attr(w, counts) or (b is not None and not own_attr(b, counts)):
        return None
    return [(str(w.target), True)] + ([(str(b.target), False)] if b is not None else [])


def _through_mul(gm: GraphModule, src: Node, counts: dict, unwrap) -> tuple[str, list] | None:
    """A product ``src = a * b`` that ``1/s`` (per channel of the last dim) folds into."""
    if len(src.args) != 2 or src.kwargs or not all(isinstance(a, Node) for a in src.args):
        return None
    out = example_value(src)
    if out is None or out.dim() == 0:
        return None
    channels = int(out.shape[-1])
    for const, other in (src.args, src.args[::-1]):  # w * x̂: a decomposed norm's affine weight
        if own_attr(const, counts) and other.op != "get_attr":
            t = get_attr(gm, const.target)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 and t.numel() == channels \
                    and t.shape[-1] == channels:
                return "norm", [(str(const.target), False)]
    for lin in src.args[::-1]:  # g * (x Uᵀ): the linear's rows, when only src reads it
        val = example_value(lin)
        if lin.op == "call_function" and lin.target is aten.linear.default and list(lin.users) == [src] \
                and val is not None and tuple(val.shape) == tuple(out.shape):
            rows = _linear_rows(lin, counts, unwrap)
            if rows is not None:
                return "gate", rows
    return None


def fold_target(gm: GraphModule, group: FoldGroup, counts: dict, *,
                unwrap=_identity) -> tuple[str, list[tuple[str, bool]]] | None:
    """Where ``1/s`` can be folded: ``(kind, [(attr, scale_rows), ...])``, or None.

    ``kind`` is ``"norm"``, ``"linear"`` or ``"gate"`` (the linear whose output a product
    reads); each attribute is divided by ``s``, along its rows where ``scale_rows``
    (:func:`apply_fold`).

    ``unwrap`` maps a linear's weight or bias argument to its ``get_attr`` (a prepared graph's
    weight observers sit in between)."""
    src = group.source
    if set(src.users) != set(group.linears) or src.op != "call_function":
        return None
    if src.target in NORMS:
        wi, bi = NORMS[src.target]
        w = src.args[wi] if len(src.args) > wi else None
        b = src.args[bi] if bi is not None and len(src.args) > bi else None
        if not own_attr(w, counts) or (b is not None and not own_attr(b, counts)):
            return None
        return "norm", [(str(w.target), False)] + ([(str(b.target), False)] if b is not None else [])
    if src.target is aten.linear.default:
        rows = _linear_rows(src, counts, unwrap)
        return None if rows is None else ("linear", rows)
    if src.target is aten.mul.Tensor:
        return _through_mul(gm, src, counts, unwrap)
    return None


def apply_fold(gm: GraphModule, attrs: list[tuple[str, bool]], s: torch.Tensor) -> None:
    """Divide each attribute of a :func:`fold_target` by ``s`` (its rows where flagged). The
    results are new tensors: a prepared graph shares the caller's parameters."""
    with torch.no_grad():
        for name, rows in attrs:
            t = get_attr(gm, name)
            set_attr(gm, name, (t / (s[:, None] if rows else s).to(t.device)).to(t.dtype))


def insert_mul(gm: GraphModule, group: FoldGroup, inv_s: torch.Tensor, index: int) -> None:
    """Insert ``source * inv_s`` before the group's linears; ``inv_s`` becomes the buffer
    ``_qk_smooth_inv_{i}`` (:data:`INPUT_SCALE_PREFIX`), the first free ``i`` from ``index``."""
    name = unique_attr_name(gm, INPUT_SCALE_PREFIX, start=index)
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
