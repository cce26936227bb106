"""Weight rounding algorithms (GPTQ, AWQ) run by ``quantkit.calibrate`` on a prepared model.

A weight observer that declares ``weight_algorithm`` ``"gptq"`` or ``"awq"`` (set by
``WeightOnlyQuantizer(algorithm=...)`` or ``QuantConfig(weight_algorithm=...)``) asks for its
linear's weight to be rounded by that algorithm instead of to nearest. ``calibrate`` then:

1. runs AWQ (one pass over the data, before the usual calibration pass, so activation
   observers see the scaled activations): per input channel scales folded into the
   preceding norm/linear or kept as an explicit ``mul``;
2. runs the usual calibration pass;
3. runs GPTQ transformer block by transformer block in graph order: one pass over the data
   per block collects the Hessians of the block's linears with the blocks before it already
   rounded, then each weight is rounded.

The rounded weight is stored in ``prepared`` dequantized (a new tensor: the caller's
parameters are never written) and its observer's qparams are fixed with ``set_qparams``, so
``convert`` stores exactly the integers the algorithm chose.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch
from torch.fx import GraphModule, Node

from .._errors import CalibrationError
from ..pipeline._calibrate import run_batches
from .._graph import module_scopes
from ._dist_rounding import distributed_rounding, sync_hessians, synced_pass
from ._gptq import GPTQConfig, gptq_quantize
from ._wscheme import WeightScheme

__all__ = ["with_weight_algorithms", "pending_algorithms", "ROUNDING_META_KEY"]

aten = torch.ops.aten
# gm.meta entry: one record per rounded linear ({"layer", "module", "algorithm", ...})
ROUNDING_META_KEY = "quantkit_weight_rounding"


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
    from ..pipeline._prepare import is_observer_node

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


def pending_algorithms(gm: GraphModule) -> set[str]:
    """The rounding algorithms ``gm``'s weight observers ask for (empty: round to nearest)."""
    return {lin.algorithm for lin in find_rounded_linears(gm)}


# --- attributes -------------------------------------------------------------------------------
def get_attr(gm: torch.nn.Module, target: str) -> torch.Tensor:
    obj = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def set_attr(gm: torch.nn.Module, target: str, value: torch.Tensor) -> None:
    """Register a new tensor at ``target`` (a parameter stays a parameter); the old tensor,
    possibly the caller's, is left untouched."""
    *path, name = target.split(".")
    owner = gm.get_submodule(".".join(path)) if path else gm
    if name in owner._parameters:
        owner._parameters[name] = torch.nn.Parameter(value.detach(), requires_grad=False)
    elif name in owner._buffers:
        owner._buffers[name] = value.detach()
    else:
        setattr(owner, name, value.detach())


# --- running the graph without its observers --------------------------------------------------
class _Stop(Exception):
    """Raised by a tap once everything a pass needs is recorded (the rest of the model is skipped)."""


class _StopHere(torch.nn.Module):
    def forward(self, *args):
        raise _Stop


class _Catch(torch.nn.Module):
    def __init__(self, gm: GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *args, **kwargs):
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

    def run(self, data: Iterable, *, max_batches: int | None, desc: str) -> int:
        self.gm.recompile()
        return run_batches(_Catch(self.gm), data, progress=False, max_batches=max_batches, desc=desc,
                           what="calibration", skip_padding=True)


# --- GPTQ -----------------------------------------------------------------------------------
def _last(nodes: list[Node], order: dict[Node, int]) -> Node:
    return max(nodes, key=order.__getitem__)


