"""What the weight rounding algorithms (GPTQ, AWQ) share: the linears they round, and the
prepared graph run with its observers bypassed, with taps on chosen nodes.

Both register as calibration hooks (``quantkit.pipeline._hooks``); :func:`rounding_plan`
finds and checks their linears once per ``calibrate`` call, for both.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.fx import GraphModule, Node

from ..._errors import CalibrationError
from ..._graph import is_observer_node, module_scopes
from ...pipeline._calibrate import run_batches
from ...pipeline._hooks import CalibrationRun

__all__ = ["ROUNDING_META_KEY", "ROUNDING_ALGORITHMS", "RoundedLinear", "find_rounded_linears", "observer_unwrapper",
           "pending_algorithms", "rounding_plan",
           "record_rounding", "without_observers", "Tapped", "fix_qparams"]

aten = torch.ops.aten
# gm.meta entry: one record per rounded linear ({"layer", "module", "algorithm", ...})
ROUNDING_META_KEY = "quantkit_weight_rounding"
# the algorithms the rounding hooks run (awq+gptq: AWQ's scales, then GPTQ's rounding)
ROUNDING_ALGORITHMS = ("gptq", "awq", "awq+gptq")


@dataclass
class RoundedLinear:
    """A linear of the prepared graph whose weight a rounding algorithm handles."""

    node: Node          # aten.linear
    weight: str         # get_attr target of its weight
    observer: torch.nn.Module
    source: Node        # its activation input, observers stripped
    block: str          # transformer block (module name) it belongs to

    @property
    def algorithm(self) -> str:
        return self.observer.weight_algorithm


def _modules(gm: GraphModule) -> dict:
    return dict(gm.named_modules(remove_duplicate=False))


def _is_observer(node, modules) -> bool:
    return isinstance(node, Node) and is_observer_node(node, modules)


def _block_of(node: Node) -> str:
    """The transformer block ``node`` belongs to: the outermost enclosing module that is an
    element of a module list (its name ends in an index, ``encoder.layer.3``), else its own module."""
    scopes = module_scopes(node)
    for fqn, _ in scopes:
        if fqn.rsplit(".", 1)[-1].isdigit():
            return fqn
    return scopes[-1][0] if scopes else node.name


def find_rounded_linears(gm: GraphModule) -> list[RoundedLinear]:
    """Linears of ``gm`` (prepared) whose weight observer declares a weight algorithm other
    than round-to-nearest, in graph order."""
    modules = _modules(gm)
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default or len(node.args) < 2:
            continue
        w = node.args[1]
        if not _is_observer(w, modules):
            continue
        obs = modules[str(w.target)]
        if getattr(obs, "weight_algorithm", "rtn") in (None, "rtn"):
            continue
        attr = w.args[0]
        if not (isinstance(attr, Node) and attr.op == "get_attr"):
            continue
        src = node.args[0]
        while _is_observer(src, modules):
            src = src.args[0]
        found.append(RoundedLinear(node, str(attr.target), obs, src, _block_of(node)))
    return found


def observer_unwrapper(gm: GraphModule):
    """A function mapping a node of ``gm`` (prepared) to what its observers observe: a linear's
    weight argument to the weight's ``get_attr``."""
    modules = _modules(gm)

    def unwrap(node):
        while _is_observer(node, modules):
            node = node.args[0]
        return node

    return unwrap


def pending_algorithms(gm: GraphModule) -> set[str]:
    """The rounding algorithms ``gm``'s weight observers ask for (empty: round to nearest)."""
    return {lin.algorithm for lin in find_rounded_linears(gm)}


# --- running the graph without its observers --------------------------------------------------
class _Stop(Exception):
    """Raised by a tap once everything a pass needs is recorded (the rest of the model is skipped)."""


class _StopHere(torch.nn.Module):
    def forward(self, *args):
        raise _Stop


class _Catch(torch.nn.Module):
    def __init__(self, gm: GraphModule, around=None) -> None:
        super().__init__()
        self.gm = gm
        self.around = around

    def forward(self, *args, **kwargs):
        with contextlib.nullcontext() if self.around is None else self.around(args, kwargs):
            try:
                return self.gm(*args, **kwargs)
            except _Stop:
                return None


