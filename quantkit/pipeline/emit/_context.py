"""The state one convert pass shares with its emitters: the graph being rewritten and its records."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..._graph import constant_value, get_attr, unique_attr_name

__all__ = ["ConvertContext"]


class ConvertContext:
    """What an emitter works with while convert rewrites ``gm`` in place.

    Attributes:
        gm: the GraphModule being converted (its graph is rewritten in place).
        graph: ``gm.graph``.
        fold: whether quantized constants are folded into integer buffers (``fold_quantize``).
        modules: ``dict(gm.named_modules(remove_duplicate=False))`` (observers by target).
        memo: :func:`quantkit._graph.constant_value`'s cache (an entry set here overrides an
            attribute: the block-by-block path puts a stored weight there).
        records: the qparams records convert writes to ``gm.meta["quantkit_qparams"]``, in order.
    """

    def __init__(self, gm: GraphModule, fold: bool = True):
        self.gm = gm
        self.fold = fold
        self.graph = gm.graph
        self.modules = dict(gm.named_modules(remove_duplicate=False))
        self.memo: dict = {}
        self.records: list[dict] = []

    def new_attr(self, base: str, value: torch.Tensor) -> Node:
        """Register ``value`` as the buffer ``f"{base}{i}"`` (the first free ``i``) and return a
        ``get_attr`` node of it, inserted at the graph's current insertion point."""
        name = unique_attr_name(self.gm, base)
        self.gm.register_buffer(name, value)
        return self.graph.get_attr(name)

    _new_attr = new_attr  # the name emitters written before the registry use

    def constant(self, node):
        """The value of ``node`` if it is a constant of the graph (a weight), else None."""
        return constant_value(self.gm, node, self.memo)

    def literal(self, arg):
        """``arg`` itself, or the tensor a ``get_attr`` node ``arg`` reads."""
        return get_attr(self.gm, str(arg.target)) if isinstance(arg, Node) else arg

    _literal = literal

    def finish(self, node: Node, obs, out: Node) -> None:
        """Let ``out`` replace the observer call ``node`` and erase it; a KV-cache observer's
        record (the last one, of the same node) says which cache tensor it scales."""
        if getattr(obs, "kv_role", None) and self.records and \
                self.records[-1]["node"] == getattr(obs, "node_name", None):
            self.records[-1]["kv_cache"] = obs.kv_role  # a KV-cache scale (FP8Quantizer(kv_cache=...))
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)

    _finish = finish
