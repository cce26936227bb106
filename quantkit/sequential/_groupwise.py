"""Group-wise (weight-only int4 / int8 / NF4) weights on the block-by-block path.

Each block keeps the float weight its group-wise observer watches (``f:<attribute>`` in the
block's file: the checkpoint's tensor, or GPTQ's rounded one). Before the whole graph is
converted, every such observer is replaced, one weight in memory at a time, by exactly what
``quantkit.convert`` emits for it (its emitter, ``emits_from_weight``: packed integers or
NF4 codes, per-group scales and zero points as new attributes, in graph order, so they get
the in-memory path's names), with the weight read back memory-mapped from the block file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.fx import GraphModule

from .._graph import is_observer_node
from ..pipeline.emit import ConvertContext, emitter_for

__all__ = ["fold_groupwise"]


def _stored_weight(stored: dict, target: str) -> torch.Tensor | None:
    from safetensors import safe_open

    key = f"f:{target}"
    if key not in stored:
        return None
    with safe_open(str(stored[key][0]), framework="pt") as f:
        return f.get_tensor(key)


def fold_groupwise(prepared: GraphModule, stored: dict[str, tuple[Path, tuple, torch.dtype]]) -> list[dict]:
    """Convert ``prepared``'s group-wise weight observers in place (its other observers are left
    for ``convert``); ``stored`` maps the block files' keys to ``(file, shape, dtype)`` and holds
    the float weights as ``f:<attribute>``. Returns convert's records of the rewritten weights,
    in graph order."""
    ctx = ConvertContext(prepared, fold=True)
    for node in [n for n in prepared.graph.nodes if is_observer_node(n, ctx.modules)]:
        obs = ctx.modules[str(node.target)]
        src = node.args[0]
        emitter = emitter_for(obs)
        if not emitter.emits_from_weight(obs) or getattr(src, "op", None) != "get_attr":
            continue
        weight = _stored_weight(stored, str(src.target))
        if weight is None:
            continue
        ctx.memo[src] = weight  # what constant_value answers for the (absent) attribute
        emitter.emit(ctx, node, obs)
        del ctx.memo[src], weight
    prepared.graph.eliminate_dead_code()
    return ctx.records
