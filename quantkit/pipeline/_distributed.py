"""Distributed calibration: each rank observes its shard, then the observers are reduced.

``quantkit.calibrate(prepared, data, distributed="auto")`` runs this rank's batches, then
(when ``torch.distributed`` is initialised with more than one process) exchanges an error
flag and the batch counts, and calls :func:`quantkit.observers.sync`. The flag comes first
so that a rank whose calibration raised (NaN in its shard, a bad batch) makes every rank
fail, instead of leaving the others waiting in the observer reduction.

Before any of that, :func:`agree` checks that the ranks may be merged at all: every rank
sends a record (one exchange of bytes, no pickle) of the torch and quantkit versions, the
prepared model (a digest of its graph code, each observer's class and configuration, a
SHA-256 of every weight tensor) and its data plan, and every rank compares every record
with rank 0's. The ranks legitimately calibrate on different batches, so "the same data"
means the same plan: a shard made by :func:`quantkit.shard` remembers the whole data set
it was cut from (a SHA-256 per batch, for lists and tuples), its rank and world size, and
the ranks must hold the same whole data set and each take its own shard. Data that
``shard`` did not cut is not compared (there is nothing to compare it with). The first
difference fails every rank with one line naming the rank and what differs. A rank that
failed before calibration joins this exchange with its error instead
(:func:`report_failure`), so that every rank stops with a line of its own.

``quantkit.shard`` splits the calibration batches between ranks.

Before the process group exists (the CLI creates it at calibration), a torchrun launch still has
torchrun's own store: :func:`rank0_value` hands rank 0's value of something measured (a latency
autotune chooses by) to every rank through it, so that a choice that depends on timings is made
once, on rank 0, and every rank -- and one process with the same cache -- makes the same one.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import itertools
import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from typing import Any, Callable

import torch
from torch.fx import GraphModule

from quantkit.observers._collective import EXCHANGED, clean, collective, comm_device, exchange, key, store

from .._errors import CalibrationError, DistributedError
from .._graph import get_attr, is_observer_module

__all__ = ["shard", "use_distributed", "calibrate_synced", "on_all_ranks", "agree", "agreement_record",
           "report_failure", "launched_world", "launch_store", "rank0_value", "mark_failed_early", "RANK0_TIMEOUT_S"]

AGREEMENT = "the agreement before calibration"  # the stage's name in errors


def _initialised() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


# --- rank 0's measurements, before the process group exists -----------------------------------

# seconds a rank waits for rank 0's value: rank 0 reaches it at about the same point (same search,
# same data), so only a rank 0 that is stuck or gone makes this run out (QUANTKIT_DIST_TIMEOUT wins)
RANK0_TIMEOUT_S = 600.0
_ASKED: dict[str, int] = {}  # name -> how many times this process asked (keys are per asking)
_AGENT: list = []  # torchrun's agent store client, made once


def launched_world() -> int:
    """How many processes this one was launched with (torchrun's ``WORLD_SIZE``; 1 outside a launch)."""
    if _initialised():
        import torch.distributed as dist

        return dist.get_world_size()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _launched_rank() -> int:
    if _initialised():
        import torch.distributed as dist

        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _wait_s() -> float:
    try:
        seconds = float(os.environ.get("QUANTKIT_DIST_TIMEOUT", RANK0_TIMEOUT_S))
    except ValueError:
        seconds = RANK0_TIMEOUT_S
    return seconds if 0 < seconds < float("inf") else RANK0_TIMEOUT_S


def launch_store():
    """The process group's store, or before there is one torchrun's agent store (it outlives every
    rank); None outside torchrun or where neither can be reached."""
    if _initialised():
        return store()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if not _AGENT:
        import datetime

        import torch.distributed as dist

        try:
            _AGENT.append(dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                        timeout=datetime.timedelta(seconds=_wait_s()), wait_for_workers=False))
        except Exception:  # no agent store to reach
            _AGENT.append(None)
    return _AGENT[0]


def mark_failed_early(rank: int) -> None:
    """Tell the ranks waiting in :func:`rank0_value` that ``rank`` failed before calibration."""
    s = launch_store()
    if s is not None:
        with contextlib.suppress(Exception):
            s.set(key("failed-early", rank), "1")


