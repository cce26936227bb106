"""GPTQ inside the block-by-block run, registered as its ``after_block`` calibration hook.

The run's own activation cache holds the float stream (what the observers see); GPTQ rounds each
block's linears from the *rounded* stream (the values the blocks hand on with rounded weights),
which :class:`SequentialGPTQ` keeps in a second cache under the progress directory. The rounding
itself is the in-memory path's (``quantkit.accuracy.rounding._gptq_blocks``), so both agree.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.fx import GraphModule

from .._errors import QuantkitError
from ..accuracy._gptq import GPTQConfig
from ..accuracy.rounding._base import find_rounded_linears, pending_algorithms
from ..accuracy.rounding._gptq_blocks import RoundedBlock, later_inputs, plan_gptq, round_block
from ..pipeline._calibrate import _padding_mask
from ..pipeline._hooks import BlockRun, register_calibration_hook
from ._state import ActivationCache

__all__ = ["SequentialGPTQ", "sequential_gptq"]


class SequentialGPTQ:
    """GPTQ inside the block-by-block run: the float stream (the observers' data) is the run's
    own activation cache; this keeps the rounded stream, which equals the float one until the
    first block with GPTQ linears, in a second cache under the partial directory."""

    def __init__(self, prepared: GraphModule, blocks: list, batches: list, partial_path: Path,
                 budget: int | None, config: GPTQConfig = GPTQConfig(), ledger=None) -> None:
        linears = [lin for lin in find_rounded_linears(prepared) if lin.algorithm == "gptq"]
        plan = plan_gptq(blocks, linears)
        if plan is None:
            raise QuantkitError("GPTQ's layer groups do not follow the model's chain of blocks; "
                                "quantize this model in memory")
        self.plan, self.blocks, self.config = plan, blocks, config
        self.n = len(batches)
        self.masks = [_padding_mask(b) for b in batches]
        self.later = later_inputs(blocks)
        self.last = max(plan) if plan else -1
        self.cache = ActivationCache(Path(partial_path) / "gptq", budget, ledger)  # ledger: the partial dir's digests
        self.diverged = False
        self.records: list[dict] = []

    @staticmethod
    def wanted(prepared: GraphModule) -> bool:
        return "gptq" in pending_algorithms(prepared)

    def resume(self, done: int, block_file: Callable[[int], Path], observers: dict) -> None:
        """Continue after block ``done``: the rounded stream it wrote, and the qparams GPTQ fixed."""
        from safetensors import safe_open

        self.diverged = any(b <= done for b in self.plan)
        if self.diverged and done < self.last:
            self.cache.resume(done)
            for i in range(self.n):
                self.cache.get(i)
        for b in range(done + 1):
            with safe_open(str(block_file(b)), framework="pt") as f:
                for key in f.keys():
                    if key.startswith("p:scale:"):
                        target = key[len("p:scale:"):]
                        observers[target].set_qparams(f.get_tensor(key), f.get_tensor(f"p:zero_point:{target}"))

    def round(self, block, float_inputs: Callable[[int], dict]) -> dict[str, torch.Tensor]:
        """After the block's float pass: round its GPTQ linears (weights set on ``block.module``)
        and hand the rounded stream on; returns the fixed qparams to store with the block."""
        groups = self.plan.get(block.index)
        if not groups and (not self.diverged or block.index >= self.last):
            return {}
        get = self.cache.get if self.diverged else float_inputs
        rb = RoundedBlock(block)
        fixed: dict[str, torch.Tensor] = {}
        if groups:
            self.records += round_block(rb, groups, self.n, get, self.masks, config=self.config,
                                        owners=[block.module])
            modules = dict(block.module.named_modules())
            for _, lins in groups:
                for lin in lins:
                    target = next(t for t, m in modules.items() if m is lin.observer)
                    scale, zp = lin.observer.calculate_qparams()
                    fixed[f"p:scale:{target}"], fixed[f"p:zero_point:{target}"] = scale.detach(), zp.detach()
        self.diverged = True
        if block.index < self.last:
            self.cache.start(block.index)
            with torch.no_grad():
                for i in range(self.n):
                    values = get(i)
                    keep = {k: x for k, x in {**values, **rb(values)}.items() if k in self.later[block.index]}
                    self.cache.put(block.index, i, keep)
        return fixed

    def finish(self, b: int) -> None:
        """Block ``b`` is committed: its rounded outputs become the next block's inputs."""
        if self.diverged and b < self.last:
            self.cache.finish(b)


@register_calibration_hook("gptq", when="after_block")
def sequential_gptq(run: BlockRun) -> SequentialGPTQ | None:
    """The block-by-block run's GPTQ, when weight observers ask for it."""
    if not SequentialGPTQ.wanted(run.prepared):
        return None
    return SequentialGPTQ(run.prepared, run.blocks, run.batches, run.partial_path, run.budget, ledger=run.ledger)
