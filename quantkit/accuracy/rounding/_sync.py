"""GPTQ, AWQ and SmoothQuant under a ``torch.distributed`` process group: each rank passes
over its shard of the calibration batches, then the statistics are reduced so that every rank
rounds and smooths identically.

What "the same as one process on all the batches" means here (the ranks' shards in rank
order, as :func:`quantkit.shard` splits a list, are the original batch order):

- SmoothQuant's per-channel activation min/max: MIN/MAX across ranks, ``torch.equal`` to one
  process, hence the same factors ``s`` for a fixed α.
- AWQ's mean |x| per channel: the per-batch sums are concatenated in rank order and summed
  again batch after batch, as one process adds them: ``torch.equal``.
- The rows sampled for AWQ's searches: each rank keeps the rows of its shard with the
  smallest keys (``_sample``: a batch's keys are seeded by its values, not its position), and
  the bottom 2048 keys of the ranks' union are one process's sample, ``torch.equal``. With
  equal statistics and rows, the scales, clipping and folded weights are ``torch.equal``.
- SmoothQuant ``alpha="auto"``'s rows: the ranks' samples in rank order, cut to 1024 rows. One
  process draws its sample from the first batches (at most a quarter of it per batch), so this
  equals its sample whenever rank 0's shard fills it (at least 4 batches); otherwise it is a
  sample of the same size from the first shards.
- GPTQ's Hessians ``XᵀX`` (float64) and row counts: SUMmed after each block's pass, before
  any weight is rounded, so every rank holds the same Hessian and rounds to the same
  integers. The sum equals one process that merges the ranks' Hessian observers in rank
  order (``HessianObserver.merge``), not bit for bit one process that summed every batch
  in turn (float64 addition is not associative: the Hessians differ in the last bits), so
  the integers equal the single-process run's except at near-ties (tests: ≥ 99.9 %).

AWQ's pass and the calibration pass exchange an error flag first
(:func:`quantkit.pipeline._distributed.on_all_ranks`), so a rank whose pass raised stops every
rank there; a rank whose GPTQ pass raised joins the other ranks' Hessian sync with the flag
set (:func:`distributed_rounding`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch

from quantkit.observers._sync import EXCHANGED, abandon, sync_observers

from ...pipeline._distributed import on_all_ranks
from ._sample import RowSample

__all__ = ["distributed_rounding", "synced_pass", "sync_hessians", "sync_channel_stats", "sync_row_stats",
           "sync_batch_sample"]

_ACTIVE = [False]  # within distributed_rounding(True): the rounding passes sync


@contextlib.contextmanager
def distributed_rounding(on: bool):
    """Within: GPTQ's and AWQ's passes sync their statistics across the process group.

    An error leaving it that the ranks did not exchange (a GPTQ block's pass failed on this
    rank, while the others wait in that block's Hessian sync) first joins that sync with the
    error flag set (:func:`quantkit.observers._sync.abandon`), so every rank fails there; an
    error every rank raises alike (rounding identical Hessians) joins on every rank alike."""
    before = _ACTIVE[0]
    _ACTIVE[0] = bool(on)
    try:
        yield
    except Exception as exc:
        if on and not getattr(exc, EXCHANGED, False):
            setattr(exc, EXCHANGED, True)
            abandon()
        raise
    finally:
        _ACTIVE[0] = before


def active() -> bool:
    return _ACTIVE[0]


def synced_pass(run: Callable[[], int], sync: Callable[[], object], distributed: bool | None = None) -> int:
    """``run()`` (one pass over this rank's batches; returns its count); under a process group
    (``distributed``, default: within :func:`distributed_rounding`) the ranks exchange error
    flags, then ``sync()`` reduces the statistics; returns the batch count over all ranks."""
    if not (active() if distributed is None else distributed):
        return run()
    return on_all_ranks(run, sync)


def sync_hessians(hessians: dict) -> None:
    """Sum a GPTQ group's Hessian observers across ranks (within :func:`distributed_rounding`);
    called where the group's Hessians are complete, before any weight is rounded."""
    if active():
        sync_observers([(f"hessian of '{src.name}'", h) for src, h in hessians.items()])


class _Carrier(torch.nn.Module):
    """Tensors with declared reductions (``sync_ops``), for statistics kept outside observers."""

    def __init__(self, name: str, ops: dict[str, str], tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.node_name = name
        self.sync_ops = ops
        for key, t in tensors.items():
            self.register_buffer(key, t)


def _rows(parts: list[torch.Tensor], channels: int) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, channels)


def _channels(*tensors) -> int:
    return next((t.shape[-1] for t in tensors if t is not None), 0)


def sync_channel_stats(stats: list) -> None:
    """SmoothQuant's per-group ``_ChannelStats`` (min, max, sampled rows) across ranks."""
    carriers = []
    for i, st in enumerate(stats):
        c = _channels(st.min, *st.rows)
        empty = torch.zeros(0)
        carriers.append(_Carrier(f"smoothquant group {i}", {"lo": "min", "hi": "max", "rows": "cat"}, {
            "lo": empty if st.min is None else st.min, "hi": empty if st.max is None else st.max,
            "rows": _rows(st.rows, c)}))
    sync_observers(carriers)
    for st, c in zip(stats, carriers):
        if c.lo.numel():
            st.min, st.max = c.lo, c.hi
        st.rows = [c.rows[:st.keep_rows]] if c.rows.numel() and st.keep_rows else []
        st.kept = sum(r.shape[0] for r in st.rows)


def sync_row_stats(stats: Iterable) -> None:
    """AWQ's per-group ``_RowStats`` (per-batch |x| sums, row count, sampled rows and their keys)
    across ranks; the total |x| is summed again batch after batch in rank order, as one process
    does, and the row sample is the bottom ``keep`` keys of every rank's (``_sample``)."""
    stats = list(stats)
    carriers = []
    for i, st in enumerate(stats):
        rows = st.sample.rows
        c = _channels(st.abs_sum, rows)
        sums = torch.stack(st.sums) if st.sums else torch.zeros(0, c, dtype=torch.float64)
        carriers.append(_Carrier(f"awq group {i}", {"sums": "cat", "count": "sum", "rows": "cat", "keys": "cat"}, {
            "sums": sums, "count": torch.tensor(st.count, dtype=torch.int64),
            "rows": _rows([] if rows is None else [rows], c), "keys": st.sample.keys}))
    sync_observers(carriers)
    for st, c in zip(stats, carriers):
        st.sums = list(c.sums.unbind(0)) if c.sums.numel() else []
        st.abs_sum = None
        for s in st.sums:  # the additions one process makes, in its order
            st.abs_sum = s if st.abs_sum is None else st.abs_sum + s
        st.count = int(c.count)
        st.sample = RowSample(st.sample.keep, st.sample.seed)
        st.sample.merge(c.keys, c.rows)


def sync_batch_sample(sample) -> None:
    """AWQ's whole-batch sample for the blocks that mix a sequence's rows (``_region.BatchSample``)
    across ranks: every rank takes in every rank's kept batches and keeps the smallest keys
    within the budget, one process's choice on all the batches (a batch's key is seeded by
    its values)."""
    if not active():
        return
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, sample.kept)  # within the process group, not a file
    sample.kept = []
    sample.merge([item for rank in gathered for item in rank])