def without_observers(gm: GraphModule) -> tuple[torch.fx.Graph, dict[Node, Node]]:
    """A copy of ``gm``'s graph with every observer call bypassed, and the map from ``gm``'s
    nodes (observers excepted) to the copy's."""
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    modules = _modules(gm)
    for old, new in env.items():
        if _is_observer(old, modules):
            new.replace_all_uses_with(new.args[0])
    for old, new in list(env.items()):
        if _is_observer(old, modules):
            graph.erase_node(new)
            del env[old]
    return graph, env


class Tapped:
    """A view of a prepared model that runs it with every observer bypassed (parameters are
    shared, not copied), into which passes insert taps on chosen nodes."""

    def __init__(self, prepared: GraphModule) -> None:
        graph, self.env = without_observers(prepared)
        self.gm = GraphModule(prepared, graph)
        self.taps: list[Node] = []

    def tap(self, node: Node, module: torch.nn.Module, *, stop: bool = False) -> None:
        """Call ``module`` on the value of ``node`` (a node of the prepared graph); with
        ``stop``, the pass ends right after it."""
        graph = self.gm.graph
        name = f"_qk_tap_{len(self.taps)}"
        self.gm.add_submodule(name, module)
        with graph.inserting_after(self.env[node]):
            t = graph.call_module(name, (self.env[node],))
        self.taps.append(t)
        if stop:
            self.gm.add_submodule(name + "_stop", _StopHere())
            with graph.inserting_after(t):
                self.taps.append(graph.call_module(name + "_stop", (t,)))

    def clear(self) -> None:
        for t in reversed(self.taps):
            self.gm.graph.erase_node(t)
            delattr(self.gm, str(t.target))
        self.taps = []

    def run(self, data: Iterable, *, max_batches: int | None, desc: str, around=None) -> int:
        """One pass over ``data``; ``around(args, kwargs)``, when given, is a context manager
        entered around each batch's forward."""
        self.gm.recompile()
        return run_batches(_Catch(self.gm, around), data, progress=False, max_batches=max_batches, desc=desc,
                           what="calibration", skip_padding=True)


def fix_qparams(obs, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
    """``obs.set_qparams`` with the shapes and dtypes of the observer's own qparams."""
    own_scale, own_zp = obs.calculate_qparams()
    obs.set_qparams(scale.reshape(own_scale.shape).to(own_scale.dtype),
                    zero_point.reshape(own_zp.shape).to(own_zp.dtype))


# --- the plan the rounding hooks share ----------------------------------------------------------
_PLAN = "weight_rounding"  # CalibrationRun.state key


def rounding_plan(cal: CalibrationRun) -> list[RoundedLinear]:
    """The linears of ``cal.prepared`` whose weight observers ask for a rounding algorithm
    (empty: round to nearest), found and checked once per ``calibrate`` call.

    Raises (when an algorithm is asked for):
        CalibrationError: an unknown algorithm, ``cal.data`` is a one-shot iterator (the
            algorithms pass over it several times), or the weights were already rounded by an
            earlier ``calibrate`` call.
    """
    if _PLAN in cal.state:
        return cal.state[_PLAN]
    prepared, data = cal.prepared, cal.data
    linears = find_rounded_linears(prepared)
    if linears:
        algos = sorted({lin.algorithm for lin in linears})
        unknown = [a for a in algos if a not in ROUNDING_ALGORITHMS]
        if unknown:
            raise CalibrationError(f"unknown weight algorithm {unknown[0]!r}; use 'rtn', 'gptq', 'awq' or 'awq+gptq'")
        if isinstance(data, Iterator):
            raise CalibrationError(
                f"{'/'.join(a.upper() for a in algos)} passes over the calibration data several times, "
                "but it is a one-shot iterator; pass a list of batches or a DataLoader"
            )
        if prepared.meta.get(ROUNDING_META_KEY):
            raise CalibrationError(
                "this model's weights were already rounded by an earlier calibrate call; GPTQ/AWQ use the data of "
                "one call: prepare the model again and pass all calibration batches to one calibrate call"
            )
    cal.state[_PLAN] = linears
    return linears


def record_rounding(cal: CalibrationRun, records: list[dict]) -> None:
    """Add a rounding step's records to ``prepared.meta[ROUNDING_META_KEY]`` (written by
    ``calibrate`` once every step and the pass succeeded)."""
    cal.meta.setdefault(ROUNDING_META_KEY, []).extend(records)
