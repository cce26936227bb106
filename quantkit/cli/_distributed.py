"""``quantkit quantize`` under torchrun: one process group, calibration sharded by rank.

``torchrun --nproc-per-node N -m quantkit quantize ...`` (or the ``quantkit`` script under
torchrun) starts N copies; torchrun sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``. Each copy
loads the model and data, and calibrates on its contiguous shard of the calibration batches
(:func:`quantkit.shard`); :func:`quantkit.calibrate` then reduces the observers exactly, so
every rank holds the observers of one process that calibrated on all of them. Rank 0 alone
converts, evaluates, writes the artifact (atomically) and prints; the other ranks exit 0
after the reduction. A rank that fails during calibration makes every rank fail (the error
flag is exchanged before the reduction); a rank that fails elsewhere is stopped by torchrun,
and the process group's timeout (``QUANTKIT_DIST_TIMEOUT`` seconds, default 600) bounds any
wait for a lost peer.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import torch

from ._cli_inputs import UsageError

__all__ = ["torchrun_group", "is_main", "shard_batches", "rank_device", "DEFAULT_TIMEOUT_S"]

# seconds a collective waits for a peer before failing: long enough for ranks whose
# calibration shards take different times (they differ by at most one batch), short
# enough that a lost peer ends the run in minutes, not torch's default 30
DEFAULT_TIMEOUT_S = 600.0


def _world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UsageError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer; launch with torchrun") from None


def _timeout() -> timedelta:
    text = os.environ.get("QUANTKIT_DIST_TIMEOUT", str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UsageError(f"QUANTKIT_DIST_TIMEOUT={text!r} must be a positive number of seconds")
    return timedelta(seconds=seconds)


@contextlib.contextmanager
def torchrun_group(args):
    """Within: a torch.distributed process group when launched by torchrun with more than one
    process (gloo, or nccl for ``--device cuda``); ranks other than 0 are made quiet. Outside
    torchrun (or with an initialised group already): nothing."""
    import torch.distributed as dist

    if _world() <= 1 or (dist.is_available() and dist.is_initialized()):
        yield
        return
    if not dist.is_available():
        raise UsageError("this torch build has no torch.distributed; run quantkit without torchrun")
    for attr, flag in (("accuracy_budget", "--accuracy-budget"), ("sequential", "--sequential"),
                       ("max_memory", "--max-memory"), ("resume", "--resume")):
        if getattr(args, attr, None) not in (None, False):
            raise UsageError(f"{flag} runs on one process; drop it or run without torchrun")
    cuda = str(getattr(args, "device", None) or "cpu").startswith("cuda")
    if cuda and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=_timeout())
    try:
        if dist.get_rank() != 0:
            args.quiet = True
        yield
    finally:
        dist.destroy_process_group()


def _group_rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def is_main() -> bool:
    """Whether this process evaluates, writes and prints (rank 0, or no process group)."""
    return _group_rank() in (None, 0)


def shard_batches(batches: list) -> list:
    """This rank's contiguous share of the calibration batches (all of them on one process)."""
    if _group_rank() is None:
        return batches
    from quantkit.pipeline._distributed import shard

    return shard(batches)


def rank_device(device: torch.device) -> torch.device:
    """``cuda`` without an index means this rank's GPU (``LOCAL_RANK``) under torchrun."""
    if device.type == "cuda" and device.index is None and _group_rank() is not None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device
