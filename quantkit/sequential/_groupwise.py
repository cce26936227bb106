"""Group-wise (weight-only int4 / int8 / NF4) weights on the block-by-block path.

Each block keeps the float weight its group-wise observer watches (``f:<attribute>`` in the
block's file: the checkpoint's tensor, or GPTQ's rounded one). Before the whole graph is
converted, every such observer is replaced, one weight in memory at a time, by exactly what
``quantkit.convert`` emits for it (``_convert_groupwise.emit_groupwise``: packed integers or
NF4 codes, per-group scales and zero points as new attributes, in graph order, so they get
the in-memory path's names), with the weight read back memory-mapped from the block file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.fx import GraphModule

from ..pipeline._convert import _Converter
from ..pipeline._convert_groupwise import emit_groupwise, is_groupwise
from ..pipeline._prepare import is_observer_node

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
    conv = _Converter(prepared, fold=True)
    for node in [n for n in prepared.graph.nodes if is_observer_node(n, conv.modules)]:
        obs = conv.modules[str(node.target)]
        src = node.args[0]
        if not is_groupwise(obs) or getattr(src, "op", None) != "get_attr":
            continue
        weight = _stored_weight(stored, str(src.target))
        if weight is None:
            continue
        conv.memo[src] = weight  # what _constant_value answers for the (absent) attribute
        emit_groupwise(conv, node, obs)
        del conv.memo[src], weight
    prepared.graph.eliminate_dead_code()
    return conv.records
