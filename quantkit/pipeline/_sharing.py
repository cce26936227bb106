"""Turn quantization annotations into one observer per group of tensors that share qparams.

Annotations name *edges* ``(producer, consumer)`` through ``input_qspec_map`` and
*nodes* (outputs) through ``output_qspec``. Edges and nodes are grouped with
union-find:

* ``SharedQuantizationSpec(x)`` joins the annotated edge/node with ``x``;
* implicit sharing: an input edge joins the producer's output and the producer's
  other consumer edges when their root specs agree on dtype, range, qscheme,
  axis and dynamism (the same tensor needs one observer, not several).

The grouping rules follow torchao's ``prepare`` so that quantizers written for
torchao place the same observers under quantkit.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Union

import torch
from torch.fx import Node
from torchao.quantization.pt2e.quantizer import (
    DerivedQuantizationSpec,
    FixedQParamsQuantizationSpec,
    QuantizationSpec,
    QuantizationSpecBase,
    SharedQuantizationSpec,
)

from quantkit._graph import ANNOTATION_KEY
from quantkit._qmath import is_per_channel
from quantkit.observers import DerivedObserver, FixedQParamsObserver

__all__ = ["EdgeOrNode", "observers_for_annotations", "observer_for_spec"]

EdgeOrNode = Union[Node, tuple[Node, Node]]

_IMPLICIT_SHARE_ATTRS = (
    "dtype", "is_dynamic", "quant_min", "quant_max", "qscheme", "ch_axis", "scale", "zero_point",
)


def _specs(gm: torch.fx.GraphModule) -> dict[EdgeOrNode, QuantizationSpecBase]:
    specs: dict[EdgeOrNode, QuantizationSpecBase] = {}
    for n in gm.graph.nodes:
        ann = n.meta.get(ANNOTATION_KEY)
        if ann is None:
            continue
        for arg, spec in ann.input_qspec_map.items():
            if spec is not None:
                specs[(arg, n)] = spec
        if ann.output_qspec is not None:
            specs[n] = ann.output_qspec
    return specs


class _Groups:
    """Union-find over edges and nodes; each root's spec is the group's spec."""

    def __init__(self, specs):
        self.specs = specs
        self.parent = {k: k for k in specs}

    def find(self, x):
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:  # path compression
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, parent, child):
        """Point ``child``'s tree at ``parent``'s root (reversed if that would form a cycle)."""
        for key in (parent, child):
            if key not in self.parent:
                raise ValueError(
                    f"SharedQuantizationSpec refers to {_describe(key)}, which has no quantization spec; "
                    "annotate it first or share with an annotated edge/node"
                )
        rp, rc = self.find(parent), self.find(child)
        if rp == rc:
            return
        pspec = self.specs[rp]
        if isinstance(pspec, SharedQuantizationSpec) and pspec.edge_or_node == rc:
            self.parent[rp] = rc
        else:
            self.parent[rc] = rp

    def root_spec(self, spec):
        while isinstance(spec, SharedQuantizationSpec):
            spec = self.specs[self.find(spec.edge_or_node)] if spec.edge_or_node in self.parent else None
            if spec is None:
                return None
        return spec


def _same(a, b) -> bool:
    for attr in _IMPLICIT_SHARE_ATTRS:
        ha, hb = hasattr(a, attr), hasattr(b, attr)
        if ha != hb or (ha and getattr(a, attr) != getattr(b, attr)):
            return False
    return True


def _describe(key: EdgeOrNode) -> str:
    if isinstance(key, tuple):
        return f"edge {key[0].name} -> {key[1].name}"
    return f"output of {key.name}"


def _group(specs) -> tuple[dict[EdgeOrNode, EdgeOrNode], _Groups]:
    groups = _Groups(specs)
    for key, spec in specs.items():
        if isinstance(key, tuple):
            arg, node = key
            root_spec = groups.root_spec(spec)
            if node.meta[ANNOTATION_KEY].allow_implicit_sharing:
                # first other consumers of the same tensor, then the producer's output:
                # the other order can create a cycle (see torchao's prepare)
                others = [(arg, user) for user in arg.users if user is not node]
                for other in others + [arg]:
                    if other in specs:
                        other_root = groups.root_spec(specs[other])
                        if other_root is not None and root_spec is not None and _same(other_root, root_spec):
                            groups.union(other, key)
        if isinstance(spec, SharedQuantizationSpec):
            groups.union(spec.edge_or_node, key)
    return {k: groups.find(k) for k in specs}, groups


def _observer_kwargs(spec) -> dict:
    kwargs = asdict(spec)
    kwargs.pop("observer_or_fake_quant_ctr", None)
    return kwargs


def _make_observer(spec, made: dict, groups: _Groups):
    if isinstance(spec, SharedQuantizationSpec):
        if spec.edge_or_node in made:
            return made[spec.edge_or_node]
        root = groups.root_spec(spec)
        if root is None or isinstance(root, SharedQuantizationSpec):
            raise ValueError(f"SharedQuantizationSpec refers to {_describe(spec.edge_or_node)}, which has no spec")
        return _make_observer(root, made, groups)
    if isinstance(spec, DerivedQuantizationSpec):
        sources = []
        for k in spec.derived_from:
            if k not in made:
                raise ValueError(
                    f"DerivedQuantizationSpec derives from {_describe(k)}, which has no observer; "
                    "annotate that edge/node (or list it before the derived one)"
                )
            sources.append(made[k])
        return DerivedObserver(
            sources, spec.derive_qparams_fn, dtype=spec.dtype, qscheme=spec.qscheme,
            quant_min=spec.quant_min, quant_max=spec.quant_max, ch_axis=spec.ch_axis,
        )
    if isinstance(spec, FixedQParamsQuantizationSpec):
        return FixedQParamsObserver(
            spec.scale, spec.zero_point, dtype=spec.dtype, qscheme=spec.qscheme or torch.per_tensor_affine,
            quant_min=spec.quant_min, quant_max=spec.quant_max,
        )
    if not isinstance(spec, QuantizationSpec):
        raise TypeError(f"unsupported quantization spec type {type(spec).__name__}")
    return observer_for_spec(spec)


def observer_for_spec(spec: QuantizationSpec) -> torch.nn.Module:
    """A fresh observer instance for a plain ``QuantizationSpec`` (what prepare inserts)."""
    ctor = spec.observer_or_fake_quant_ctr
    kwargs = _observer_kwargs(spec)
    if not is_per_channel(spec.qscheme):  # the spec declares it (as in torchao's prepare)
        kwargs.pop("ch_axis")
    return ctor.with_args(**kwargs)() if hasattr(ctor, "with_args") else ctor(**kwargs)


def observers_for_annotations(gm: torch.fx.GraphModule) -> dict[EdgeOrNode, torch.nn.Module]:
    """Map every annotated edge/node to its observer; grouped keys share one instance."""
    specs = _specs(gm)
    roots, groups = _group(specs)
    by_root: dict[EdgeOrNode, torch.nn.Module] = {}
    made: dict[EdgeOrNode, torch.nn.Module] = {}
    for key, spec in specs.items():
        root = roots[key]
        if root not in by_root:
            by_root[root] = _make_observer(spec, made, groups)
        made[key] = by_root[root]
    return made
