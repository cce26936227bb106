"""``quantkit.observers.sync``: reduce every observer's statistics across processes, exactly.

Each observer exposes its state as tensors with a declared reduction:

- min/max observers (quantkit's and torchao's ``MinMaxObserver``/``PerChannelMinMaxObserver``,
  and any observer with ``min_val``/``max_val`` buffers only): all-reduce MIN and MAX;
- power-of-two histograms (``HistogramObserver``: KL, MSE, L2, percentile): the ranks first
  agree on the grid (MIN of minima, MAX of maxima and of bin exponents), each moves its counts
  onto it locally (exact: whole bins merge), then the counts are SUMmed;
- per-channel histograms (``PerChannelMSEObserver``): per-channel ranges MIN/MAX, rows whose
  range grew are rebinned (exact where the range is unchanged, e.g. weights), counts SUMmed;
- moving averages: the ranks' batch minima/maxima (:class:`._history.BatchHistory`) are
  concatenated in rank order and every rank replays the average over them, so the result is
  bit-identical to one process averaging rank 0's batches, then rank 1's, and so on (with
  :func:`quantkit.shard`'s contiguous split of a list: the original order);
- declared: an observer with ``sync_ops = {"buffer": "min"|"max"|"sum"|"cat", ...}`` has those
  buffers reduced so (e.g. a Hessian ``X^T X`` and its row count: ``"sum"``); ``"cat"``
  concatenates the ranks' ``[n_rank, ...]`` buffers along dim 0 in rank order (sampled rows,
  per-batch statistics to replay), bit for bit;
- observers without statistics (placeholder, fixed, derived) are left alone.

Anything else (torchao's moving-average and histogram observers, whose states have no exact
reduction) is refused in one line naming it. Tensors with the same reduction and dtype go
into one flat buffer: a sync makes a fixed handful of collectives (observer check, shapes,
MIN/MAX per dtype, SUM per dtype, and MAX per dtype for ``cat`` buffers), not one per observer.
:func:`sync_observers` does the same for observers outside a graph (GPTQ's Hessians).

A second sync after more calibration adds only the new data: ranks other than 0 subtract
what the previous sync already summed (histograms and declared sums) or replayed (moving
averages), or send only the rows after it (``cat``).
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict

import torch

from quantkit._graph import is_observer_module

from . import _histsearch as hs
from ._base import QuantkitObserver
from ._collective import EXCHANGED, collective, comm_device as _comm_device
from ._histogram import _bin_exponent, _regrid
from ._history import BatchHistory

__all__ = ["sync", "sync_observers", "abandon", "MIN", "MAX", "SUM", "CAT", "EXCHANGED"]

MIN, MAX, SUM, CAT = "min", "max", "sum", "cat"
_NONE = -(1 << 62)  # "no value" in MAX-reduced int64 vectors (no rank holds anything smaller)
_MAXDIM = 4  # dimensions of a statistic whose shape ranks agree on
_STATELESS = {"eps", "scale", "zero_point"}  # buffers that are configuration, not statistics


def _dist():
    import torch.distributed as dist

    return dist


class _Sync:
    """How one observer's state is reduced; see the module docstring for the phases."""

    def __init__(self, obs: torch.nn.Module, name: str, rank: int, world: int) -> None:
        self.obs, self.name, self.rank, self.world = obs, name, rank, world
        self.shapes_agreed: list[tuple[int, ...] | None] = []
        self.rank_counts: list[list[int]] = []

    kind = "base"

    def check(self) -> None:
        """Local checks that must pass before any collective."""

    def shapes(self) -> list[tuple[int, ...] | None]:
        """Shapes of statistics whose size the ranks must agree on (None: none seen here)."""
        return []

    def counts(self) -> list[int]:
        """Per-rank counts every rank must learn (how many runs each rank contributes)."""
        return []

    def agree(self) -> list[tuple[str, torch.Tensor]]:
        return []

    def adopt(self, values: list[torch.Tensor]) -> None:
        pass

    def state(self) -> list[tuple[str, torch.Tensor]]:
        return []

    def load(self, values: list[torch.Tensor]) -> None:
        pass


def _fill(shape, value, like: torch.Tensor) -> torch.Tensor:
    return torch.full(shape, value, dtype=like.dtype, device=like.device)