def rank0_value(name: str, compute: Callable[[], float]) -> float:
    """``compute()`` on rank 0 of a launch of several processes, and rank 0's value on the others.

    The ranks must ask for the same names in the same order (they run the same search on the same
    data); the n-th request for a name on one rank gets rank 0's n-th value for it. Outside a
    launch, or without a store to share it through, each process computes its own.

    Raises:
        DistributedError: on a rank other than 0, when rank 0 failed before sending the value or
            sent nothing within ``QUANTKIT_DIST_TIMEOUT`` seconds.
    """
    world = launched_world()
    s = launch_store() if world > 1 else None
    if s is None:
        return compute()
    n = _ASKED.get(name, 0)
    _ASKED[name] = n + 1
    k = key("rank0", hashlib.sha256(name.encode()).hexdigest()[:32], n)
    rank = _launched_rank()
    if rank == 0:
        value = float(compute())
        s.set(k, json.dumps(value))
        return value
    failed = key("failed-early", 0)
    deadline = time.monotonic() + _wait_s()
    # polled, not waited on: a store wait that times out writes c10d warnings to stderr
    while not s.check([k]):
        if s.check([failed]):
            raise DistributedError(f"rank 0 of {world} failed before calibration; see its error; every rank stops")
        if time.monotonic() >= deadline:
            raise DistributedError(f"rank 0 of {world} sent no latency within {_wait_s():g} s (it is stuck or "
                                   "gone); raise QUANTKIT_DIST_TIMEOUT if it is only slow; every rank stops")
        time.sleep(0.01)
    value = json.loads(s.get(k).decode("utf-8"))
    if type(value) not in (int, float):
        raise DistributedError(f"rank 0 of {world} sent a latency that is not a number")
    return float(value)


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


def calibrate_synced(prepared: torch.nn.Module, run: Callable[[], int], data: Any = None) -> int:
    """Check that the ranks agree (:func:`agree`), run this rank's calibration (``run()``
    returns its batch count), exchange failure flags and counts, then sync the observers;
    returns the batch count over all ranks.

    Args:
        prepared: the prepared model (its weights, graph and observers are compared).
        run: this rank's pass over its shard.
        data: the shard ``run`` calibrates on (its plan is compared when :func:`shard` made it).

    Raises:
        the rank's own error where it failed; CalibrationError naming the failed rank elsewhere;
        DistributedError where the ranks disagree, or a rank failed before or stopped.
    """
    from quantkit.observers._sync import sync

    agree(prepared, data)
    return on_all_ranks(run, lambda: sync(prepared))


