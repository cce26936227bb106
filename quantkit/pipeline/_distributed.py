"""Distributed calibration: each rank observes its shard, then the observers are reduced.

``quantkit.calibrate(prepared, data, distributed="auto")`` runs this rank's batches, then
(when ``torch.distributed`` is initialised with more than one process) exchanges an error
flag and the batch counts, and calls :func:`quantkit.observers.sync`. The flag comes first
so that a rank whose calibration raised (NaN in its shard, a bad batch) makes every rank
fail, instead of leaving the others waiting in the observer reduction.

``quantkit.shard`` splits the calibration batches between ranks.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable

import torch

from .._errors import CalibrationError

__all__ = ["shard", "use_distributed", "calibrate_synced", "on_all_ranks"]


def _initialised() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def use_distributed(distributed) -> bool:
    """Whether calibration syncs: ``"auto"`` when a process group of more than one rank is
    initialised; ``True`` requires one (a world of one syncs nothing); ``False`` never."""
    if distributed is False:
        return False
    if distributed is True:
        if not _initialised():
            raise ValueError("distributed=True needs an initialised torch.distributed process group "
                         "(run under torchrun and call torch.distributed.init_process_group first)")
    elif not (isinstance(distributed, str) and distributed == "auto"):
        raise ValueError(f"distributed must be 'auto', True or False, got {distributed!r}")
    elif not _initialised():
        return False
    import torch.distributed as dist

    return dist.get_world_size() > 1


def calibrate_synced(prepared: torch.nn.Module, run: Callable[[], int]) -> int:
    """Run this rank's calibration (``run()`` returns its batch count), exchange failure flags
    and counts, then sync the observers; returns the batch count over all ranks.

    Raises:
        the rank's own error where it failed; CalibrationError naming the failed rank elsewhere.
    """
    from quantkit.observers._sync import sync

    return on_all_ranks(run, lambda: sync(prepared))


def on_all_ranks(run: Callable[[], int], then: Callable[[], Any] | None = None) -> int:
    """Run this rank's pass over its shard (``run()`` returns its batch count), exchange
    failure flags and counts (one collective), then call ``then()`` (the statistics' sync);
    returns the batch count over all ranks.

    Every rank makes the same collectives in the same order whatever fails: each pass of a
    multi-pass calibration (AWQ, the calibration pass, each GPTQ block) goes through this, so
    a rank that fails in one pass stops every rank at that pass's exchange.

    Raises:
        the rank's own error where it failed; CalibrationError naming the failed rank elsewhere.
    """
    import torch.distributed as dist

    from quantkit.observers._sync import EXCHANGED, _comm_device

    rank, world = dist.get_rank(), dist.get_world_size()
    error, seen = None, 0
    try:
        seen = run()
    except Exception as exc:  # every rank must learn of it before anyone enters the reduction
        error = exc
    flags = torch.zeros(world, 2, dtype=torch.int64)
    flags[rank, 0], flags[rank, 1] = int(error is not None), seen
    flags = flags.to(_comm_device(None))
    dist.all_reduce(flags)
    flags = flags.cpu()
    if error is not None:
        setattr(error, EXCHANGED, True)
        raise error
    failed = [r for r in range(world) if flags[r, 0]]
    if failed:
        exc = CalibrationError(
            f"calibration failed on rank {failed[0]} of {world} (see that rank's error); every rank stops")
        setattr(exc, EXCHANGED, True)
        raise exc
    if then is not None:
        then()
    return int(flags[:, 1].sum())


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if _initialised():
        import torch.distributed as dist

        default_rank, default_world = dist.get_rank(), dist.get_world_size()
    else:  # under torchrun before init_process_group, or one process
        default_rank, default_world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    rank = default_rank if rank is None else rank
    world = default_world if world_size is None else world_size
    for what, v in (("rank", rank), ("world_size", world)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"shard: {what} must be an int, got {type(v).__name__}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard: need 0 <= rank < world_size, got rank={rank}, world_size={world}")
    return rank, world


def shard(data: Iterable, rank: int | None = None, world_size: int | None = None) -> Any:
    """This rank's part of ``data`` (an iterable of batches), deterministically.

    Sequences (lists, tuples, datasets with ``len`` and indexing) and iterables with ``len``
    are split into contiguous blocks, rank ``r`` taking batches ``[r·n/W, (r+1)·n/W)`` (sizes
    differ by at most one), so the ranks' shards in rank order are the original order:
    moving-average observers synced after sharded calibration equal one process on ``data``.
    Iterables without ``len`` are split by stride (batch ``i`` to rank ``i mod W``); there
    the rank-major order differs from the original one.

    Args:
        data: the batches (as given to :func:`quantkit.calibrate`).
        rank, world_size: default: the initialised process group's, else the ``RANK`` and
            ``WORLD_SIZE`` environment variables (torchrun's), else 0 and 1.

    Returns:
        A list slice for lists and tuples, a list for other sequences, an iterator otherwise.

    Example:
        >>> quantkit.calibrate(prepared, quantkit.shard(batches))   # on every rank, under torchrun
    """
    if isinstance(data, (torch.Tensor, Mapping, str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(f"shard splits an iterable of batches, got {type(data).__name__}; wrap a single batch "
                        "in a list")
    rank, world = _rank_world(rank, world_size)
    try:
        n = len(data)
    except TypeError:
        n = None
    if n is None:
        return itertools.islice(iter(data), rank, None, world)
    start, stop = rank * n // world, (rank + 1) * n // world
    if isinstance(data, (list, tuple)):
        return data[start:stop]
    if isinstance(data, Sequence) or hasattr(data, "__getitem__"):
        try:
            return [data[i] for i in range(start, stop)]
        except (KeyError, TypeError):
            pass
    return itertools.islice(iter(data), start, stop)
