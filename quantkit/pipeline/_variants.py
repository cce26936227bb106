"""Build quantized variants of one model that keep different layers float, calibrating once.

Observers see float activations during calibration whatever else is quantized, so an
observer's statistics do not depend on which other layers are quantized. The model is
prepared and calibrated once with every layer quantized; each variant is prepared with
:class:`KeepFloat` and its observers are copies of the calibrated ones that watch the
same tensors. Where that match is not exact (e.g. observers shared across several
tensors change with the variant), the variant is calibrated afresh.
"""

from __future__ import annotations

import copy
from typing import Iterable

import torch
from torch.fx import GraphModule, Node

from quantkit._graph import is_observer_node
from quantkit.observers import DerivedObserver
from quantkit.quantizers import W8A8Quantizer

from ._calibrate import calibrate
from ._capture import capture
from ._convert import convert, convert_in_place
from ._layers import KeepFloat, Layer, find_layers
from ._prepare import prepare

__all__ = ["Variants"]


def _producer(node: Node, modules: dict) -> str:
    while is_observer_node(node, modules):
        node = node.args[0]
    return node.name


def _observer_groups(prepared: GraphModule) -> dict[tuple, tuple[torch.nn.Module, list[str]]]:
    """Key (config + watched tensors) -> (observer instance, its submodule names)."""
    modules = dict(prepared.named_modules(remove_duplicate=False))
    watched: dict[int, set[str]] = {}
    names: dict[int, list[str]] = {}
    instances: dict[int, torch.nn.Module] = {}
    for node in prepared.graph.nodes:
        if not is_observer_node(node, modules):
            continue
        obs = modules[str(node.target)]
        watched.setdefault(id(obs), set()).add(_producer(node.args[0], modules))
        names.setdefault(id(obs), []).append(str(node.target))
        instances[id(obs)] = obs
    groups = {}
    for key, obs in instances.items():
        config = (type(obs), str(getattr(obs, "dtype", "")), str(getattr(obs, "qscheme", "")),
                  getattr(obs, "quant_min", None), getattr(obs, "quant_max", None),
                  getattr(obs, "ch_axis", None), bool(getattr(obs, "is_dynamic", False)))
        groups[config + (frozenset(watched[key]),)] = (obs, names[key])
    return groups


class Variants:
    """A model calibrated once, from which variants with float layers are built.

    Args:
        model: the float model (or an already captured GraphModule).
        example_inputs: one batch to capture ``model`` with (ignored for a GraphModule).
        calib_data: calibration batches (iterated again only for variants whose
            observers cannot be copied).
        quantizer: the quantizer for the all-quantized model.
    """

    def __init__(self, model: torch.nn.Module, example_inputs, calib_data: Iterable, quantizer) -> None:
        if quantizer is None:
            quantizer = W8A8Quantizer()
        self.quantizer = quantizer
        self.calib_data = calib_data
        self.float_graph = model if isinstance(model, GraphModule) else capture(model, example_inputs)
        prepared = prepare(self.float_graph, quantizer)  # prepare copies; the float graph stays as it is
        calibrate(prepared, calib_data, progress=False, distributed=False)  # every rank has all the data
        self._batches = prepared.meta["quantkit_calibrated_batches"]
        # convert leaves the prepared model (and so these observers) as they are
        self._groups = _observer_groups(prepared)
        if not self._groups:
            raise ValueError("the quantizer quantizes no linear, conv, matmul or add op in this model; nothing to analyse")
        self.quantized = convert(prepared)
        self.layers: list[Layer] = find_layers(self.quantized)
        if not self.layers:
            raise ValueError("the quantizer quantizes no linear, conv, matmul or add op in this model; nothing to analyse")
        self.rebuilt = 0  # variants that needed a fresh calibration (for tests and reports)

    def quantizer_for(self, keep_float: Iterable[str]):
        names = frozenset(keep_float)
        return self.quantizer if not names else KeepFloat(self.quantizer, names)

    def build(self, keep_float: Iterable[str]) -> GraphModule:
        """The converted model with the layers named in ``keep_float`` left float."""
        names = frozenset(keep_float)
        if not names:
            return copy.deepcopy(self.quantized)
        prepared = prepare(self.float_graph, KeepFloat(self.quantizer, names))
        modules = dict(prepared.named_modules(remove_duplicate=False))
        if not any(is_observer_node(n, modules) for n in prepared.graph.nodes):
            prepared.meta.pop("quantkit_prepared", None)
            return prepared  # everything float: nothing to convert
        if self._copy_observers(prepared):
            prepared.meta["quantkit_calibrated_batches"] = self._batches
        else:
            self.rebuilt += 1
            calibrate(prepared, self.calib_data, progress=False, distributed=False)  # every rank has all the data
        return convert_in_place(prepared)  # our own prepared model: no copy needed

    def _copy_observers(self, prepared: GraphModule) -> bool:
        groups = _observer_groups(prepared)
        if any(key not in self._groups for key in groups) or any(
            isinstance(obs, DerivedObserver) for obs, _ in list(groups.values()) + list(self._groups.values())
        ):
            return False
        for key, (obs, names) in groups.items():
            new = copy.deepcopy(self._groups[key][0])
            new.node_name = obs.node_name
            for name in names:
                setattr(prepared, name, new)
        return True
