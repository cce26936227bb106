"""``quantkit quantize`` under torchrun: one process group, calibration sharded by rank.

``torchrun --nproc-per-node N -m quantkit quantize ...`` (or the ``quantkit`` script under
torchrun) starts N copies; torchrun sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``. Each copy
loads the model and data, and calibrates on its contiguous shard of the calibration batches
(:func:`quantkit.shard`); :func:`quantkit.calibrate` then reduces the observers exactly, so
every rank holds the observers of one process that calibrated on all of them. Rank 0 alone
evaluates, writes the artifact (atomically) and prints; the other ranks exit 0 after
converting. The process group exists from calibration on: passes over all the data before
it (SmoothQuant, a recipe search) run on every rank alone, identically. A rank that fails during calibration makes every rank fail (the error
flag is exchanged before the reduction); a rank that fails elsewhere is stopped by torchrun,
and the process group's timeout (``QUANTKIT_DIST_TIMEOUT`` seconds, default 600) bounds any
wait for a lost peer.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from ._cli_inputs import UsageError

__all__ = ["torchrun_group", "calibrate", "is_main", "rank_device", "DEFAULT_TIMEOUT_S"]

# seconds a collective waits for a peer before failing: long enough for ranks whose
# calibration shards take different times (they differ by at most one batch), short
# enough that a lost peer ends the run in minutes, not torch's default 30
DEFAULT_TIMEOUT_S = 600.0


def _timeout() -> timedelta:
    text = os.environ.get("QUANTKIT_DIST_TIMEOUT", str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UsageError(f"QUANTKIT_DIST_TIMEOUT={text!r} must be a positive number of seconds")
    return timedelta(seconds=seconds)


@dataclass(frozen=True)
class _Launch:
    rank: int
    world: int
    local_rank: int
    backend: str


_LAUNCH: _Launch | None = None  # set within torchrun_group


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise UsageError(f"{name}={os.environ[name]!r} is not an integer; launch with torchrun") from None


@contextlib.contextmanager
def torchrun_group(args):
    """Within: this process is one rank of a torchrun launch (more than one process); ranks other
    than 0 are made quiet. The process group itself is created by :func:`calibrate`, when the
    ranks first need each other, so that the whole-data passes before it (SmoothQuant, recipe
    search) run on each rank alone; it is destroyed on the way out. Outside torchrun (or with
    an initialised group already): nothing."""
    global _LAUNCH
    import torch.distributed as dist

    world = _env_int("WORLD_SIZE", 1)
    if world <= 1 or (dist.is_available() and dist.is_initialized()):
        yield
        return
    if not dist.is_available():
        raise UsageError("this torch build has no torch.distributed; run quantkit without torchrun")
    for attr, flag in (("accuracy_budget", "--accuracy-budget"), ("sequential", "--sequential"),
                       ("max_memory", "--max-memory"), ("resume", "--resume")):
        if getattr(args, attr, None) not in (None, False):
            raise UsageError(f"{flag} runs on one process; drop it or run without torchrun")
    _timeout()  # a bad QUANTKIT_DIST_TIMEOUT fails before anything loads
    cuda = str(getattr(args, "device", None) or "cpu").startswith("cuda")
    _LAUNCH = _Launch(rank=_env_int("RANK", 0), world=world, local_rank=_env_int("LOCAL_RANK", 0),
                      backend="nccl" if cuda else "gloo")
    if _LAUNCH.rank != 0:
        args.quiet = True
    try:
        yield
    finally:
        _LAUNCH = None
        if dist.is_initialized():
            dist.destroy_process_group()


def calibrate(prepared, batches: list, *, progress: bool):
    """``quantkit.calibrate`` on this rank's contiguous share of ``batches`` with the exact observer
    reduction under torchrun (the process group is created here); on one process, on all of them."""
    import quantkit

    if _LAUNCH is None:
        return quantkit.calibrate(prepared, batches, progress=progress, distributed=False)
    import torch.distributed as dist

    if _LAUNCH.backend == "nccl":
        torch.cuda.set_device(_LAUNCH.local_rank)
    dist.init_process_group(_LAUNCH.backend, timeout=_timeout())
    mine = quantkit.shard(batches, dist.get_rank(), dist.get_world_size())
    return quantkit.calibrate(prepared, mine, progress=progress, distributed=True)


def is_main() -> bool:
    """Whether this process evaluates, writes and prints (rank 0, or not under torchrun)."""
    return _LAUNCH is None or _LAUNCH.rank == 0


def rank_device(device: torch.device) -> torch.device:
    """``cuda`` without an index means this rank's GPU (``LOCAL_RANK``) under torchrun."""
    if device.type == "cuda" and device.index is None and _LAUNCH is not None:
        return torch.device("cuda", _LAUNCH.local_rank)
    return device
