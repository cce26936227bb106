"""Kind ``"observer-convert"``: an observer that knows its own ops (torchao's affine and group-wise
observers: torchao's protocol ``obs.convert(model, node)``) rewrites its node itself."""

from __future__ import annotations

from torch.fx import Node

from ._context import ConvertContext
from ._registry import OBSERVER_CONVERT, Emitter, register_emitter

__all__ = ["ObserverConvertEmitter"]


@register_emitter(OBSERVER_CONVERT)
class ObserverConvertEmitter(Emitter):
    """Calls ``obs.convert(ctx.gm, node)``; quantize ops it leaves on constants are folded by
    convert afterwards (``_fold_constant_quantizes``)."""

    def emit(self, ctx: ConvertContext, node: Node, obs) -> None:
        obs.convert(ctx.gm, node)