def on_all_ranks(run: Callable[[], int], then: Callable[[], Any] | None = None) -> int:
    """Run this rank's pass over its shard (``run()`` returns its batch count), exchange
    failure flags and counts (one collective), then call ``then()`` (the statistics' sync);
    returns the batch count over all ranks.

    Every rank makes the same collectives in the same order whatever fails: each pass of a
    multi-pass calibration (AWQ, the calibration pass, each GPTQ block) goes through this, so
    a rank that fails in one pass stops every rank at that pass's exchange. An error that every
    rank already learnt of together inside ``run()`` (a nested pass's exchange) is raised at
    once: the rank that failed first made one exchange for it, not two.

    Raises:
        the rank's own error where it failed; CalibrationError naming the failed rank elsewhere.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    error, seen = None, 0
    try:
        seen = run()
    except Exception as exc:  # every rank must learn of it before anyone enters the reduction
        if getattr(exc, EXCHANGED, False):
            raise
        error = exc
    flags = torch.zeros(world, 2, dtype=torch.int64)
    flags[rank, 0], flags[rank, 1] = int(error is not None), seen
    flags = flags.to(comm_device(None))
    with collective("the exchange after a calibration pass"):
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


# --- the agreement before calibration ----------------------------------------------------------

_EXTRA: list[dict] = [{}]  # sections agree() also compares (the CLI's recipe flags), within agreement_record
# observer attributes that are configuration (compared), not statistics (which differ by rank)
_OBSERVER_CONFIG = ("dtype", "qscheme", "quant_min", "quant_max", "ch_axis", "is_dynamic", "reduce_range", "method",
                    "bins", "averaging_constant", "group_size", "percentile", "symmetric", "granularity",
                    "target_dtype", "mapping_type", "block_size", "eps")


@contextlib.contextmanager
def agreement_record(extra: dict[str, dict]):
    """Within: :func:`agree` also compares ``extra`` (``{section: {field: JSON value}}``), e.g.
    ``{"recipe": {"--observer": "mse"}}``: the first differing field is named in the error."""
    before = _EXTRA[0]
    _EXTRA[0] = {**before, **extra}
    try:
        yield
    finally:
        _EXTRA[0] = before


def _versions() -> dict[str, str]:
    try:
        quantkit = metadata.version("quantkit")
    except metadata.PackageNotFoundError:  # a source tree on sys.path
        quantkit = "unknown"
    return {"torch": torch.__version__, "quantkit": quantkit}


def _tensor_digest(t: torch.Tensor) -> str:
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    t = t.detach()
    try:
        flat = t.cpu().contiguous().reshape(-1).view(torch.uint8)
        h.update(memoryview(flat.numpy()))
    except (RuntimeError, TypeError, NotImplementedError):  # no raw bytes (quantized, sparse): the values
        h.update(repr(t.cpu().tolist()).encode())
    return h.hexdigest()


def _digests(named: list[tuple[str, torch.Tensor]]) -> list[list[str]]:
    # hashlib drops the GIL on large buffers: tensors hash in parallel
    with ThreadPoolExecutor(max_workers=max(1, min(8, torch.get_num_threads()))) as pool:
        return [[n, d] for n, d in zip([n for n, _ in named], pool.map(_tensor_digest, [t for _, t in named]))]


def _weights(prepared: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's own tensors (parameters, buffers, constants), observers' state left out."""
    out, seen, observers = [], set(), []
    for name, m in prepared.named_modules():
        if observers and name.startswith(tuple(observers)):
            continue
        if name and is_observer_module(m):
            observers.append(name + ".")
            continue
        for n, t in itertools.chain(m._parameters.items(), m._buffers.items()):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                out.append((f"{name}.{n}" if name else n, t))
    if isinstance(prepared, GraphModule):
        for node in prepared.graph.nodes:
            if node.op == "get_attr":
                t = get_attr(prepared, str(node.target))
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    out.append((str(node.target), t))
    return out


def _config_value(v) -> str | None:
    if isinstance(v, torch.Tensor):
        return repr(v.tolist()) if v.numel() <= 16 else None
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.qscheme, enum.Enum)):
        return repr(v)
    if isinstance(v, (tuple, list)) and all(isinstance(x, (bool, int, float, str)) for x in v):
        return repr(tuple(v))
    return None


def _observers(prepared: torch.nn.Module) -> list[list[str]]:
    out = []
    for name, m in prepared.named_modules():
        if name and is_observer_module(m):
            values = [(a, _config_value(getattr(m, a))) for a in _OBSERVER_CONFIG if hasattr(m, a)]
            config = [f"{a}={v}" for a, v in values if v is not None]
            out.append([name, f"{type(m).__name__}({'; '.join(config)})"])
    return out


