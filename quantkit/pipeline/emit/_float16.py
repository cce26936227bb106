"""Kind ``"float16"``: a float16 observer becomes a cast to float16 and back to float32
(``quantized_decomposed.convert_element_type.no_fuse``: the rounding to float16 stays in the graph)."""

from __future__ import annotations

import torch
from torch.fx import Node

from ._context import ConvertContext
from ._registry import Emitter, register_emitter

__all__ = ["Float16Emitter"]


@register_emitter("float16")
class Float16Emitter(Emitter):
    """``convert_element_type(convert_element_type(x, float16), float32)``."""

    def emit(self, ctx: ConvertContext, node: Node, obs) -> None:
        conv = torch.ops.quantized_decomposed.convert_element_type.no_fuse
        with ctx.graph.inserting_before(node):
            half = ctx.graph.call_function(conv, (node.args[0], torch.float16))
            out = ctx.graph.call_function(conv, (half, torch.float32))
        ctx.finish(node, obs, out)
