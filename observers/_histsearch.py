"""Histogram plumbing and the KL and percentile range searches: rebinning, the ``|x|``
histogram, TensorRT's entropy calibration (KL), percentiles. (The MSE and L2 searches
are in :mod:`._rangesearch`.)

Everything here is vectorised over candidates: a search evaluates a whole grid of
candidate ranges in a few array operations, never one candidate at a time in Python.
The torch helpers take ``[B, n]`` float64 histograms (``B`` = 1 per tensor, ``C`` per
channel) with one equal-width range ``[lo, hi]`` per row; counts are assumed uniform
within a bin (the usual histogram model, also torchao's). The KL search runs in NumPy
on the host, as :mod:`._rangesearch` does (a few dozen small operations per search).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from quantkit._qmath import is_symmetric

__all__ = [
    "rebin",
    "abs_histogram",
    "percentile_range",
    "KL_START_BIN",
    "kl_view",
    "abs_view",
    "kl_divergence",
    "search_abs_kl",
    "search_kl",
]

_F64 = torch.float64


# --- histogram plumbing -------------------------------------------------------------
def _cdf_at(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Count of mass below ``x`` (``[B, M]``), linear within bins; a zero-width
    histogram is a point mass at ``lo``."""
    n = hist.shape[1]
    cdf = torch.nn.functional.pad(hist.cumsum(1), (1, 0))
    width = (hi - lo) / n
    flat = width <= 0
    pos = (x - lo[:, None]) / torch.where(flat, torch.ones_like(width), width)[:, None]
    pos = torch.where(flat[:, None], torch.where(x > lo[:, None], float(n), 0.0), pos)
    pos = pos.clamp(0, n)
    k = pos.floor().clamp(max=n - 1).long()
    return cdf.gather(1, k) + (pos - k) * hist.gather(1, k)


def rebin(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
          new_lo: torch.Tensor, new_hi: torch.Tensor, bins: int | None = None) -> torch.Tensor:
    """Move counts onto ``bins`` equal bins over ``[new_lo, new_hi] ⊇ [lo, hi]``.

    Mass is preserved (each row's total is unchanged); a bin's count is split between
    the new bins it overlaps, in proportion to the overlap. Exact when edges align.
    """
    bins = hist.shape[1] if bins is None else bins
    total = hist.sum(1, keepdim=True)
    steps = torch.arange(bins + 1, dtype=_F64, device=hist.device) / bins
    edges = new_lo[:, None] + (new_hi - new_lo)[:, None] * steps
    c = _cdf_at(hist, lo, hi, edges)
    c[:, 0] = 0
    c[:, -1:] = total
    c = torch.cummax(c, 1).values.clamp(max=total)  # monotone, so no negative counts
    return c.diff(dim=1)


