"""``quantkit quantize`` under torchrun: one process group, calibration sharded by rank.

``torchrun --nproc-per-node N -m quantkit quantize ...`` (or the ``quantkit`` script under
torchrun) starts N copies; torchrun sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``. Each copy
loads the model and data, and calibrates on its contiguous shard of the calibration batches
(:func:`quantkit.shard`); :func:`quantkit.calibrate` then reduces the observers exactly, so
every rank holds the observers of one process that calibrated on all of them. Rank 0 alone
evaluates, writes the artifact (atomically) and prints. The process group exists from
calibration on: passes over all the data before it (SmoothQuant, a recipe search) run on
every rank alone, identically.

The ranks agree before they merge: at calibration every rank compares the versions, its
recipe flags (everything on the command line but the paths, ``--out``, ``--device`` and
``--quiet``, which may differ by rank), the prepared model's graph, observers and a SHA-256
of every weight, and its data plan (the whole calibration set, batch by batch, and the
shard it takes) with rank 0's (:func:`quantkit.pipeline._distributed.agree`). Any
difference fails every rank with one line naming the rank and what differs.

Every rank ends with a line of its own when one fails or stops:

- a rank that fails before calibration joins the others' agreement with its error, so
  they stop with "rank R of N failed before calibration (...)" instead of waiting;
- a rank that fails during calibration stops every rank at that pass's exchange;
- a rank that ends or goes silent is named by the others ("rank R of N stopped answering
  at ..."), after at most ``QUANTKIT_DIST_TIMEOUT`` seconds (default 600) for a silent one;
- after calibration the other ranks wait for rank 0's outcome and fail with it if it fails.

Every rank's own error line starts with "rank R of N:" so that lines from a shared stderr
can be told apart.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from quantkit.observers._collective import EXCHANGED, PEER_LOST, clean, key, store, timeout_hint

from .._errors import DistributedError
from ..pipeline._distributed import agreement_record, mark_failed_early, report_failure

from ._inputs import UsageError, is_factory_name

__all__ = ["torchrun_group", "calibrate", "is_main", "rank_device", "DEFAULT_TIMEOUT_S"]

# seconds a collective waits for a peer before failing: long enough for ranks whose
# calibration shards take different times (they differ by at most one batch), short
# enough that a lost peer ends the run in minutes, not torch's default 30
DEFAULT_TIMEOUT_S = 600.0
# how long the other ranks wait for rank 0 to evaluate and save: no bound is known for that
# (a large model's evaluation takes hours on a CPU); torchrun stops them if rank 0's process ends
RESULT_WAIT = timedelta(hours=24)
# how long a failing rank waits for the others to reach their own error line before it exits
# (torchrun stops the remaining ranks within 0.1 s of one's exit, --monitor-interval)
LEAVE_WAIT_S = 10.0
# flags that may differ between ranks: paths (compared by content), where to write, output
_PER_RANK = frozenset({"version", "command", "model", "weights", "calib", "out", "device", "force", "quiet"})
_ABOUT_RANKS = re.compile(r"\branks?\b")


def _timeout() -> timedelta:
    text = os.environ.get("QUANTKIT_DIST_TIMEOUT", str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise UsageError(f"QUANTKIT_DIST_TIMEOUT={text!r} must be a positive number of seconds")
    return timedelta(seconds=seconds)


@dataclass(frozen=True)
class _Launch:
    rank: int
    world: int
    local_rank: int
    backend: str
    recipe: dict = field(default_factory=dict)  # the flags every rank must share


_LAUNCH: _Launch | None = None  # set within torchrun_group


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise UsageError(f"{name}={os.environ[name]!r} is not an integer; launch with torchrun") from None


def _recipe_flags(args) -> dict:
    """The command line as the ranks must share it (flag → JSON value)."""
    out = {}
    for name, value in sorted(vars(args).items()):
        if name in _PER_RANK:
            continue
        if isinstance(value, tuple):
            value = list(value)
        if not (value is None or isinstance(value, (bool, int, float, str, list))):
            value = repr(value)
        out["--" + name.replace("_", "-")] = value
    model = getattr(args, "model", None)
    if isinstance(model, str) and is_factory_name(model):  # a factory is code, not a path: same name
        out["MODEL"] = model
    return out


@contextlib.contextmanager
def torchrun_group(args):
    """Within: this process is one rank of a torchrun launch (more than one process); ranks other
    than 0 are made quiet. The process group itself is created by :func:`calibrate`, when the
    ranks first need each other, so that the whole-data passes before it (SmoothQuant, recipe
    search) run on each rank alone; it is destroyed on the way out. An error leaving it reaches
    the other ranks (see the module docstring) and names this rank. Outside torchrun (or with
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
                      backend="nccl" if cuda else "gloo", recipe=_recipe_flags(args))
    launch = _LAUNCH
    if launch.rank != 0:
        args.quiet = True
    try:
        try:
            with timeout_hint("raise QUANTKIT_DIST_TIMEOUT (seconds)"):
                yield
        except Exception as exc:
            _leave_failed(launch, exc)
            raise
        except BaseException:  # Ctrl-C, SIGTERM: nobody waits for this rank's outcome
            if dist.is_initialized():
                _post_result(launch, "it was interrupted")
            raise
        _leave_done(launch)
    finally:
        _LAUNCH = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _name_rank(launch: _Launch, exc: BaseException) -> None:
    """Start this rank's own error line with "rank R of N:" (lines about other ranks name them already)."""
    if isinstance(exc, (ValueError, TypeError)) and len(exc.args) == 1 and isinstance(exc.args[0], str) \
            and not _ABOUT_RANKS.search(exc.args[0]):
        exc.args = (f"rank {launch.rank} of {launch.world}: {exc.args[0]}",)


