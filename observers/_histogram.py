"""Histogram observers: a mergeable histogram per tensor (or per channel) and a
vectorised range search (KL entropy, expected MSE, L2 model, percentile)."""

from __future__ import annotations

import math
from enum import Enum

import torch

from quantkit._qmath import is_symmetric

from . import _fp8
from . import _histsearch as hs
from . import _rangesearch as rs
from ._base import QuantkitObserver
from ._minmax import PerChannelMinMaxObserver
from ._registry import register

__all__ = ["HistogramMethod", "HistogramObserver", "PerChannelMSEObserver"]


# elements binned per pass: temporaries stay at 2^24 * (4 + 4) bytes = 128 MiB
_COUNT_CHUNK = 1 << 24
# the KL method keeps this many bins per bin of its search (TensorRT's 2048 over [0, amax]):
# TensorRT's divergence depends on the exact counts of sparse bins, and the search's bins
# are rebuilt from these finer ones. Against TensorRT's calibration of the raw values (40
# seeds x Gaussian, Laplace, Student-t(3), 200k samples) the threshold was within 3% in
# 116 of 120 cases at 64, 113 at 32, 109 at 16 (BENCHMARKS.md, "KL fidelity").
# 1 MiB of float64 per observer at 2048 bins.
_KL_FINE = 64


def _counts(x: torch.Tensor, bins: int, exp: int, start: int) -> torch.Tensor:
    """Counts of ``x`` in the bins ``[k·2^exp, (k+1)·2^exp)``, ``k = start .. start + bins − 1``:
    one bin-index pass and a ``bincount`` (~4x faster than ``torch.histc`` on CPU). The
    index ``floor(x·2^-exp)`` is exact (a power-of-two scaling), so a value lands in the
    same bin whatever the history of the histogram."""
    flat = x.reshape(-1)
    counts = None
    inv = 2.0 ** -exp
    for begin in range(0, flat.numel(), _COUNT_CHUNK):  # bounds the temporaries on huge tensors
        part = flat[begin:begin + _COUNT_CHUNK]
        idx = torch.mul(part, inv).floor_().sub_(start).clamp_(0, bins - 1).to(torch.int32)
        c = torch.bincount(idx, minlength=bins)
        counts = c if counts is None else counts.add_(c)
    return counts


def _bin_exponent(lo: float, hi: float, bins: int, at_least: int | None = None) -> int:
    """The smallest power-of-two bin width ``2^exp`` (``exp >= at_least``) whose aligned bins
    cover ``[lo, hi]`` in at most ``bins`` bins. Widths never go below 2^-20 of the
    magnitude, so that ``x·2^-exp`` stays far inside float32 and int64."""
    span = max(hi - lo, max(abs(lo), abs(hi)) * 2.0 ** -20, 2.0 ** -100)  # 2^-exp stays a float32
    exp = math.ceil(math.log2(span / bins))
    if at_least is not None:
        exp = max(exp, at_least)
    while math.floor(hi * 2.0 ** -exp) - math.floor(lo * 2.0 ** -exp) + 1 > bins:
        exp += 1
    return exp


def _regrid(hist: torch.Tensor, exp: int, start: int, new_exp: int, new_start: int,
            size: int | None = None) -> torch.Tensor:
    """Move counts from the bins ``(exp, start)`` to ``size`` (default: as many) coarser or
    shifted bins ``(new_exp, new_start)``: every old bin lies inside one new bin (both grids
    are aligned at 0 and the new width is a multiple of the old), so counts move whole,
    exactly."""
    size = hist.shape[0] if size is None else size
    if exp == new_exp and start == new_start and size == hist.shape[0]:
        return hist
    k = torch.arange(hist.shape[0], device=hist.device, dtype=torch.float64) + start
    idx = torch.floor(k * 2.0 ** (exp - new_exp)).long() - new_start  # exact: a power-of-two scaling
    # old bins past the new grid's ends are empty (the new grid covers everything seen)
    return hist.new_zeros(size).index_add_(0, idx.clamp_(0, size - 1), hist)


