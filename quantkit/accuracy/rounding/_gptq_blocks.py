"""GPTQ over the chain of blocks of ``pipeline._partition``: each block's inputs cached, each block run once.

GPTQ rounds a transformer block's linears from the Hessians of their inputs, computed with
every earlier block already rounded. Re-running the model's prefix for every block costs
O(L²) block forwards; here the inputs of the *rounded stream* (the values the chain hands on
with rounded weights) are cached per calibration batch, so that each block runs once to
collect its Hessians and once more, rounded, to hand its outputs on: O(L).

The same functions serve both paths, so that they agree by construction:

- in memory (:func:`run_gptq_blocks`, called by ``_gptq.run_gptq``): the prepared model
  is partitioned and its rounded stream kept in memory (``None`` when the graph cannot be
  partitioned or its GPTQ groups do not fit the chain: the caller re-runs prefixes instead);
- block by block from safetensors (``quantkit.sequential._gptq.SequentialGPTQ``, the
  block-by-block run's ``after_block`` hook): the rounded stream goes through an ``ActivationCache`` (in
  memory within the budget, on disk above it and for resuming).

Within a block, the linears of one GPTQ group (``RoundedLinear.block``: a transformer layer,
or a head/tail module such as a pooler) share one data pass; groups of the same partition
block (the tail's pooler then classifier) are rounded one after the other, each seeing the
earlier ones rounded, as the prefix re-run does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
import torch.utils._pytree as pytree
from torch.export._tree_utils import reorder_kwargs
from torch.fx import GraphModule, Node

from quantkit.observers import HessianObserver
from quantkit.observers._tokens import token_mask

from ..._errors import CalibrationError, CaptureError, QuantkitError
from ..._graph import get_attr, set_attr
from ...pipeline._calibrate import _padding_mask
from ...pipeline._inputs import as_args_kwargs
from ...pipeline._partition import partition
from .._gptq import GPTQConfig, gptq_quantize
from .._wscheme import WeightScheme
from ._base import RoundedLinear, _Stop, _StopHere, fix_qparams, without_observers
from ._sync import sync_hessians

__all__ = ["round_linears", "RoundedBlock", "plan_gptq", "round_block", "head_values", "run_gptq_blocks",
           "later_inputs"]

Groups = list[tuple[str, list[RoundedLinear]]]


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
        cfg = config
        damp = getattr(lin.observer, "gptq_percdamp", None)  # an observer may declare its dampening (FP8)
        if damp is not None:
            cfg = replace(cfg, percdamp=float(damp))
        if getattr(lin.observer, "gptq_clip_search", False):  # and its range search (WeightOnlyConfig.clip_search)
            cfg = replace(cfg, clip_search=True)
        res = gptq_quantize(w.detach(), h.hessian, WeightScheme.of(lin.observer), cfg)
        rounded = res.dequantized.to(w.dtype)
        for owner in owners:
            set_attr(owner, lin.weight, rounded)
        fix_qparams(lin.observer, res.scale, res.zero_point)
        records.append({"layer": lin.node.name, "block": block, "algorithm": "gptq", "rows": int(h.rows)})
    return records


class RoundedBlock:
    """A partition block run with its observers bypassed (attributes shared with the block's
    module as they are now), into which Hessian taps are inserted."""

    def __init__(self, block) -> None:
        graph, env = without_observers(block.module)
        self.block = block
        self.gm = GraphModule(block.module, graph, class_name=f"Rounded{block.index}")
        # node of the partitioned (prepared) graph -> node of this graph
        self.node_of = {block.origin[old.name]: new for old, new in env.items() if old.name in block.origin}

    def __call__(self, values: dict) -> dict:
        """The block's outputs (observers bypassed) for the boundary values it reads."""
        return dict(zip(self.block.outputs, self.gm(*[values[name] for name in self.block.inputs])))

    def hessians(self, sources: list[Node], n: int, get: Callable[[int], dict], masks: list) -> dict:
        """One pass over the ``n`` cached inputs (``get(i)``), recording the input Hessian of
        each of ``sources`` (nodes of the prepared graph); the pass stops after the last one."""
        graph = self.gm.graph
        order = {node: i for i, node in enumerate(graph.nodes)}
        last_placeholder = [node for node in graph.nodes if node.op == "placeholder"][-1]
        added, hessians = [], {}
        where = {src: self.node_of[src] for src in sources}
        for k, src in enumerate(sorted(sources, key=lambda s: order[where[s]])):
            h = hessians[src] = HessianObserver(product_dtype=torch.float32)  # see HessianObserver
            h.node_name = src.name
            name = f"_qk_hessian_{k}"
            self.gm.add_submodule(name, h)
            at = where[src]
            with graph.inserting_after(last_placeholder if at.op == "placeholder" else at):
                added.append(graph.call_module(name, (at,)))
        stop = "_qk_hessian_stop"
        self.gm.add_submodule(stop, _StopHere())
        last_tap = max(added, key=lambda t: order.get(t.args[0], -1))
        with graph.inserting_after(last_tap):
            added.append(graph.call_module(stop, (last_tap,)))
        self.gm.recompile()
        try:
            with torch.no_grad():
                for i in range(n):
                    values = get(i)
                    with token_mask(masks[i]):
                        try:
                            self.gm(*[values[name] for name in self.block.inputs])
                        except _Stop:
                            pass
        finally:
            for t in reversed(added):
                graph.erase_node(t)
                delattr(self.gm, str(t.target))
            self.gm.recompile()
        return hessians