def abs_histogram(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  bins: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram of ``|x|`` over ``[0, amax]`` with ``bins`` bins; returns ``(hist, amax)``."""
    bins = hist.shape[1] if bins is None else bins
    amax = torch.maximum(lo.abs(), hi.abs())
    t = amax[:, None] * torch.arange(bins + 1, dtype=_F64, device=hist.device) / bins
    c = _cdf_at(hist, lo, hi, t) - _cdf_at(hist, lo, hi, -t)
    c[:, 0] = 0
    c[:, -1:] = hist.sum(1, keepdim=True)
    c = torch.cummax(c, 1).values
    return c.diff(dim=1), amax


# --- KL: TensorRT's entropy calibration ------------------------------------------------
# TensorRT's entropy calibrator as NVIDIA's pytorch-quantization implements it
# (pytorch_quantization/calib/histogram.py, _compute_amax_entropy; the same loop as in the
# GTC 2017 talk "8-bit Inference with TensorRT"): a histogram of |x| with 2048 bins over
# [0, amax]; bin 0 takes bin 1's count; for every i from start_bin = 128 to 2048, P is the
# first i bins with the mass of the rest added to bin i-1 and Q splits the first i bins
# into 128 levels (bin b goes to level floor(b·128 / i): np.digitize on np.linspace(0, i,
# 129)) and spreads each level's mass evenly over its non-zero bins; KL = entropy(P, Q)
# (scipy: both normalised; inf where Q = 0 < P), and amax = the bin edge i·amax/2048 of
# the last smallest divergence. No epsilon smoothing (MXNet's and ONNX Runtime's
# calibrators smooth zeros; pytorch-quantization does not).
KL_START_BIN = 128  # the narrowest window, in bins (TensorRT's start_bin)
# the affine (both-sided) window search: a first grid of about _KL_GRID windows spread
# over the two ends in proportion to their lengths, then, around each of the _KL_STARTS
# best together, _KL_SIDE x _KL_SIDE windows at 1/_KL_SHRINK of the previous spacing, down
# to one bin. A candidate costs O(levels), so the grid is far coarser than the exhaustive
# |x| search. Against every window on 40 two-signed histograms (256 bins a side;
# `bench_observers.py --kl-only`) the pick was within 1% (and 2%) of the smallest divergence in 34;
# the misses are isolated windows whose level boundaries happen to fit a sparse tail (one
# has a third of its neighbours' divergence). 2 starts: 33 within 2%; 1024 first points and 1
# start did worse on a 22-case set (16 vs 18 within 2%).
_KL_GRID = 256
_KL_STARTS = 3
_KL_SIDE = 9
_KL_SHRINK = 4.0


def _xlogx(x: np.ndarray) -> np.ndarray:
    return x * np.log(np.where(x > 0, x, 1.0))


@functools.lru_cache(maxsize=8)
def _log_counts(n: int) -> np.ndarray:
    """``log(k)`` for ``k = 0 .. n``, with ``log(0)`` taken as 0 (an empty group has no mass)."""
    return np.log(np.maximum(np.arange(n + 1), 1.0))


def kl_view(hist: np.ndarray, h_lo: float, h_hi: float, lo: float, hi: float,
            bins: int) -> tuple[np.ndarray, int, float]:
    """The data's histogram in TensorRT's bins: width ``W = amax / bins`` (``amax =
    max(-lo, hi)``), aligned at 0, from the bin holding ``lo`` (or 0) to the bin holding
    ``hi`` (or ``[0, W)``).

    ``hist`` has equal bins over ``[h_lo, h_hi]``, much finer than ``W`` (the observer
    keeps 64 per TensorRT bin). A fine bin's count is split between the new bins it
    overlaps in proportion (uniform within the bin) and the cumulative counts at the new
    edges are rounded to integers: dense bins get the proportional split to half a count,
    and a sparse bin's few values stay whole, so empty bins stay empty as in a histogram
    of the values themselves (TensorRT treats empty bins specially).

    Returns:
        ``(counts, z, W)``: ``counts[z]`` is the bin ``[0, W)``.
    """
    amax = max(-lo, hi)
    w = amax / bins
    n_neg = min(bins, math.ceil(-lo / w)) if lo < 0 else 0
    n_pos = max(1, min(bins, math.ceil(hi / w))) if hi > 0 else 1
    edges = np.arange(-n_neg, n_pos + 1) * w
    n = hist.shape[0]
    pos = np.clip((edges - h_lo) * (n / (h_hi - h_lo)), 0.0, n)
    k = np.minimum(pos.astype(np.intp), n - 1)  # pos >= 0: truncation is floor
    cum = np.empty(n + 1)
    cum[0] = 0.0
    np.cumsum(hist, out=cum[1:])
    c = np.rint(cum[k] + (pos - k) * hist[k])
    c[0], c[-1] = 0.0, cum[-1]  # the edges span [lo, hi]: nothing below, everything in
    return np.diff(c), n_neg, w


def abs_view(view: np.ndarray, z: int, bins: int) -> np.ndarray:
    """``|x|`` counts (``bins`` bins over ``[0, amax]``) from :func:`kl_view`'s counts:
    bin ``[-(j+1)W, -jW)`` folds onto ``|x|`` bin ``j``."""
    a = np.zeros(bins)
    a[: view.shape[0] - z] += view[z:]
    a[:z] += view[z - 1::-1] if z else 0.0
    return a


class _KLTables:
    """Prefix sums of a histogram ``h`` and, for every group of ``m`` bins from bin ``p``,
    ``V[p, m] = G·log(G / nz)`` (``G`` its mass, ``nz`` its non-zero bins; 0 if empty), so
    that a candidate's divergence is a sum of ``levels`` look-ups. Windows are at most
    ``max_len`` bins, so groups at most ``ceil(max_len / levels)``: ``V`` rows are
    ``width = ceil(max_len / levels) + 1`` wide, and group ``(p, m)`` is entry
    ``p·width + m``."""

    def __init__(self, h: np.ndarray, levels: int, max_len: int) -> None:
        n = h.shape[0]
        self.h, self.levels, self.max_len = h, levels, max_len
        self.width = width = -(-max_len // levels) + 1
        self.total = float(h.sum())
        self.cum = np.concatenate(([0.0], np.cumsum(h)))
        self.nzc = np.concatenate(([0.0], np.cumsum(h > 0)))
        self.xl = _xlogx(h)
        self.hlh = np.concatenate(([0.0], np.cumsum(self.xl)))
        # mass and non-zero bins of every group, built per group size m from shifted
        # prefix sums (groups past the last bin are never looked up: left 0)
        g = np.zeros((width, n + 1))
        nz = np.zeros((width, n + 1), dtype=np.intp)
        for m in range(1, min(width, n + 1)):
            np.subtract(self.cum[m:], self.cum[: n + 1 - m], out=g[m, : n + 1 - m])
            nz[m, : n + 1 - m] = self.nzc[m:] - self.nzc[: n + 1 - m]
        # G·log G − G·log nz; nz < width, so its log is a look-up
        self.v = np.ascontiguousarray((_xlogx(g) - g * _log_counts(width)[nz]).T).reshape(-1)


@functools.lru_cache(maxsize=4)
def _group_index(levels: int, max_len: int, dtype=np.intp) -> np.ndarray:
    """``[max_len + 1, levels]``: row ``L`` holds the offsets into :class:`_KLTables`'s
    ``V`` of the levels of a window of ``L`` bins starting at bin 0. Level ``g`` holds bins
    ``ceil(g·L/levels) .. ceil((g+1)·L/levels) − 1`` (TensorRT's ``np.digitize`` on
    ``np.linspace(0, L, levels + 1)``, in exact integer arithmetic). The same for every
    histogram, so it is built once (2 MiB for the ``|x|`` search, 4 MiB for the affine one)."""
    g = np.arange(levels + 1)
    off = -((-g * np.arange(max_len + 1)[:, None]) // levels)
    return (off[:, :-1] * (-(-max_len // levels) + 1) + np.diff(off, axis=1)).astype(dtype)


@functools.lru_cache(maxsize=4)
def _end_levels(levels: int, max_len: int) -> np.ndarray:
    """``[3, max_len + 1]``: for a window of ``L`` bins, the end of its first level and the
    start and end of the level holding its last bin (:func:`_group_index`'s split)."""
    length = np.arange(max_len + 1)
    g_last = ((length - 1) * levels) // np.maximum(length, 1)
    ceil = lambda g: -((-g * length) // levels)  # noqa: E731
    return np.stack([ceil(1), ceil(g_last), ceil(g_last + 1)])


def kl_divergence(t: _KLTables, start: np.ndarray, stop: np.ndarray,
                  index: np.ndarray | None = None) -> np.ndarray:
    """KL(P‖Q) of each candidate window ``h[start:stop]``, TensorRT's construction (see the
    comment above :data:`KL_START_BIN`) with the mass left of the window added to its
    first bin as the mass right of it is added to its last.

    With ``G_g`` the mass and ``nz_g`` the non-zero bins of level ``g``, ``N`` the total
    and ``I`` the window's mass: ``KL = (Σ P·log P − Σ_g P_g·log(G_g/nz_g)) / N +
    log(I / N)`` where ``P_g`` is ``G_g`` plus the tails in the end levels. ``Σ P·log P``
    comes from a prefix sum, each level's term from :class:`_KLTables`.

    Args:
        t: tables of the histogram, for ``levels`` and windows up to ``max(stop − start)``.
        start, stop: ``[K]`` bin indices, ``stop − start >= 2``.
        index: the rows ``stop − start`` of ``_group_index(levels, t.max_len)`` if
            already at hand.

    Returns:
        ``[K]`` divergences (``inf`` where Q is 0 and P is not: a tail folded onto an
        empty end bin, or an empty window).
    """
    h, cum, nzc, levels = t.h, t.cum, t.nzc, t.levels
    length = stop - start
    if index is None:
        # int32 look-ups (half the memory traffic) while V's entries fit
        dtype = np.int32 if (t.max_len + 1) * t.width < 2**31 else np.intp
        index = _group_index(levels, t.max_len, dtype)[length]  # a copy: shifted in place
        index += (start * t.width).astype(dtype)[:, None]
    elif start.any():
        index = index + (start * t.width)[:, None]
    cross = t.v.take(index).sum(1)
    left, right = cum[start], t.total - cum[stop]
    # the levels holding the first and the last bin: P holds the tails there
    bounds = _end_levels(levels, t.max_len)[:, length]
    first_end, a, b = start + bounds[0], start + bounds[1], start + bounds[2]
    h0, h1 = h[start], h[stop - 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        g0, z0 = cum[first_end] - left, nzc[first_end] - nzc[start]
        g1, z1 = cum[b] - cum[a], nzc[b] - nzc[a]
        cross += np.where(left > 0, left * np.log(g0 / np.maximum(z0, 1.0)), 0.0)
        cross += np.where(right > 0, right * np.log(g1 / np.maximum(z1, 1.0)), 0.0)
        plogp = (t.hlh[stop] - t.hlh[start] - t.xl[start] - t.xl[stop - 1]
                 + _xlogx(h0 + left) + _xlogx(h1 + right))
        inside = cum[stop] - left
        kl = (plogp - cross) / t.total + np.log(inside / t.total)
    bad = ((left > 0) & (h0 == 0)) | ((right > 0) & (h1 == 0)) | ~(inside > 0) | np.isnan(kl)
    return np.where(bad, np.inf, kl)


def search_abs_kl(a: np.ndarray, levels: int) -> int:
    """TensorRT's threshold on the ``|x|`` counts ``a`` (bin 0 already holding bin 1's
    count): the stop bin ``i`` (threshold ``i·W``) of the last smallest divergence over
    ``i = start_bin .. len(a)``."""
    n = a.shape[0]
    first = min(KL_START_BIN, n)
    if n < 2:
        return n
    t = _KLTables(a, levels, n)
    stop = np.arange(first, n + 1)
    kl = kl_divergence(t, np.zeros_like(stop), stop, _group_index(levels, n)[first:])
    return int(stop[-1 - int(np.argmin(kl[::-1]))])  # ties: the widest, as TensorRT


def search_kl(hist: np.ndarray, h_lo: float, h_hi: float, lo: float, hi: float, qp: dict,
              bins: int = 2048) -> tuple[float, float]:
    """Range with the smallest KL divergence, TensorRT's way, from a fine histogram.

    ``hist`` (equal bins over ``[h_lo, h_hi]``) is first put in TensorRT's ``bins`` bins
    per side (:func:`kl_view`); the data's range is ``[lo, hi]``.

    - Symmetric schemes: TensorRT's entropy calibration on the ``|x|`` histogram, with
      ``levels = (quant_max − quant_min + 1) // 2`` (128 for int8), range ``[-t, t]``.
    - Affine schemes, data of one sign: TensorRT's calibration of unsigned tensors (the
      ``|x|`` histogram, ``levels = quant_max − quant_min + 1``, 256 for uint8), range
      ``[0, t]`` (or ``[-t, 0]``).
    - Affine schemes, data of both signs (TensorRT has no such mode): windows
      ``[s·W, e·W]`` containing 0 of the signed histogram, at least ``start_bin`` bins
      wide, tails folded into both end bins, ``levels`` levels split TensorRT's way;
      the bin ``[0, W)`` takes its neighbour's count (TensorRT's bin 0). Searched
      coarse to fine over both ends.

    Returns:
        ``(a, b)``, floats: bin edges; the caller trims them to the data.
    """
    nlev = qp["quant_max"] - qp["quant_min"] + 1
    sym = is_symmetric(qp["qscheme"])
    if not max(-lo, hi) > 0 or not (max(-lo, hi) / bins) > 0:
        return lo, hi
    view, z, w = kl_view(hist, h_lo, h_hi, lo, hi, bins)
    if sym or lo >= 0 or hi <= 0:
        a = abs_view(view, z, bins)
        a[0] = a[1]
        t = search_abs_kl(a, nlev // 2 if sym else nlev) * w
        if sym:
            return -t, t
        return (0.0, t) if lo >= 0 else (-t, 0.0)
    n = view.shape[0]
    view[z] = view[z + 1] if z + 1 < n else view[z - 1]
    if n < KL_START_BIN:
        return lo, hi
    s, e = _search_windows(view, z, nlev, 2 * bins)
    return (s - z) * w, (e - z) * w


def _search_windows(view: np.ndarray, z: int, levels: int, max_len: int) -> tuple[int, int]:
    """The window ``[s, e)`` with ``s <= z <= e`` and at least ``start_bin`` bins with the
    smallest :func:`kl_divergence`, searched coarse to fine (see :data:`_KL_GRID`).
    ``max_len``: the longest view (one index table serves them all)."""
    n = view.shape[0]
    tables = _KLTables(view, levels, max_len)
    # a window whose end bin is empty while the tail beyond it is not has KL = inf (Q is 0
    # where P holds the tail): candidates move inwards to the nearest non-empty end bins,
    # so that a coarse grid over sparse tails still sees finite divergences
    i = np.arange(n + 1)
    filled = view > 0
    end_at = np.maximum(np.maximum.accumulate(np.where(np.r_[False, filled], i, 0)), z)
    start_at = np.minimum(np.minimum.accumulate(np.where(np.r_[filled, True], i, n)[::-1])[::-1], z)

    def evaluate(s, e):
        s, e = (v.reshape(-1) for v in np.meshgrid(np.unique(start_at[s]), np.unique(end_at[e]), indexing="ij"))
        ok = e - s >= KL_START_BIN
        s, e = s[ok], e[ok]
        return s, e, (kl_divergence(tables, s, e) if s.size else np.zeros(0))

    # first grid: about _KL_GRID points, as many per side as its share of the bins
    ns = int(min(z + 1, max(2, round(math.sqrt(_KL_GRID * (z + 1) / (n - z + 1))))))
    ne = int(min(n - z + 1, max(2, _KL_GRID // ns)))
    s, e, kl = evaluate(np.rint(np.linspace(0, z, ns)).astype(np.intp),
                        np.rint(np.linspace(z, n, ne)).astype(np.intp))
    order = np.argsort(kl, kind="stable")[:_KL_STARTS]
    order = order[np.isfinite(kl[order])]
    if order.size == 0:
        return 0, n
    # refine the best few together, each on its own grid around it, finer each round
    cs, ce, ckl = s[order], e[order], kl[order]
    step_s, step_e = z / max(ns - 1, 1), (n - z) / max(ne - 1, 1)
    offsets = np.arange(_KL_SIDE) - _KL_SIDE // 2
    k2 = _KL_SIDE ** 2
    while step_s > 1 or step_e > 1:
        step_s, step_e = max(step_s / _KL_SHRINK, 1.0), max(step_e / _KL_SHRINK, 1.0)
        rs_ = np.clip(np.rint(cs[:, None] + offsets * step_s), 0, z).astype(np.intp)
        re_ = np.clip(np.rint(ce[:, None] + offsets * step_e), z, n).astype(np.intp)
        rs_, re_ = np.minimum(start_at[rs_], z), np.maximum(end_at[re_], z)
        rs_, re_ = np.repeat(rs_, _KL_SIDE, axis=1).reshape(-1), np.tile(re_, _KL_SIDE).reshape(-1)
        ok = re_ - rs_ >= KL_START_BIN
        rkl = np.full(rs_.shape, np.inf)
        if ok.any():
            rkl[ok] = kl_divergence(tables, rs_[ok], re_[ok])
        j = rkl.reshape(cs.size, k2).argmin(1)
        pick = np.arange(cs.size) * k2 + j
        better = rkl[pick] < ckl
        cs, ce, ckl = (np.where(better, new, old) for new, old in ((rs_[pick], cs), (re_[pick], ce), (rkl[pick], ckl)))
    i = int(np.argmin(ckl))
    return int(cs[i]), int(ce[i])


def percentile_range(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, percentile: float,
                     symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[-t, t]`` with ``t`` the percentile of ``|x|`` (symmetric), or the
    ``(100 − p)``-th and ``p``-th percentiles of ``x`` (affine); linear within bins."""
    h, lo, hi = hist.to(_F64), lo.to(_F64), hi.to(_F64)
    q = percentile / 100.0
    if symmetric:
        ah, amax = abs_histogram(h, lo, hi)
        t = _quantile(ah, torch.zeros_like(amax), amax, torch.full_like(amax, q))
        return -t, t
    a = _quantile(h, lo, hi, torch.full_like(lo, 1 - q))
    b = _quantile(h, lo, hi, torch.full_like(lo, q))
    return a, b


def _quantile(h: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    n = h.shape[1]
    cum = torch.nn.functional.pad(h.cumsum(1), (1, 0))
    target = q[:, None] * cum[:, -1:]
    k = torch.searchsorted(cum[:, 1:].contiguous(), target).clamp(max=n - 1)  # first bin reaching target
    below = cum.gather(1, k)
    inbin = h.gather(1, k)
    frac = torch.where(inbin > 0, (target - below) / torch.where(inbin > 0, inbin, 1.0), 0.0).clamp(0, 1)
    width = (hi - lo) / n
    return (lo[:, None] + (k + frac) * width[:, None])[:, 0]