def _batch_digest(batch) -> str:
    h = hashlib.sha256()

    def feed(x) -> None:
        if isinstance(x, torch.Tensor):
            h.update(_tensor_digest(x).encode())
        elif isinstance(x, Mapping):
            h.update(b"{")
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                feed(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(f"[{len(x)}".encode())
            for item in x:
                feed(item)
            h.update(b"]")
        elif x is None or isinstance(x, (bool, int, float, str, bytes)):
            h.update(repr(x).encode())
        else:  # another object: its type alone (its repr may hold a per-process address)
            h.update(f"<{type(x).__module__}.{type(x).__qualname__}>".encode())

    feed(batch)
    return h.hexdigest()


class _Plan:
    """What a :func:`shard` result was cut from: the whole data set, its length, rank and world."""

    def __init__(self, source, n: int, rank: int, world: int) -> None:
        self.source, self.n, self.rank, self.world = source, n, rank, world

    def record(self) -> dict:
        digests = [_batch_digest(b) for b in self.source] if isinstance(self.source, (list, tuple)) else None
        return {"rank": self.rank, "world": self.world, "batches": self.n, "digests": digests}


class _ShardList(list):
    """A list of this rank's batches that remembers its :class:`_Plan` (pickled as a plain list)."""

    quantkit_plan: _Plan | None = None

    def __reduce__(self):
        return (list, (list(self),))


class _ShardTuple(tuple):
    quantkit_plan: _Plan | None = None

    def __reduce__(self):
        return (tuple, (tuple(self),))


def _model_record(prepared: torch.nn.Module) -> dict:
    code = prepared.code if isinstance(prepared, GraphModule) else repr(prepared)
    return {"graph": hashlib.sha256(code.encode()).hexdigest(), "observers": _observers(prepared),
            "weights": _digests(_weights(prepared))}


def _exchange(record: dict) -> list[dict]:
    blobs = exchange(json.dumps(record, sort_keys=True).encode(), stage=AGREEMENT)
    out = []
    for blob in blobs:
        try:
            rec = json.loads(blob)
        except ValueError:
            rec = None
        out.append(rec if isinstance(rec, dict) else {"failed": "its agreement record is unreadable"})
    return out


def report_failure(exc: BaseException) -> None:
    """For a rank that failed before calibration while the other ranks go on to it: join their
    agreement (:func:`agree`) with this rank's error, so that they stop with a line naming this
    rank instead of waiting for it. Every rank of the default group must be on its way there."""
    _exchange({"failed": clean(exc) or type(exc).__name__})


def agree(prepared: torch.nn.Module, data: Any = None) -> None:
    """Fail every rank, with one line naming the rank and what differs, unless all ranks run the
    same versions with the same prepared model (graph, observers, weights), the same extra
    sections (:func:`agreement_record`), and, for shards made by :func:`shard`, the same whole
    data set with each rank on its own shard. One exchange; every rank of the default group
    must call it.

    Raises:
        DistributedError: a difference, or a rank that failed before calibration.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    error = None
    try:
        plan = getattr(data, "quantkit_plan", None)
        record = {"versions": _versions(), **_EXTRA[0], "model": _model_record(prepared),
                  "data": plan.record() if isinstance(plan, _Plan) else None}
    except Exception as exc:  # the other ranks must still learn of it
        error, record = exc, {"failed": clean(exc) or type(exc).__name__}
    records = _exchange(record)
    if error is not None:
        setattr(error, EXCHANGED, True)
        raise error
    why = _disagreement(records, world)
    if why is not None:
        err = DistributedError(why)
        setattr(err, EXCHANGED, True)
        raise err


def _short(digest) -> str:
    return str(digest)[:12]


def _change(mine: str, ref: str) -> tuple[str, str]:
    """The part of two observer descriptions (``Class(attr=value; ...)``) that differs."""
    parse = lambda d: (d.split("(", 1)[0], d.split("(", 1)[1][:-1].split("; ") if "(" in d else [])  # noqa: E731
    (cls_a, attrs_a), (cls_b, attrs_b) = parse(str(mine)), parse(str(ref))
    if cls_a != cls_b:
        return cls_a, cls_b
    diff_a = [x for x in attrs_a if x not in attrs_b]
    diff_b = [x for x in attrs_b if x not in attrs_a]
    return f"{cls_a}({', '.join(diff_a)})", f"{cls_b}({', '.join(diff_b)})"


def _first_difference(mine: list, ref: list, what: str, digests: bool = False) -> str | None:
    """Named entries ``[[name, value], ...]``: the first that differs, is missing or is extra."""
    mine_d, ref_d = dict(map(tuple, mine)), dict(map(tuple, ref))
    for name, value in ref:
        if name not in mine_d:
            return f"no {what} {clean(name, 80)!r} (rank 0 has one)"
        if mine_d[name] != value:
            n = sum(1 for k, v in ref_d.items() if mine_d.get(k) != v)
            a, b = (_short(mine_d[name]), _short(value)) if digests else _change(mine_d[name], value)
            also = f"; {n} of {len(ref)} {what}s differ" if n > 1 else ""
            kind = "sha256 " if digests else ""
            return f"{clean(name, 80)} ({kind}{clean(a, 120)} vs {clean(b, 120)} on rank 0{also})"
    extra = [name for name, _ in mine if name not in ref_d]
    return f"{what} {clean(extra[0], 80)!r}, which rank 0 lacks" if extra else None


def _disagreement(records: list[dict], world: int) -> str | None:
    for r, rec in enumerate(records):
        if "failed" in rec:
            return f"rank {r} of {world} failed before calibration ({clean(rec['failed'])}); every rank stops"
    ref = records[0]
    for r in range(1, world):
        rec = records[r]
        for k in ("torch", "quantkit"):
            a, b = rec.get("versions", {}).get(k), ref.get("versions", {}).get(k)
            if a != b:
                return (f"rank {r} runs {k} {clean(a, 40)}, rank 0 runs {k} {clean(b, 40)}; install the same versions "
                        "on every rank")
        for section in sorted(set(rec) | set(ref)):
            if section in ("versions", "model", "data"):
                continue
            mine, theirs = rec.get(section) or {}, ref.get(section) or {}
            for field in sorted(set(mine) | set(theirs)):
                if mine.get(field) != theirs.get(field):
                    return (f"rank {r}'s {section} differs from rank 0's: {clean(field, 60)} "
                            f"{clean(json.dumps(mine.get(field)), 80)} vs {clean(json.dumps(theirs.get(field)), 80)}; "
                            f"run every rank with the same {section}")
        model, model0 = rec.get("model") or {}, ref.get("model") or {}
        why = _first_difference(model.get("observers", []), model0.get("observers", []), "observer")
        if why is not None:
            return (f"rank {r}'s quantization recipe differs from rank 0's: {why}; prepare the same model with the "
                    "same quantizer on every rank")
        if model.get("graph") != model0.get("graph"):
            return (f"rank {r}'s model graph differs from rank 0's (graph code {_short(model.get('graph'))} vs "
                    f"{_short(model0.get('graph'))}); capture the same model the same way on every rank")
        why = _first_difference(model.get("weights", []), model0.get("weights", []), "tensor", digests=True)
        if why is not None:
            return f"rank {r}'s model weights differ from rank 0's: {why}; load the same checkpoint on every rank"
    return _data_disagreement(records, world)


def _data_disagreement(records: list[dict], world: int) -> str | None:
    plans = [rec.get("data") for rec in records]
    for r, plan in enumerate(plans):
        if plan and (plan.get("rank"), plan.get("world")) != (r, world):
            return (f"rank {r} of {world} calibrates on shard {plan.get('rank')} of {plan.get('world')}; let "
                    "quantkit.shard(data) choose each rank's own shard")
    ref = plans[0]
    for r in range(1, world):
        plan = plans[r]
        if not (plan and ref):
            continue
        if plan.get("batches") != ref.get("batches"):
            return (f"rank {r}'s calibration data differs from rank 0's: {plan.get('batches')} batches vs "
                    f"{ref.get('batches')} on rank 0; give every rank the same data set (each calibrates on its own "
                    "shard of it)")
        mine, theirs = plan.get("digests"), ref.get("digests")
        if mine is not None and theirs is not None and mine != theirs:
            bad = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
            i = bad[0] if bad else 0
            return (f"rank {r}'s calibration data differs from rank 0's: batch {i} of {len(theirs)} (sha256 "
                    f"{_short(mine[i])} vs {_short(theirs[i])} on rank 0; {len(bad)} batches differ); give every "
                    "rank the same data set (each calibrates on its own shard of it)")
    return None


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
        part = (_ShardTuple if isinstance(data, tuple) else _ShardList)(data[start:stop])
    elif isinstance(data, Sequence) or hasattr(data, "__getitem__"):
        try:
            part = _ShardList(data[i] for i in range(start, stop))
        except (KeyError, TypeError):
            return itertools.islice(iter(data), start, stop)
    else:
        return itertools.islice(iter(data), start, stop)
    part.quantkit_plan = _Plan(data, n, rank, world)  # what agree() compares between the ranks
    return part