def _range_entries(obs, shape) -> list[tuple[str, torch.Tensor]]:
    """``min_val`` (MIN) and ``max_val`` (MAX) of ``shape``; a rank that saw nothing sends +-inf."""
    if shape is None:
        return []
    mn, mx = obs.min_val, obs.max_val
    if mn.numel() == 0:
        mn, mx = _fill(shape, math.inf, mn), _fill(shape, -math.inf, mx)
    return [(MIN, mn), (MAX, mx)]


class _MinMax(_Sync):
    kind = "minmax"

    def shapes(self):
        return [None if self.obs.min_val.numel() == 0 else tuple(self.obs.min_val.shape)]

    def agree(self):
        return _range_entries(self.obs, self.shapes_agreed[0])

    def adopt(self, values):
        if values:
            self.obs.min_val.resize_(values[0].shape).copy_(values[0])
            self.obs.max_val.resize_(values[1].shape).copy_(values[1])


class _MovingAverage(_Sync):
    kind = "moving-average"

    def _mine(self) -> list[list]:
        h = self.obs.batch_history
        return h.runs if self.rank == 0 else h.after(h.synced)

    def check(self):
        if self.obs.batch_history.batches != int(self.obs.num_batches):
            raise ValueError(
                f"moving-average observer '{self.name}' has {int(self.obs.num_batches)} batches but a history of "
                f"{self.obs.batch_history.batches} (loaded from a state dict, or merged?); calibrate it afresh "
                "before syncing")

    def shapes(self):
        mn = self.obs.min_val
        return [None if mn.numel() == 0 else tuple(mn.shape)]

    def counts(self):
        return [len(self._mine())]

    def state(self):
        shape, counts = self.shapes_agreed[0], self.rank_counts[0]
        total = sum(counts)
        if shape is None or total == 0:
            return []
        first = sum(counts[:self.rank])
        stats = torch.zeros((total, 2) + shape, dtype=self.obs.min_val.dtype, device=self.obs.min_val.device)
        reps = torch.zeros(total, dtype=torch.int64)
        for i, (mn, mx, n) in enumerate(self._mine()):
            stats[first + i, 0] = mn
            stats[first + i, 1] = mx
            reps[first + i] = n
        return [(SUM, stats), (SUM, reps)]

    def load(self, values):
        if not values:
            return
        stats, reps = values
        runs = [[stats[i, 0], stats[i, 1], int(reps[i])] for i in range(stats.shape[0])]
        obs = self.obs
        obs.num_batches.zero_()
        if obs.min_val.dim() == 1:  # per channel: empty buffers say "no batch yet"
            obs.min_val.resize_(0)
            obs.max_val.resize_(0)
        for mn, mx, n in runs:  # the same updates, in the same order, as one process
            for _ in range(n):
                obs._average(mn, mx)
        obs.batch_history.reset(runs)


class _Pow2Histogram(_Sync):
    kind = "pow2-histogram"

    def shapes(self):
        return [tuple(self.obs.histogram.shape)]

    def agree(self):
        obs = self.obs
        exp = int(obs.bin_exp) if obs.calibrated else _NONE
        return [(MIN, obs.min_val), (MAX, obs.max_val), (MAX, torch.tensor(exp, dtype=torch.int64))]

    def adopt(self, values):
        obs = self.obs
        lo, hi, at_least = float(values[0]), float(values[1]), int(values[2])
        self.grid = None
        if not lo <= hi:  # no rank has seen data
            return
        size = obs.histogram.shape[0]
        exp = _bin_exponent(lo, hi, size, at_least=at_least)
        start = math.floor(lo * 2.0 ** -exp)
        if obs.calibrated:
            hist = _regrid(obs.histogram, int(obs.bin_exp), int(obs.bin_start), exp, start)
        else:
            hist = torch.zeros(size, dtype=torch.float64, device=obs.histogram.device)
        base = getattr(obs, "_synced_counts", None) if self.rank else None
        if base is not None:  # counted by the previous sync already (on rank 0)
            hist = hist - _regrid(base[0].to(hist.device), base[1], base[2], exp, start, size)
        obs.histogram = hist
        obs.bin_exp.fill_(exp)
        obs.bin_start.fill_(start)
        obs.min_val.fill_(lo)
        obs.max_val.fill_(hi)
        self.grid = (exp, start)

    def state(self):
        return [] if self.grid is None else [(SUM, self.obs.histogram)]

    def load(self, values):
        if values:
            self.obs.histogram = values[0]
            if self.rank:
                self.obs._synced_counts = (values[0].clone(), *self.grid)