def plan_gptq(blocks: list, linears: list[RoundedLinear]) -> dict[int, Groups] | None:
    """The GPTQ groups of each partition block (index -> ``[(group name, linears)]`` in graph
    order), or None when a group spans several blocks or the groups do not follow the chain."""
    member: dict[Node, int] = {}
    for blk in blocks:
        for node in blk.module.graph.nodes:
            if node.op not in ("placeholder", "output", "get_attr") and node.name in blk.origin:
                member[blk.origin[node.name]] = blk.index
    groups: dict[str, list[RoundedLinear]] = {}
    for lin in linears:
        groups.setdefault(lin.block, []).append(lin)
    plan: dict[int, Groups] = {}
    last = -1
    for name, lins in groups.items():
        where = {member.get(lin.node) for lin in lins}
        if len(where) != 1 or None in where:
            return None
        b = where.pop()
        if b < last:
            return None
        last = b
        plan.setdefault(b, []).append((name, lins))
    return plan


def round_block(rb: RoundedBlock, groups: Groups, n: int, get: Callable[[int], dict], masks: list, *,
                config: GPTQConfig, owners: list[torch.nn.Module]) -> list[dict]:
    """Round the linears of ``groups`` (all in ``rb``'s block) with GPTQ, group after group:
    one pass over the block's ``n`` cached inputs each, then :func:`round_linears`. The rounded
    weights are set on ``owners`` (the first holds the float weights) and on ``rb``."""
    records = []
    for name, lins in groups:
        hessians = rb.hessians(list(dict.fromkeys(lin.source for lin in lins)), n, get, masks)
        records += round_linears(lins, hessians, name, config, [*owners, rb.gm])
    return records


def head_values(gm: GraphModule, batch) -> dict:
    """The graph's placeholder values for one calibration batch (the head block's inputs)."""
    args, kwargs = as_args_kwargs(batch)
    in_spec = gm.graph._codegen.pytree_info.in_spec
    leaves, _ = pytree.tree_flatten((args, reorder_kwargs(kwargs, in_spec)))
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if len(leaves) != len(names):
        raise QuantkitError(f"a calibration batch has {len(leaves)} inputs, the captured model takes "
                            f"{len(names)}; give every batch the first batch's keys")
    return dict(zip(names, leaves))


def later_inputs(blocks: list) -> list[set]:
    """For each block, the boundary values a later block reads (what a pass must hand on)."""
    return [set().union(*(b.inputs for b in blocks[i + 1:])) for i in range(len(blocks))]


def run_gptq_blocks(prepared: GraphModule, linears: list[RoundedLinear], data: Iterable, *,
                    max_batches: int | None, config: GPTQConfig = GPTQConfig()) -> list[dict] | None:
    """In-memory GPTQ on ``prepared`` with each partition block run once per pass; None (nothing
    done) when the graph has no chain of blocks that holds the GPTQ groups."""
    try:
        blocks = partition(prepared)
    except CaptureError:
        return None
    plan = plan_gptq(blocks, linears)
    if plan is None:
        return None
    batches = list(data) if max_batches is None else list(itertools.islice(data, max_batches))
    masks = [_padding_mask(b) for b in batches]
    values = [head_values(prepared, b) for b in batches]
    later = later_inputs(blocks)
    last = max(plan)
    records: list[dict] = []
    for blk in blocks[:last + 1]:
        rb = RoundedBlock(blk)
        if blk.index in plan:
            records += round_block(rb, plan[blk.index], len(values), values.__getitem__, masks, config=config,
                                   owners=[prepared])
        if blk.index < last:
            with torch.no_grad():
                values = [{k: x for k, x in {**v, **rb(v)}.items() if k in later[blk.index]} for v in values]
    return records
