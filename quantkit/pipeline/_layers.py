"""Layers of a quantized graph: which ops run quantized, keeping chosen ones float, GEMM FLOPs.

A *layer* is one quantizable op node (linear, conv, matmul/bmm/mm, add) of the
captured graph, named by its node name (``linear_3``), which survives prepare and
convert; its module fqn (from ``nn_module_stack``) is kept for display.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, Quantizer
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (X86InductorQuantizer,
                                                                         _X86InductorQuantizationAnnotation)

from .._graph import ANNOTATION_KEY, DEQUANTIZE_OPS, QUANTIZE_OPS, module_scopes
from ._inputs import call_model

__all__ = ["Layer", "find_layers", "KeepFloat", "FLOAT_WEIGHT_DTYPES", "KEEP_FLOAT_META_KEY", "gemm_flops",
           "int8_fraction", "DEQUANTIZE_OPS", "QUANTIZE_OPS"]

aten = torch.ops.aten


_FAMILIES = {
    aten.linear.default: "linear",
    aten.conv1d.default: "conv", aten.conv2d.default: "conv", aten.conv3d.default: "conv",
    aten.conv1d.padding: "conv", aten.conv2d.padding: "conv", aten.conv3d.padding: "conv",
    aten.matmul.default: "matmul", aten.bmm.default: "matmul", aten.mm.default: "matmul",
    aten.add.Tensor: "add",
}
# ops that only move values: a dequantize seen through them still feeds the layer
_MOVES = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.flatten.using_ints, aten.squeeze.dim,
    aten.unsqueeze.default, aten.expand.default, aten.contiguous.default, aten.clone.default,
}
# GEMM-like ops counted for the int8 FLOP fraction (attention kernels run in float)
_GEMMS = {t for t, fam in _FAMILIES.items() if fam != "add"} | {
    aten.addmm.default, aten.baddbmm.default, aten.scaled_dot_product_attention.default,
}


@dataclass(frozen=True)
class Layer:
    """One quantizable op: ``name`` is its graph node name, ``module`` the fqn it belongs to."""

    name: str
    op: str
    module: str
    module_type: str

    @property
    def label(self) -> str:
        """``module (name)``, or the node name alone for ops at the model's top level."""
        return f"{self.module} ({self.name})" if self.module else self.name


def layer_of(node: Node) -> Layer:
    scopes = module_scopes(node)
    fqn, mtype = scopes[-1] if scopes else ("", "")
    if fqn.startswith("_empty_nn_module_stack"):
        fqn, mtype = "", ""
    return Layer(node.name, _FAMILIES.get(node.target, str(node.target)), fqn, mtype.rsplit(".", 1)[-1])


def source_dequantize(arg) -> Node | None:
    """The dequantize node feeding ``arg`` (directly or through view-like ops), if any."""
    for _ in range(32):
        if not isinstance(arg, Node) or arg.op != "call_function":
            return None
        if arg.target in DEQUANTIZE_OPS:
            return arg
        if arg.target not in _MOVES:
            return None
        arg = arg.args[0]
    return None


def find_layers(gm: GraphModule, *, quantized: bool = True) -> list[Layer]:
    """Layers of ``gm`` in graph order.

    Args:
        quantized: list only the ops with a dequantized input (those that run int8 in
            a converted graph); with False, every quantizable-family op.
    """
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _FAMILIES:
            continue
        if quantized and not any(source_dequantize(a) is not None for a in node.args[:2]):
            continue
        out.append(layer_of(node))
    return out


def _float_annotation(quantizer: Quantizer) -> QuantizationAnnotation:
    """An annotation that quantizes nothing, of the class ``quantizer`` reads back: torchao's
    X86InductorQuantizer asserts that every annotation it meets is its own subclass (a plain one
    made it fail on a float conv feeding a cat or a pool)."""
    if isinstance(quantizer, X86InductorQuantizer):
        return _X86InductorQuantizationAnnotation(_annotated=True)
    return QuantizationAnnotation(_annotated=True)


# what the float layers' weights are stored in; "bf16" is applied after convert (pipeline/_float_fallback)
FLOAT_WEIGHT_DTYPES = ("fp32", "bf16", "int8")
# node meta KeepFloat(float_weights="bf16") leaves on each kept layer ("bf16"; node meta survives
# prepare and convert, which rewrite the same graph), read by finish_recorded_float_layers
KEEP_FLOAT_META_KEY = "quantkit_keep_float"