class HistogramMethod(str, Enum):
    """How :class:`HistogramObserver` picks the range from its histogram."""

    KL = "kl"  # TensorRT entropy calibration: smallest KL(P‖Q)
    MSE = "mse"  # smallest expected rounding + clipping error (exact for the histogram)
    L2 = "l2"  # torchao's L2 model (clipping + scale²/12 noise), minimised globally
    PERCENTILE = "percentile"  # a percentile of x (affine) or |x| (symmetric)

    @classmethod
    def parse(cls, method) -> "HistogramMethod":
        try:
            return cls(method.lower() if isinstance(method, str) else method)
        except ValueError:
            raise ValueError(
                f"unknown histogram method {method!r}; use one of {[m.value for m in cls]}"
            ) from None


def _check_bins(bins, at_least: int) -> int:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < at_least:
        raise ValueError(f"bins must be an integer >= {at_least}, got {bins!r}")
    return bins


class HistogramObserver(QuantkitObserver):
    """Histogram of everything observed, per tensor, and a range search on it.

    The histogram has ``bins`` bins (``"kl"``: 64 times as many, see below) of width
    ``2^bin_exp``, aligned at 0 (bin ``k`` is ``[k·2^bin_exp, (k+1)·2^bin_exp)``), the
    narrowest such bins that cover the observed ``[min, max]`` (so the data spans between
    half and all of them). It lives on the data's device and accumulates in float64.
    When a batch widens the range, the width doubles as often as needed and whole bins
    merge: no count is split, and a value's bin does not depend on the order the data
    came in. ``merge`` combines observers from other
    processes the same way, so two observers fed halves of a dataset and merged hold
    exactly the histogram of one observer fed all of it.

    Methods (see :mod:`quantkit.observers._histsearch` and :mod:`._rangesearch`):

    - ``"kl"``: TensorRT's entropy calibration: its 2048-bin ``|x|`` histogram over
      ``[0, amax]`` (rebuilt from the observer's 64x finer bins), thresholds from bin
      128 to 2048, tail folded into the last bin, 128 levels (symmetric); for affine
      schemes 256 levels, TensorRT's unsigned mode on data of one sign and windows
      containing 0 otherwise (see :func:`._histsearch.search_kl`).
    - ``"mse"``: smallest expected squared error (rounding + clipping) of the qparams
      each candidate range gives, computed exactly from the histogram.
    - ``"l2"``: torchao's error model (clipping + ``scale²/12``), minimised over all
      ranges rather than by torchao's greedy shrink.
    - ``"percentile"``: the ``percentile``-th percentile of ``|x|`` (symmetric) or the
      ``100 − p`` and ``p`` percentiles of ``x`` (affine).

    Args:
        method: one of the above (a string or :class:`HistogramMethod`).
        bins: number of bins; 2048 as in torchao and TensorRT (``"kl"``: the bins of
            ``[0, amax]`` its search runs on, as TensorRT's).
        percentile: for ``"percentile"``, in (0, 100]; 99.99 by default (ModelOpt).
        dtype, qscheme, quant_min, quant_max, eps, is_dynamic: see
            :class:`QuantkitObserver`; per-tensor schemes only.

    Example:
        >>> obs = HistogramObserver(method="kl", dtype=torch.int8, qscheme=torch.per_tensor_symmetric)
        >>> obs(torch.randn(1000)); scale, zero_point = obs.calculate_qparams()
    """

    def __init__(self, method: str | HistogramMethod = "mse", bins: int = 2048,
                 percentile: float = 99.99, dtype=torch.quint8,
                 qscheme=torch.per_tensor_affine, **kwargs) -> None:
        super().__init__(dtype=dtype, qscheme=qscheme, **kwargs)
        if qscheme not in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            raise ValueError(
                f"HistogramObserver is per tensor, got qscheme {qscheme}; use PerChannelMSEObserver for per-channel ranges"
            )
        self.method = HistogramMethod.parse(method)
        self.bins = _check_bins(bins, 2)
        if not (isinstance(percentile, (int, float)) and 0 < percentile <= 100):
            raise ValueError(f"percentile must be in (0, 100], got {percentile!r}")
        self.percentile = float(percentile)
        stored = self.bins * _KL_FINE if self.method is HistogramMethod.KL else self.bins
        self.register_buffer("histogram", torch.zeros(stored, dtype=torch.float64))
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))
        # bin k covers [k·2^bin_exp, (k+1)·2^bin_exp), k = bin_start .. bin_start + stored − 1
        self.register_buffer("bin_exp", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("bin_start", torch.tensor(0, dtype=torch.int64))

    @property
    def calibrated(self) -> bool:
        return self.min_val.item() <= self.max_val.item()

    def _observe(self, x: torch.Tensor) -> None:
        x = x.float()
        mn, mx = torch.aminmax(x)
        self._check_finite(mn, mx)
        # one host sync per batch, as in torchao: the bin edges are plain floats
        mn, mx = float(mn), float(mx)
        if not self.calibrated:
            self.histogram = self.histogram.to(x.device)
        self._cover(mn, mx)
        exp, start = int(self.bin_exp), int(self.bin_start)
        self.histogram += _counts(x, self.histogram.shape[0], exp, start)

    def _cover(self, lo: float, hi: float) -> None:
        """Widen the bins (exactly: whole bins merge, see :func:`_regrid`) to cover ``[lo, hi]``
        as well as what was seen."""
        if self.calibrated:
            lo, hi = min(lo, self.min_val.item()), max(hi, self.max_val.item())
            exp, start = int(self.bin_exp), int(self.bin_start)
            new_exp = _bin_exponent(lo, hi, self.histogram.shape[0], at_least=exp)
            new_start = math.floor(lo * 2.0 ** -new_exp)
            self.histogram = _regrid(self.histogram, exp, start, new_exp, new_start)
        else:
            new_exp = _bin_exponent(lo, hi, self.histogram.shape[0])
            new_start = math.floor(lo * 2.0 ** -new_exp)
        self.bin_exp.fill_(new_exp)
        self.bin_start.fill_(new_start)
        self.min_val.fill_(lo)
        self.max_val.fill_(hi)

    def _merge(self, other: "HistogramObserver") -> None:
        if other.bins != self.bins:
            raise ValueError(f"cannot merge histogram observers with {self.bins} and {other.bins} bins")
        if not other.calibrated:
            return
        size = self.histogram.shape[0]
        if not self.calibrated and other.histogram.shape[0] == size:
            self.histogram = other.histogram.to(self.histogram.device).clone()
            for name in ("min_val", "max_val", "bin_exp", "bin_start"):
                getattr(self, name).copy_(getattr(other, name))
            return
        # both onto bins that cover the union and are at least as wide as either's: counts
        # move whole, so the merge equals one observer that saw both inputs (a method with
        # finer bins merged into one with coarser bins: exactly its coarser histogram)
        lo = min(self.min_val.item(), other.min_val.item())
        hi = max(self.max_val.item(), other.max_val.item())
        exps = [int(other.bin_exp)] + ([int(self.bin_exp)] if self.calibrated else [])
        exp = _bin_exponent(lo, hi, size, at_least=max(exps))
        start = math.floor(lo * 2.0 ** -exp)
        theirs = _regrid(other.histogram.to(self.histogram.device), int(other.bin_exp), int(other.bin_start),
                         exp, start, size)
        self.histogram = _regrid(self.histogram, int(self.bin_exp), int(self.bin_start), exp, start) + theirs
        self.bin_exp.fill_(exp)
        self.bin_start.fill_(start)
        self.min_val.fill_(lo)
        self.max_val.fill_(hi)

    def _occupied(self) -> tuple[int, int, float, float]:
        """First and last non-empty bin (the bins of min and max), and their outer edges."""
        exp, start = int(self.bin_exp), int(self.bin_start)
        inv = 2.0 ** -exp
        first = math.floor(self.min_val.item() * inv) - start
        last = math.floor(self.max_val.item() * inv) - start
        return first, last, (start + first) / inv, (start + last + 1) / inv

    def occupied_bins(self) -> tuple[torch.Tensor, float, float]:
        """The counts from the first to the last non-empty bin, and their outer edges."""
        first, last, lo, hi = self._occupied()
        return self.histogram[first:last + 1], lo, hi

    def _range(self) -> tuple[float, float]:
        """The searched range, as floats, within the observed ``[min, max]`` (and 0)."""
        lo, hi = self.min_val.item(), self.max_val.item()
        if hi <= lo:
            if lo > hi:
                self._check_calibrated()
            return lo, hi
        if self.method in (HistogramMethod.MSE, HistogramMethod.L2):
            first, last, h_lo, h_hi = self._occupied()  # the searches see these, with their exact edges
            # an FP8 observer (observers._fp8) searches on the float8 grid, not on integer levels
            search = _fp8.search_float8_range if getattr(self, "float8_rounding", False) else rs.search_range
            a, b = search(rs.host(self.histogram)[first:last + 1], h_lo, h_hi, self._qp(), self.method.value)
            return self._trimmed(a, b, lo, hi)
        if self.method is HistogramMethod.KL:
            first, last, h_lo, h_hi = self._occupied()
            a, b = hs.search_kl(rs.host(self.histogram)[first:last + 1], h_lo, h_hi, lo, hi, self._qp(),
                                self.bins)
            return self._trimmed(a, b, lo, hi)
        hist, h_lo, h_hi = self.occupied_bins()
        if self.method is HistogramMethod.PERCENTILE:
            t = lambda v: torch.tensor([v], dtype=torch.float64, device=hist.device)  # noqa: E731
            a, b = hs.percentile_range(hist[None], t(h_lo), t(h_hi), self.percentile, is_symmetric(self.qscheme))
            a, b = a.item(), b.item()
        return self._trimmed(a, b, lo, hi)

    def _trimmed(self, a: float, b: float, lo: float, hi: float) -> tuple[float, float]:
        # the occupied bins reach up to a bin past the data: no range beyond what was seen
        if is_symmetric(self.qscheme):
            t = min(max(-a, b), max(-lo, hi))
            return -t, t
        return max(a, min(lo, 0.0)), min(b, max(hi, 0.0))

    def _min_max(self) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self._range()
        dev = self.histogram.device
        return torch.tensor(lo, device=dev), torch.tensor(hi, device=dev)

    def calculate_qparams(self):
        """``(scale, zero_point)`` of the searched range (see the class docstring)."""
        if self.histogram.device.type != "cpu":
            return super().calculate_qparams()
        return self._choose(*self._range())  # floats: choose_qparams' scalar path, no tensors in between

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the stored histogram's size is the one saved (e.g. a "kl" histogram saved before
        # it kept finer bins): any size works, its bins say where they are
        if prefix + "histogram" in state_dict:
            self.histogram.resize_(state_dict[prefix + "histogram"].shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"method={self.method.value}, bins={self.bins}, " + super().extra_repr()


# per-channel searches run on groups of channels to bound memory ([C, K, levels] float64)
_CHANNEL_CHUNK = 64
# schedule for weights, in grid units (1/2048 of the range): clip 0 .. 15/32 of amax (best
# weight clips are well under half the range), then +-4 steps of 1/256 and of 1/2048
_WEIGHT_STAGES = ((0, 64, 16), (-4, 8, 9), (-4, 1, 9))


@register("per_channel_mse")
class PerChannelMSEObserver(PerChannelMinMaxObserver):
    """Per-channel histograms (weights: one per output channel) and, per channel, the
    range with the smallest expected squared error (rounding + clipping).

    Min/max per channel are kept exactly as :class:`PerChannelMinMaxObserver` does;
    each channel also has a ``bins``-bin histogram over its own range (rebinned without
    losing mass when the range grows). Merging adds the histograms.

    Args:
        ch_axis: channel axis (0 for weights).
        bins: bins per channel; 256 by default (a weight row has ~10³ values).
    """

    repeat_invariant = False  # the histograms add every repeat

    def __init__(self, ch_axis: int = 0, bins: int = 256, dtype=torch.quint8,
                 qscheme=torch.per_channel_affine, **kwargs) -> None:
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme, **kwargs)
        if qscheme not in (torch.per_channel_affine, torch.per_channel_symmetric):
            raise ValueError(
                f"PerChannelMSEObserver needs a per-channel qscheme, got {qscheme}; use HistogramObserver(method='mse') per tensor"
            )
        self.bins = _check_bins(bins, 2)
        self.register_buffer("histogram", torch.zeros(0, self.bins, dtype=torch.float64))

    def _observe(self, x: torch.Tensor) -> None:
        mn, mx = self._batch_min_max(x)
        y = torch.flatten(x.transpose(0, self.ch_axis).float(), start_dim=1)
        if self.calibrated:
            lo, hi = torch.min(mn, self.min_val), torch.max(mx, self.max_val)
            hist = hs.rebin(self.histogram, self.min_val.double(), self.max_val.double(),
                            lo.double(), hi.double())
        else:
            lo, hi = mn, mx
            hist = torch.zeros(mn.numel(), self.bins, dtype=torch.float64, device=x.device)
        self._set(lo, hi)
        self.histogram = hist + self._histc(y, lo, hi)

    def _histc(self, y: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """Row-wise histograms of ``y`` ([C, n]) over per-row ranges, in one bincount."""
        c, n = self.bins, y.shape[0]
        span = hi - lo
        inv = torch.where(span > 0, c / torch.where(span > 0, span, 1.0), 0.0)
        idx = ((y - lo[:, None]) * inv[:, None]).long().clamp_(0, c - 1)
        idx += torch.arange(n, device=y.device)[:, None] * c
        return torch.bincount(idx.view(-1), minlength=n * c).view(n, c).to(torch.float64)

    def _merge(self, other) -> None:
        if other.bins != self.bins:
            raise ValueError(f"cannot merge per-channel MSE observers with {self.bins} and {other.bins} bins")
        if not self.calibrated:
            self._set(other.min_val.clone(), other.max_val.clone())
            self.histogram = other.histogram.clone()
            return
        if other.min_val.shape != self.min_val.shape:
            raise ValueError(
                f"cannot merge per-channel observers with {self.min_val.numel()} and {other.min_val.numel()} channels"
            )
        lo, hi = torch.min(self.min_val, other.min_val), torch.max(self.max_val, other.max_val)
        mine = hs.rebin(self.histogram, self.min_val.double(), self.max_val.double(), lo.double(), hi.double())
        theirs = hs.rebin(other.histogram, other.min_val.double(), other.max_val.double(), lo.double(), hi.double())
        self._set(lo, hi)
        self.histogram = mine + theirs

    def _min_max(self):
        qp = self._qp()
        los, his = [], []
        for i in range(0, self.histogram.shape[0], _CHANNEL_CHUNK):
            sl = slice(i, i + _CHANNEL_CHUNK)
            a, b = rs.search_error(self.histogram[sl], self.min_val[sl], self.max_val[sl], qp,
                                   "mse", stages=_WEIGHT_STAGES)
            los.append(a)
            his.append(b)
        return torch.cat(los).float(), torch.cat(his).float()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "histogram" in state_dict:
            self.histogram.resize_(state_dict[prefix + "histogram"].shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"bins={self.bins}, " + super().extra_repr()


register("histogram", HistogramObserver)
register("kl", HistogramObserver.with_args(method="kl"))
register("mse", HistogramObserver.with_args(method="mse"))
register("l2", HistogramObserver.with_args(method="l2"))
register("percentile", HistogramObserver.with_args(method="percentile"))
