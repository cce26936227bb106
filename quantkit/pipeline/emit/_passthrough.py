"""Kind ``"passthrough"``: an observer whose dtype is not a quantized one (e.g. float32): the
observer is removed and its input used as is."""

from __future__ import annotations

from torch.fx import Node

from ._context import ConvertContext
from ._registry import Emitter, register_emitter

__all__ = ["PassthroughEmitter"]


@register_emitter("passthrough")
class PassthroughEmitter(Emitter):
    """Nothing to quantize: the observer's input replaces it."""

    def emit(self, ctx: ConvertContext, node: Node, obs) -> None:
        ctx.finish(node, obs, node.args[0])