class KeepFloat(Quantizer):
    """Wrap a quantizer so that the ops named in ``node_names`` stay float.

    It marks those nodes as annotated (with nothing to quantize) before the wrapped
    quantizer runs; PT2E quantizers, quantkit's and torchao's, skip annotated nodes,
    and shape ops that feed only float ops are then left float too.

    Args:
        quantizer: the quantizer for everything else.
        node_names: the layers (graph node names, as :func:`find_layers` gives them) to keep float.
        float_weights: ``"fp32"`` (default) leaves their weights as they are; ``"bf16"`` records on
            the graph that they are to be stored in bf16, which
            ``pipeline._float_fallback.finish_recorded_float_layers`` applies to the converted model
            (half the bytes; see that module for the numerics); ``"int8"`` that they are stored in
            int8 per channel, read through a dequantize (a quarter of the bytes: the layer keeps its
            float input, only its weight is rounded).

    Example:
        >>> q = KeepFloat(W8A8Quantizer(), ["linear_3"], float_weights="bf16")
    """

    def __init__(self, quantizer: Quantizer, node_names: Iterable[str], *, float_weights: str = "fp32") -> None:
        super().__init__()
        if float_weights not in FLOAT_WEIGHT_DTYPES:
            raise ValueError(f"unknown float_weights {float_weights!r}; use one of {list(FLOAT_WEIGHT_DTYPES)}")
        self.quantizer = quantizer
        self.node_names = frozenset(node_names)
        self.float_weights = float_weights

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        return self.quantizer.transform_for_annotation(model)

    def annotate(self, model: GraphModule) -> GraphModule:
        for node in model.graph.nodes:
            if node.name in self.node_names and ANNOTATION_KEY not in node.meta:
                node.meta[ANNOTATION_KEY] = _float_annotation(self.quantizer)
                if self.float_weights != "fp32":
                    node.meta[KEEP_FLOAT_META_KEY] = self.float_weights
        self.quantizer.annotate(model)
        return model

    def validate(self, model: GraphModule) -> None:
        self.quantizer.validate(model)

    def prepare_obs_or_fq_callback(self, model: GraphModule, edge_or_node_to_obs_or_fq: dict) -> None:
        self.quantizer.prepare_obs_or_fq_callback(model, edge_or_node_to_obs_or_fq)

    def __repr__(self) -> str:
        weights = f", float_weights={self.float_weights!r}" if self.float_weights != "fp32" else ""
        return f"KeepFloat({self.quantizer!r}, {sorted(self.node_names)}{weights})"


class _ShapeTap(torch.nn.Module):
    """Records the shapes of an op's output and tensor inputs; returns the output unchanged."""

    def __init__(self, name: str, sink: dict) -> None:
        super().__init__()
        self.name, self.sink = name, sink

    def forward(self, out, *inputs):
        self.sink[self.name] = [tuple(out.shape)] + [tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor)]
        return out


def _flops(target, shapes) -> int:
    out, *ins = shapes
    n_out = math.prod(out)
    if target is aten.scaled_dot_product_attention.default:
        q, k = ins[0], ins[1]
        return 4 * math.prod(q[:-1]) * k[-2] * q[-1]  # QK^T and PV
    if _FAMILIES.get(target) == "conv":
        return 2 * n_out * math.prod(ins[1][1:])  # weight: (Cout, Cin/groups, *kernel)
    if target is aten.linear.default:
        return 2 * n_out * ins[1][-1]
    if target in (aten.addmm.default, aten.baddbmm.default):
        return 2 * n_out * ins[1][-1]
    return 2 * n_out * ins[0][-1]  # matmul / bmm / mm


def gemm_flops(float_model: GraphModule, batch) -> dict[str, int]:
    """FLOPs of every live GEMM-like node (linear, conv, matmul, attention) for one ``batch``."""
    gm = copy.deepcopy(float_model)
    gm.graph.eliminate_dead_code()  # count only GEMMs whose results are used (convert drops the others)
    sink: dict[str, list] = {}
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _GEMMS]
    for i, node in enumerate(nodes):
        name = f"_qk_shape_tap_{i}"
        gm.add_submodule(name, _ShapeTap(node.name, sink))
        tensor_args = [a for a in node.args if isinstance(a, Node)]
        with gm.graph.inserting_after(node):
            tap = gm.graph.call_module(name, (node, *tensor_args))
        for user in list(node.users):
            if user is not tap:
                user.replace_input_with(node, tap)
    gm.recompile()
    with torch.no_grad():
        call_model(gm, batch)
    by_name = {n.name: n.target for n in nodes}
    return {name: _flops(by_name[name], shapes) for name, shapes in sink.items()}


def int8_fraction(flops: dict[str, int], layers: Iterable[Layer]) -> float:
    """Fraction of the GEMM FLOPs in ``flops`` done by the quantized ``layers``."""
    total = sum(flops.values())
    if total == 0:
        return 0.0
    return sum(flops.get(layer.name, 0) for layer in layers) / total