class _ChannelHistogram(_MinMax):
    """Per-channel ranges as :class:`_MinMax`, then the rows' counts moved onto them and summed."""

    kind = "channel-histogram"

    def adopt(self, values):
        obs = self.obs
        if not values:
            return
        lo, hi = values

        def onto(hist, mn, mx):
            moved = (mn != lo) | (mx != hi)
            if not bool(moved.any()):
                return hist
            rebinned = hs.rebin(hist, mn.double(), mx.double(), lo.double(), hi.double())
            return torch.where(moved[:, None], rebinned, hist)

        if obs.min_val.numel():
            hist = onto(obs.histogram, obs.min_val, obs.max_val)
        else:
            hist = torch.zeros(lo.shape[0], obs.bins, dtype=torch.float64, device=lo.device)
        base = getattr(obs, "_synced_counts", None) if self.rank else None
        if base is not None:
            hist = hist - onto(*base)
        obs._set(lo, hi)
        obs.histogram = hist

    def state(self):
        return [] if self.shapes_agreed[0] is None else [(SUM, self.obs.histogram)]

    def load(self, values):
        if values:
            self.obs.histogram = values[0]
            if self.rank:
                self.obs._synced_counts = (values[0].clone(), self.obs.min_val.clone(), self.obs.max_val.clone())


_IDENTITY = {MIN: math.inf, MAX: -math.inf, SUM: 0, CAT: None}


def _lowest(dtype: torch.dtype):
    """The identity of MAX in ``dtype``: ``cat`` buffers are padded with it (MAX keeps every
    bit of the other rank's value, -0.0 included, where a SUM with 0 would not)."""
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


class _Declared(_Sync):
    """Buffers reduced as the observer's ``sync_ops`` says."""

    kind = "declared"

    def check(self):
        for name, op in self.obs.sync_ops.items():
            if op not in _IDENTITY or not isinstance(getattr(self.obs, name, None), torch.Tensor):
                raise ValueError(f"observer '{self.name}' declares sync_ops[{name!r}] = {op!r}; each entry must "
                                 f"name a tensor buffer and one of {sorted(_IDENTITY)}")

    def _items(self, ops):
        return [(n, op) for n, op in self.obs.sync_ops.items() if op in ops]

    def shapes(self):
        # a cat buffer: the ranks agree on its trailing dimensions only
        return [None if getattr(self.obs, n).numel() == 0
                else tuple(getattr(self.obs, n).shape)[1 if op == CAT else 0:]
                for n, op in self.obs.sync_ops.items()]

    def _cats(self) -> list[str]:
        return [n for n, op in self.obs.sync_ops.items() if op == CAT]

    def _mine(self, name) -> torch.Tensor:
        """This rank's rows of a cat buffer: all on rank 0, those after the last sync elsewhere."""
        t = getattr(self.obs, name)
        return t[getattr(self.obs, "_synced_rows", {}).get(name, 0) if self.rank else 0:]

    def counts(self):
        return [self._mine(n).shape[0] if self._mine(n).numel() else 0 for n in self._cats()]

    def _value(self, i, name, op):
        t, shape = getattr(self.obs, name), self.shapes_agreed[i]
        if op == CAT:  # [total, ...]: this rank's rows at its offset, MAX's identity elsewhere
            counts = self.rank_counts[self._cats().index(name)]
            out = _fill((sum(counts),) + shape, _lowest(t.dtype), t)
            mine, first = self._mine(name), sum(counts[:self.rank])
            out[first:first + counts[self.rank]] = mine.reshape((counts[self.rank],) + shape)
            return out
        return t if t.numel() or shape is None else _fill(shape, _IDENTITY[op], t)

    def _entries(self, ops):
        out, self._names = [], []
        for i, (name, op) in enumerate(self.obs.sync_ops.items()):
            if op in ops and self.shapes_agreed[i] is not None:
                value = self._value(i, name, op)
                if op == CAT:
                    out.append((MAX, value))
                    self._names.append(name)
                    continue
                base = getattr(self.obs, "_synced_counts", {}).get(name) if (op == SUM and self.rank) else None
                if base is not None:
                    value = value - base.to(value.device)
                out.append((op, value))
                self._names.append(name)
        return out

    def _set(self, values):
        for name, v in zip(self._names, values):
            setattr(self.obs, name, v.to(getattr(self.obs, name).device))

    def agree(self):
        return self._entries((MIN, MAX))

    def adopt(self, values):
        self._set(values)

    def state(self):
        return self._entries((SUM, CAT))

    def load(self, values):
        self._set(values)
        if self.rank:
            ops = self.obs.sync_ops
            base = getattr(self.obs, "_synced_counts", {})
            base.update({n: v.clone() for n, v in zip(self._names, values) if ops[n] == SUM})
            self.obs._synced_counts = base
            rows = getattr(self.obs, "_synced_rows", {})
            rows.update({n: v.shape[0] for n, v in zip(self._names, values) if ops[n] == CAT})
            self.obs._synced_rows = rows


