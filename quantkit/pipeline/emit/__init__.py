"""Convert emitters: what replaces each kind of observer in a converted graph.

Every observer declares its kind (``obs.qkind``; :func:`qkind_of` infers one, in one place, for
observers that declare none, such as torchao's). ``quantkit.convert`` is a loop over the observer
nodes: ``emitter_for(obs).emit(ctx, node, obs)``. Built-in kinds, one module each:

- ``"affine"`` (``_affine``): static qparams, ``quantized_decomposed`` per tensor / per channel;
- ``"dynamic"`` (``_dynamic``): run-time qparams, per tensor / per token;
- ``"float8"`` (``_float8``): torchao's float8 ops on the float8 grid;
- ``"groupwise"`` (``_groupwise``): weight-only int4 / int8 / NF4, per group;
- ``"float16"`` (``_float16``) and ``"passthrough"`` (``_passthrough``): a cast pair, or nothing;
- ``"observer-convert"`` (``_observer_convert``): torchao's observers that rewrite their own node.

A new kind: an observer class with ``qkind = "mykind"`` and, in its own file,
``@register_emitter("mykind") class MyEmitter(Emitter): def emit(self, ctx, node, obs): ...``.
"""

from ._context import ConvertContext
from ._registry import OBSERVER_CONVERT, Emitter, emitter_for, qkind_of, register_emitter, registered_emitters
from . import _affine, _dynamic, _float8, _float16, _groupwise, _observer_convert, _passthrough  # noqa: F401  (register)

__all__ = [
    "ConvertContext", "Emitter", "register_emitter", "emitter_for", "qkind_of", "registered_emitters",
    "OBSERVER_CONVERT",
]
