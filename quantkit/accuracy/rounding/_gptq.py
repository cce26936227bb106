"""GPTQ (Frantar et al. 2022) as a calibration hook: after calibrate's pass, each transformer
block's linears are rounded from the Hessians of their inputs, block by block in graph order,
with the blocks before it already rounded.

On a graph with a chain of blocks (``pipeline._partition``) each block's inputs are cached and
each block runs once per pass (``_gptq_blocks``); elsewhere the model's prefix is re-run for each
block. The rounded weight is stored in ``prepared`` dequantized (a new tensor: the caller's
parameters are never written) and its observer's qparams are fixed with ``set_qparams``, so
``convert`` stores exactly the integers GPTQ chose. Under a process group each block's Hessians
are summed across ranks before any weight is rounded (``_sync``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.fx import GraphModule, Node

from quantkit.observers import HessianObserver

from ...pipeline._hooks import CalibrationRun, register_calibration_hook
from .._gptq import GPTQConfig
from ._base import RoundedLinear, Tapped, find_rounded_linears, record_rounding, rounding_plan
from ._gptq_blocks import round_linears, run_gptq_blocks
from ._sync import distributed_rounding

__all__ = ["GPTQ_ALGORITHMS", "run_gptq", "run_gptq_prefix", "gptq_hook"]

# the weight algorithms GPTQ rounds: awq+gptq's weights arrive here scaled by AWQ's hook
GPTQ_ALGORITHMS = ("gptq", "awq+gptq")


def _last(nodes: list[Node], order: dict[Node, int]) -> Node:
    return max(nodes, key=order.__getitem__)


def run_gptq(prepared: GraphModule, linears: list[RoundedLinear], data: Iterable, *,
             max_batches: int | None, config: GPTQConfig = GPTQConfig()) -> list[dict]:
    """Round the weights of ``linears`` with GPTQ, block by block in graph order: on the chain of
    blocks of ``pipeline._partition`` with each block's inputs cached (``_gptq_blocks``, each block
    run once), or by re-running the model's prefix for each block where the graph has no chain."""
    records = run_gptq_blocks(prepared, linears, data, max_batches=max_batches, config=config)
    if records is not None:
        return records
    return run_gptq_prefix(prepared, linears, data, max_batches=max_batches, config=config)


def run_gptq_prefix(prepared: GraphModule, linears: list[RoundedLinear], data: Iterable, *,
                    max_batches: int | None, config: GPTQConfig = GPTQConfig()) -> list[dict]:
    """GPTQ with one pass over the model's prefix per block (O(L²) block forwards)."""
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
            hessians[src] = HessianObserver(product_dtype=torch.float32)  # see HessianObserver
            hessians[src].node_name = src.name
        for src in sorted(sources, key=order.__getitem__):
            tapped.tap(src, hessians[src], stop=src is last)
        tapped.run(data, max_batches=max_batches, desc=f"gptq {block}")
        tapped.clear()
        records += round_linears(lins, hessians, block, config, [prepared, tapped.gm])
    return records


@register_calibration_hook("gptq", when="after_pass")
def gptq_hook(cal: CalibrationRun) -> Callable[[], None] | None:
    """After calibrate's pass, when weight observers ask for GPTQ (or AWQ+GPTQ, whose weights AWQ
    scaled before the pass): round their linears (found again: AWQ may have put a ``mul`` before
    them), unless the pass saw no batch."""
    if not any(lin.algorithm in GPTQ_ALGORITHMS for lin in rounding_plan(cal)):
        return None

    def step() -> None:
        records: list[dict] = []
        with distributed_rounding(cal.distributed):
            gptq = [lin for lin in find_rounded_linears(cal.prepared) if lin.algorithm in GPTQ_ALGORITHMS]
            if cal.seen and gptq:
                records = run_gptq(cal.prepared, gptq, cal.data, max_batches=cal.max_batches)
        record_rounding(cal, records)

    return step