def _adapter(obs: torch.nn.Module, name: str, rank: int, world: int) -> _Sync | None:
    """The reduction ``obs`` declares (by attributes), None for an observer without statistics."""
    has = lambda *attrs: all(isinstance(getattr(obs, a, None), torch.Tensor) for a in attrs)  # noqa: E731
    if isinstance(getattr(obs, "sync_ops", None), dict):
        return _Declared(obs, name, rank, world)
    if has("histogram", "bin_exp", "bin_start", "min_val", "max_val"):
        return _Pow2Histogram(obs, name, rank, world)
    if hasattr(obs, "averaging_constant"):
        if isinstance(getattr(obs, "batch_history", None), BatchHistory) and hasattr(obs, "_average"):
            return _MovingAverage(obs, name, rank, world)
        why = "its moving average keeps no batch history to replay"
    elif has("histogram"):
        if isinstance(obs, QuantkitObserver) and obs.histogram.dim() == 2 and has("min_val", "max_val"):
            return _ChannelHistogram(obs, name, rank, world)
        why = "its histogram has no exactly mergeable grid"
    elif has("min_val", "max_val"):
        return _MinMax(obs, name, rank, world)
    elif not list(obs.parameters()) and not [b for b, _ in obs.named_buffers() if b not in _STATELESS]:
        return None  # placeholder, fixed or derived qparams: nothing observed
    else:
        why = "it declares no exact reduction (sync_ops)"
    raise ValueError(
        f"cannot sync the {type(obs).__name__} at '{name}' across processes: {why}; use a quantkit observer "
        "(minmax, moving_average_minmax, per_channel_minmax, kl, mse, l2, percentile) or calibrate on one process")


