"""The convert emitters, registered by kind: what replaces each observer in a converted graph.

An observer declares its kind by attribute (``obs.qkind``); :func:`register_emitter` binds a kind
to an :class:`Emitter` class, and ``quantkit.convert`` replaces every observer node with what the
emitter of its kind emits. A new kind adds an observer class with ``qkind = "mykind"`` and, in its
own file, ``@register_emitter("mykind") class MyEmitter(Emitter): ...``: no dispatcher is edited.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..._errors import ConvertError
from ..._qdq import kind_from_attributes
from ._context import ConvertContext

__all__ = ["Emitter", "register_emitter", "emitter_for", "qkind_of", "registered_emitters", "OBSERVER_CONVERT"]

# the kind of a foreign observer (torchao's affine and group-wise observers) that rewrites its own
# node through torchao's protocol, ``obs.convert(model, node)``
OBSERVER_CONVERT = "observer-convert"

_EMITTERS: dict[str, "Emitter"] = {}


class Emitter:
    """Base class of convert emitters: one per kind (``self.qkind``, set by :func:`register_emitter`).

    :meth:`emit` is required; the other methods have the defaults of a kind that refuses nothing
    and folds no weight block by block.
    """

    qkind: str = ""

    def emit(self, ctx: ConvertContext, node: Node, obs) -> None:
        """Replace the observer call ``node`` (observer ``obs``) of ``ctx.graph`` by the nodes
        of this kind, and erase it (e.g. ``ctx.finish(node, obs, out)``). Append a qparams
        record to ``ctx.records`` for what is quantized."""
        raise NotImplementedError(f"emitter {type(self).__name__} for kind {self.qkind!r} has no emit()")

    def check(self, gm: GraphModule, node: Node, obs) -> None:
        """Raise :class:`~quantkit._errors.ConvertError` if ``obs`` cannot be converted; called for
        every observer before anything is rewritten (so a refusal leaves the model as it was)."""

    def folds_weight(self, obs) -> bool:
        """Whether, for a constant input, convert stores :meth:`quantized_weight` as an integer
        buffer read by one dequantize (so the block-by-block path can compute it block by block)."""
        return False

    def quantized_weight(self, obs, const: torch.Tensor) -> torch.Tensor:
        """The integer tensor convert folds for ``obs`` watching the constant ``const``
        (only where :meth:`folds_weight`)."""
        raise NotImplementedError(f"kind {self.qkind!r} folds no weight")

    def emits_from_weight(self, obs) -> bool:
        """Whether :meth:`emit` needs nothing but the constant weight (the block-by-block path
        replays it with ``ctx.memo[weight_node] = stored_weight``, one weight in memory at a time)."""
        return False


def register_emitter(qkind: str):
    """Class decorator: register an instance of the decorated :class:`Emitter` subclass (or any
    class with the same methods) as the emitter of observers whose ``qkind`` is ``qkind``.

    Example::

        @register_emitter("mykind")
        class MyEmitter(Emitter):
            def emit(self, ctx, node, obs):
                ctx.finish(node, obs, node.args[0])

    Raises:
        ValueError: for an empty name, or a kind that already has an emitter of another class.
    """
    if not isinstance(qkind, str) or not qkind:
        raise ValueError(f"an emitter kind is a non-empty string, got {qkind!r}")

    def wrap(cls):
        current = _EMITTERS.get(qkind)
        if current is not None and type(current).__qualname__ != cls.__qualname__:
            raise ValueError(f"convert kind {qkind!r} already has the emitter {type(current).__name__}")
        emitter = cls()
        emitter.qkind = qkind
        _EMITTERS[qkind] = emitter
        return cls

    return wrap


def qkind_of(obs) -> str:
    """The convert kind of observer ``obs``: its declared ``qkind`` (every quantkit observer
    declares one), else, for observers that declare none (torchao's, ``torch.ao``'s), the one place
    a kind is inferred: ``"groupwise"`` for ``granularity == "per-group"``, then
    :data:`OBSERVER_CONVERT` if it has torchao's ``convert(model, node)`` hook, then the rule of
    :func:`quantkit._qdq.kind_from_attributes` on its ``dtype`` / ``is_dynamic`` / ``qscheme``."""
    declared = getattr(obs, "qkind", None)
    if isinstance(declared, str) and declared:
        return declared
    kind = kind_from_attributes(obs)
    if kind != "groupwise" and callable(getattr(obs, "convert", None)):
        return OBSERVER_CONVERT
    return kind


def emitter_for(obs) -> Emitter:
    """The registered emitter of ``obs``'s kind (:func:`qkind_of`).

    Raises:
        ConvertError: if no emitter is registered for that kind.
    """
    kind = qkind_of(obs)
    emitter = _EMITTERS.get(kind)
    if emitter is None:
        raise ConvertError(f"no convert emitter for observer kind {kind!r} ({type(obs).__name__} at node "
                           f"'{getattr(obs, 'node_name', '?')}'); register one with "
                           f"quantkit.pipeline.emit.register_emitter({kind!r}); known: {sorted(_EMITTERS)}")
    return emitter


def registered_emitters() -> dict[str, Emitter]:
    """The registered emitters by kind (a copy)."""
    return dict(_EMITTERS)
