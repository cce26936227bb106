"""EmbeddingQuantizer: weight-only int8 for embedding tables (one scale per row)."""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec, Quantizer

from quantkit._graph import ANNOTATION_KEY, module_scopes
from quantkit._qmath import is_per_channel
from quantkit.observers import declared_qscheme
from quantkit.observers import get as get_observer

from ._w8a8 import _has_elements


__all__ = ["EmbeddingQuantizer"]

_EMBEDDING = {torch.ops.aten.embedding.default}


class EmbeddingQuantizer(Quantizer):
    """Symmetric int8 embedding weights, one scale per row; lookups stay float.

    Embedding tables are often the largest tensors of a language model (all-MiniLM-L6-v2:
    half of its weights) and ``W8A8Quantizer`` leaves them alone. Combine the two with
    torchao's ``ComposableQuantizer([EmbeddingQuantizer(), W8A8Quantizer()])``.

    Args:
        weight_observer: a registered per-channel observer name; channels are rows (axis 0).

    Example:
        >>> q = ComposableQuantizer([EmbeddingQuantizer().set_module_name("embeddings.position_embeddings", None),
        ...                          W8A8Quantizer()])
    """

    def __init__(self, weight_observer: str = "per_channel_minmax") -> None:
        super().__init__()
        ctor = get_observer(weight_observer)  # raises ValueError naming the known observers
        if not is_per_channel(declared_qscheme(ctor)):
            raise ValueError(
                f"EmbeddingQuantizer needs a per-channel observer (one whose qscheme is per channel), got {weight_observer!r}"
            )
        self.spec = QuantizationSpec(
            dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=torch.per_channel_symmetric,
            ch_axis=0, is_dynamic=False, observer_or_fake_quant_ctr=ctor,
        )
        self.skipped: set[str] = set()

    def set_module_name(self, module_name: str, config: Optional[object]) -> "EmbeddingQuantizer":
        """Keep the embeddings inside ``module_name`` (and its children) in float; ``config`` must be None."""
        if not isinstance(module_name, str):
            raise TypeError(f"module_name must be a string, got {type(module_name).__name__}")
        if config is not None:
            raise ValueError("EmbeddingQuantizer.set_module_name only accepts None (keep in float)")
        self.skipped.add(module_name)
        return self

    def _skipped(self, node: Node) -> bool:
        for fqn, _ in module_scopes(node):
            if any(fqn == s or fqn.startswith(s + ".") for s in self.skipped):
                return True
        return False

    def annotate(self, model: GraphModule) -> GraphModule:
        for node in model.graph.nodes:
            if node.op != "call_function" or node.target not in _EMBEDDING or ANNOTATION_KEY in node.meta:
                continue
            weight = node.args[0]
            val = weight.meta.get("val") if isinstance(weight, Node) else None
            if weight.op != "get_attr" or not (isinstance(val, torch.Tensor) and val.is_floating_point()
                                               and _has_elements(val)):  # an empty table stays float
                continue
            if self._skipped(node):
                continue
            node.meta[ANNOTATION_KEY] = QuantizationAnnotation(input_qspec_map={weight: self.spec}, _annotated=True)
        return model

    def validate(self, model: GraphModule) -> None:
        pass

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        return model