def fix_qparams(obs, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
    """``obs.set_qparams`` with the shapes and dtypes of the observer's own qparams."""
    own_scale, own_zp = obs.calculate_qparams()
    obs.set_qparams(scale.reshape(own_scale.shape).to(own_scale.dtype),
                    zero_point.reshape(own_zp.shape).to(own_zp.dtype))


def round_linears(lins: list[RoundedLinear], hessians: dict, block: str, config: GPTQConfig,
                  owners: list[torch.nn.Module]) -> list[dict]:
    """Round ``lins`` (one GPTQ group) from the input Hessians of their sources (``hessians``,
    complete: every batch seen); the rounded weight is set on every module of ``owners`` (the
    first holds the float weights) and the observers' qparams are fixed. Both the block-cached
    pass (``_gptq_blocks``) and the prefix re-run call it."""
    # the group's Hessians are complete here, before any weight is rounded: under a process
    # group, summed across ranks so that every rank rounds identically
    sync_hessians(hessians)
    records = []
    for lin in lins:
        h = hessians[lin.source]
        if not h.calibrated:
            raise CalibrationError(
                f"no calibration batch reached linear '{lin.node.name}' ({block}); GPTQ needs its inputs: "
                "pass batches that run that part of the model"
            )
        w = get_attr(owners[0], lin.weight)
        damp = getattr(lin.observer, "gptq_percdamp", None)  # an observer may declare its dampening (FP8)
        cfg = config if damp is None else replace(config, percdamp=float(damp))
        res = gptq_quantize(w.detach(), h.hessian, WeightScheme.of(lin.observer), cfg)
        rounded = res.dequantized.to(w.dtype)
        for owner in owners:
            set_attr(owner, lin.weight, rounded)
        fix_qparams(lin.observer, res.scale, res.zero_point)
        records.append({"layer": lin.node.name, "block": block, "algorithm": "gptq", "rows": int(h.rows)})
    return records


def run_gptq(prepared: GraphModule, linears: list[RoundedLinear], data: Iterable, *,
             max_batches: int | None, config: GPTQConfig = GPTQConfig()) -> list[dict]:
    """Round the weights of ``linears`` with GPTQ, block by block in graph order: on the chain of
    blocks of ``pipeline._partition`` with each block's inputs cached (``_gptq_blocks``, each block
    run once), or by re-running the model's prefix for each block where the graph has no chain."""
    from ._gptq_blocks import run_gptq_blocks

    records = run_gptq_blocks(prepared, linears, data, max_batches=max_batches, config=config)
    if records is not None:
        return records
    return run_gptq_prefix(prepared, linears, data, max_batches=max_batches, config=config)


def run_gptq_prefix(prepared: GraphModule, linears: list[RoundedLinear], data: Iterable, *,
                    max_batches: int | None, config: GPTQConfig = GPTQConfig()) -> list[dict]:
    """GPTQ with one pass over the model's prefix per block (O(L²) block forwards)."""
    from quantkit.observers import HessianObserver

    tapped = Tapped(prepared)
    order = {n: i for i, n in enumerate(prepared.graph.nodes)}
    blocks: dict[str, list[RoundedLinear]] = {}
    for lin in linears:
        blocks.setdefault(lin.block, []).append(lin)
    records = []
    for block, lins in blocks.items():
        sources = list(dict.fromkeys(lin.source for lin in lins))
        last = _last(sources, order)
        hessians = {}
        for src in sources:
            hessians[src] = HessianObserver()
            hessians[src].node_name = src.name
        for src in sorted(sources, key=order.__getitem__):
            tapped.tap(src, hessians[src], stop=src is last)
        tapped.run(data, max_batches=max_batches, desc=f"gptq {block}")
        tapped.clear()
        records += round_linears(lins, hessians, block, config, [prepared, tapped.gm])
    return records


# --- the calibrate hook -------------------------------------------------------------------------
def with_weight_algorithms(prepared: GraphModule, data: Iterable, run: Callable[[], int], *,
                           max_batches: int | None = None, distributed: bool = False) -> Callable[[], int]:
    """Wrap calibrate's pass ``run`` (returns the batch count) with the rounding algorithms the
    prepared model's weight observers ask for; ``run`` itself when they ask for none. With
    ``distributed``, ``data`` is this rank's shard and every pass syncs its statistics
    (``_dist_rounding``); the wrapper still returns this rank's count.

    Raises (when an algorithm is asked for):
        CalibrationError: ``data`` is a one-shot iterator (the algorithms pass over it several
            times), or the weights were already rounded by an earlier ``calibrate`` call.
    """
    linears = find_rounded_linears(prepared)
    if not linears:
        return run
    algos = sorted({lin.algorithm for lin in linears})
    unknown = [a for a in algos if a not in ("gptq", "awq")]
    if unknown:
        raise CalibrationError(f"unknown weight algorithm {unknown[0]!r}; use 'rtn', 'gptq' or 'awq'")
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

    def wrapped() -> int:
        records, mine = [], []
        with distributed_rounding(distributed):
            awq = [lin for lin in linears if lin.algorithm == "awq"]
            if awq:
                from ._awq import run_awq

                records += run_awq(prepared, awq, data, max_batches=max_batches)
            seen = synced_pass(lambda: mine.append(run()) or mine[0], lambda: None)  # all ranks' count
            gptq = [lin for lin in find_rounded_linears(prepared) if lin.algorithm == "gptq"]
            if seen and gptq:
                records += run_gptq(prepared, gptq, data, max_batches=max_batches)
        prepared.meta[ROUNDING_META_KEY] = records
        return mine[0]

    return wrapped
