"""Kind ``"dynamic"``: run-time qparams (``choose_qparams`` + quantize/dequantize ``.tensor``, or
the ``*_per_token`` ops for ``granularity == "per-token"``), built by :func:`quantkit._qdq.emit_dynamic`."""

from __future__ import annotations

from torch.fx import GraphModule, Node

from ..._qdq import emit_dynamic
from ._affine import refuse_float8_qdq
from ._context import ConvertContext
from ._registry import Emitter, register_emitter

__all__ = ["DynamicEmitter"]


@register_emitter("dynamic")
class DynamicEmitter(Emitter):
    """Dynamic int8/uint8 quantization of an activation (nothing to fold)."""

    def check(self, gm: GraphModule, node: Node, obs) -> None:
        refuse_float8_qdq(node, obs)

    def emit(self, ctx: ConvertContext, node: Node, obs) -> None:
        ctx.finish(node, obs, emit_dynamic(ctx.graph, node, obs))