def _leave_failed(launch: _Launch, exc: Exception) -> None:
    """This rank failed: make sure the other ranks learn of it, then wait (briefly) for them to
    reach their own error line, since torchrun stops every rank as soon as one exits."""
    import torch.distributed as dist

    if not getattr(exc, EXCHANGED, False):
        if not dist.is_initialized():  # before calibration: meet the others at their agreement
            mark_failed_early(launch.rank)  # ranks waiting for rank 0's latencies stop waiting
            with contextlib.suppress(Exception):
                _init(launch)
                report_failure(exc)
        else:  # after calibration: the others read this rank's outcome
            _post_result(launch, clean(exc) or type(exc).__name__)
    _name_rank(launch, exc)
    if dist.is_initialized() and not getattr(exc, PEER_LOST, False):
        _leave_together(launch)


def _leave_done(launch: _Launch) -> None:
    """This rank succeeded: rank 0 posts that it did; the others wait for rank 0's outcome."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    _post_result(launch, "")
    if launch.rank == 0:
        return
    gc.collect()  # the model and its copies are garbage by now: free them while rank 0 works
    outcome = _rank0_outcome()
    if outcome:
        err = DistributedError(f"rank 0 of {launch.world} failed after calibration ({clean(outcome)}); see its "
                               "error (it alone evaluates and writes)")
        _leave_together(launch)
        raise err


def _poll(s, keys: list[str], seconds: float, every: float) -> bool:
    """Whether every key is in store ``s`` within ``seconds``: checked every ``every`` seconds,
    never waited on (a store wait that times out writes c10d warnings to stderr, and a signal
    from torchrun is handled only once a wait returns)."""
    deadline = time.monotonic() + seconds
    while not s.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(every)
    return True


def _rank0_outcome() -> str:
    """Rank 0's posted outcome ("" for success)."""
    s, k = store(), key("result", 0)
    try:
        if not _poll(s, [k], RESULT_WAIT.total_seconds(), every=0.2):
            return f"no outcome within {RESULT_WAIT.total_seconds() / 3600:g} h"
        return s.get(k).decode("utf-8", "replace")
    except Exception:  # the store (rank 0's, outside torchrun) went with rank 0
        return "its process ended before it reported"


def _post_result(launch: _Launch, outcome: str) -> None:
    s = store()
    if s is not None:
        with contextlib.suppress(Exception):
            s.set(key("result", launch.rank), outcome)


def _leave_together(launch: _Launch) -> None:
    s = store()
    if s is None:
        return
    with contextlib.suppress(Exception):
        s.set(key("leaving", launch.rank), "1")
        _poll(s, [key("leaving", r) for r in range(launch.world)], min(LEAVE_WAIT_S, _timeout().total_seconds()),
              every=0.02)


def _agent_store(timeout: timedelta):
    """torchrun's own store (it outlives every rank), before the process group exists; None elsewhere."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timeout, wait_for_workers=False)
    except Exception:  # no agent store to reach: init_process_group's own rendezvous decides
        return None


def _not_there(ranks: list[int], world: int, seconds: float) -> DistributedError:
    who = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world}" if ranks
           else f"a rank of {world}")
    err = DistributedError(
        f"{who} did not reach calibration within {seconds:g} s (it failed or stopped before it, or is still "
        "loading); see that rank's own error or log, or raise QUANTKIT_DIST_TIMEOUT if it is only slow; every "
        "rank stops")
    setattr(err, EXCHANGED, True)
    setattr(err, PEER_LOST, True)
    return err


def _init(launch: _Launch) -> None:
    """Create the process group once every rank has arrived; the ranks that do not come within
    the timeout are named in one line."""
    import torch.distributed as dist

    if launch.backend == "nccl":
        torch.cuda.set_device(launch.local_rank)
    timeout = _timeout()
    seconds = timeout.total_seconds()
    agent = _agent_store(timeout)
    if agent is not None:  # arrive, then wait for the others ourselves: we can name who is missing
        agent.set(key("arrived", launch.rank), "1")
        arrived = [key("arrived", r) for r in range(launch.world)]
        if not _poll(agent, arrived, seconds, every=0.1):
            missing = [r for r in range(launch.world) if not agent.check([arrived[r]])]
            raise _not_there(missing, launch.world, seconds)
    try:
        dist.init_process_group(launch.backend, timeout=timeout)
    except RuntimeError as exc:  # DistStoreError "wait timeout ...": a rank never came
        if not re.search(r"time[d ]?\s*out", str(exc), re.I):
            raise
        raise _not_there([1 - launch.rank] if launch.world == 2 else [], launch.world, seconds) from None


def calibrate(prepared, batches: list, *, progress: bool):
    """``quantkit.calibrate`` on this rank's contiguous share of ``batches`` with the exact observer
    reduction under torchrun (the process group is created here, and the ranks first agree on
    their recipe, model and data); on one process, on all of them."""
    import quantkit

    if _LAUNCH is None:
        return quantkit.calibrate(prepared, batches, progress=progress, distributed=False)
    import torch.distributed as dist

    _init(_LAUNCH)
    mine = quantkit.shard(batches, dist.get_rank(), dist.get_world_size())
    with agreement_record({"recipe": _LAUNCH.recipe}):
        return quantkit.calibrate(prepared, mine, progress=progress, distributed=True)


def is_main() -> bool:
    """Whether this process evaluates, writes and prints (rank 0, or not under torchrun)."""
    return _LAUNCH is None or _LAUNCH.rank == 0


def rank_device(device: torch.device) -> torch.device:
    """``cuda`` without an index means this rank's GPU (``LOCAL_RANK``) under torchrun."""
    if device.type == "cuda" and device.index is None and _LAUNCH is not None:
        return torch.device("cuda", _LAUNCH.local_rank)
    return device