def _observers(prepared: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    out = []
    for name, m in prepared.named_modules():
        if not is_observer_module(m):
            continue
        if isinstance(getattr(m, "activation_post_process", None), torch.nn.Module):
            continue  # a fake-quantize module: its observer (a submodule) is synced itself
        out.append((name, m))
    return out


def _allreduce(entries: list[list[tuple[str, torch.Tensor]]], device, group) -> list[list[torch.Tensor]]:
    """All-reduce every tensor in ``entries`` (per observer, ``(op, tensor)`` pairs): one flat
    buffer, one collective, per (op, dtype); returns the reduced tensors in the same structure."""
    dist = _dist()
    buckets: OrderedDict = OrderedDict()
    for i, items in enumerate(entries):
        for j, (op, t) in enumerate(items):
            buckets.setdefault((op, str(t.dtype)), []).append((i, j, t))
    out = [[None] * len(items) for items in entries]
    ops = {MIN: dist.ReduceOp.MIN, MAX: dist.ReduceOp.MAX, SUM: dist.ReduceOp.SUM}
    for key in sorted(buckets):  # the same order on every rank
        members = buckets[key]
        flat = torch.cat([t.detach().reshape(-1).to(device) for _, _, t in members])
        with collective("the observer sync", group):
            dist.all_reduce(flat, op=ops[key[0]], group=group)
        at = 0
        for i, j, t in members:
            out[i][j] = flat[at:at + t.numel()].reshape(t.shape).to(t.device)
            at += t.numel()
    return out


def _encode_shape(shape) -> list[int]:
    """``[ndim, d0.., -ndim, -d0..]`` (MAX-reduced: max and -min of each); unknown shapes take no part."""
    if shape is None:
        return [_NONE] * (2 * (_MAXDIM + 1))
    if len(shape) > _MAXDIM:
        raise ValueError(f"statistics of more than {_MAXDIM} dimensions cannot be synced, got shape {shape}")
    v = [len(shape)] + list(shape) + [0] * (_MAXDIM - len(shape))
    return v + [-x for x in v]


def sync(prepared: torch.nn.Module, group=None) -> torch.nn.Module:
    """Reduce the statistics of every observer in ``prepared`` across the processes of
    ``group``, so that every rank holds the observers one process would have after seeing
    all ranks' data (see the module docstring for each kind). Works in place.

    For custom calibration loops (DDP, FSDP): observe this rank's batches, then call
    ``sync`` on every rank. :func:`quantkit.calibrate` calls it itself when
    ``torch.distributed`` is initialised. Does nothing when it is not, or on one process.

    Args:
        prepared: a prepared model (``quantkit.prepare`` or torchao's ``prepare_pt2e``).
        group: the process group (default: the world).

    Returns:
        ``prepared``.

    Raises:
        ValueError: an observer that cannot be reduced exactly (named), or ranks holding
            different prepared models.

    Example:
        >>> for batch in quantkit.shard(batches): prepared(batch)
        >>> quantkit.observers.sync(prepared)
    """
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return prepared
    sync_observers(_observers(prepared), group)
    return prepared


def sync_observers(observers, group=None) -> None:
    """:func:`sync` for observers outside a prepared graph, e.g. the Hessian observers GPTQ
    taps for one block, or statistics modules that declare ``sync_ops``. Works in place.

    Args:
        observers: modules, or ``(name, module)`` pairs (names appear in errors); every rank
            passes the same kinds in the same order.
        group: the process group (default: the world).
    """
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    named = [o if isinstance(o, tuple) else (getattr(o, "node_name", None) or f"observer {i}", o)
             for i, o in enumerate(observers)]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = _comm_device(group)
    error = None
    syncs: list[_Sync] = []
    try:
        for name, obs in named:
            s = _adapter(obs, name, rank, world)
            if s is not None:
                s.check()
                syncs.append(s)
    except ValueError as exc:
        error = exc
    # every rank: the same observers, in the same order, and nobody failed
    sig = zlib.crc32(";".join(f"{s.name}:{s.kind}" for s in syncs).encode())
    check = torch.tensor([error is not None, len(syncs), sig, -len(syncs), -sig], dtype=torch.int64, device=device)
    with collective("the observer sync", group):
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    try:
        _reduce(syncs, check, error, rank, world, device, group)
    except Exception as exc:  # every rank raises here too: nobody is left waiting in this sync
        setattr(exc, EXCHANGED, True)
        raise


def abandon(group=None) -> None:
    """For a rank whose own pass failed while the other ranks went on to :func:`sync_observers`:
    join their first collective with the error flag set, so that they raise ("observer sync
    failed on another rank") instead of waiting for it."""
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    check = torch.tensor([1, 0, 0, 0, 0], dtype=torch.int64, device=_comm_device(group))
    with collective("the observer sync", group):
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)


def _reduce(syncs: list[_Sync], check: torch.Tensor, error, rank: int, world: int, device, group) -> None:
    """The rest of :func:`sync_observers`, after the check collective."""
    dist = _dist()
    if error is not None:
        raise error
    if int(check[0]):
        raise ValueError("observer sync failed on another rank (see its error)")
    if int(check[1]) != -int(check[3]) or int(check[2]) != -int(check[4]):
        raise ValueError("ranks hold different prepared models (observers differ); prepare the same model "
                         "with the same quantizer on every rank")
    # shapes of statistics and per-rank counts: one MAX collective
    layout: list[int] = []
    for s in syncs:
        for shape in s.shapes():
            layout += _encode_shape(shape)
        for c in s.counts():
            slots = [_NONE] * world
            slots[rank] = c
            layout += slots
    if layout:
        agreed = torch.tensor(layout, dtype=torch.int64, device=device)
        with collective("the observer sync", group):
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        values = agreed.tolist()
        at, n = 0, _MAXDIM + 1
        for s in syncs:
            for _ in s.shapes():
                hi, neg_lo = values[at:at + n], values[at + n:at + 2 * n]
                at += 2 * n
                if hi[0] == _NONE:
                    s.shapes_agreed.append(None)
                    continue
                if hi != [-v for v in neg_lo]:
                    raise ValueError(f"observer '{s.name}' saw statistics of different shapes on different ranks; "
                                     "every rank must calibrate the same model")
                s.shapes_agreed.append(tuple(hi[1:1 + hi[0]]))
            for _ in s.counts():
                s.rank_counts.append([max(v, 0) for v in values[at:at + world]])
                at += world
    # phase 1: ranges and grids (MIN/MAX); phase 2: counts and histories (SUM)
    for s, vals in zip(syncs, _allreduce([s.agree() for s in syncs], device, group)):
        s.adopt(vals)
    for s, vals in zip(syncs, _allreduce([s.state() for s in syncs], device, group)):
        s.load(vals)
