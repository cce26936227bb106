"""Histogram plumbing and the KL and percentile range searches: rebinning, the ``|x|``
histogram, TensorRT-style KL entropy, percentiles. (The MSE and L2 searches are in
:mod:`._rangesearch`.)

Everything here is vectorised over candidates: a search evaluates a whole grid of
candidate ranges in a few tensor operations, never one candidate at a time in Python.
Histograms are ``[B, n]`` float64 tensors (``B`` = 1 per tensor, ``C`` per channel)
with one equal-width range ``[lo, hi]`` per row; counts are assumed uniform within a
bin (the usual histogram model, also torchao's).
"""

from __future__ import annotations

from typing import Callable

import torch

from quantkit._qmath import is_symmetric

__all__ = [
    "rebin",
    "abs_histogram",
    "kl_divergence",
    "percentile_range",
    "kl_histogram",
    "search_kl",
]

_F64 = torch.float64
# the affine KL search's coarse-to-fine grid, as (first offset, step, number of points)
# in clip fractions: 0 .. 63/64 of each side, then windows one previous step wide on
# either side of the best point so far, down to 1/2048 of the range (one bin at the
# default 2048 bins). KL candidates cost O(1) each, so it starts from a fine grid.
_STAGES_KL_2D = ((0, 1 / 64, 64), (-8, 1 / 512, 17), (-4, 1 / 2048, 9))


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


# --- objectives ---------------------------------------------------------------------
def _xlogx(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x * torch.log(torch.where(x > 0, x, 1.0)), 0.0)


def _group_table(cum: torch.Tensor, nzc: torch.Tensor, max_per: int) -> torch.Tensor:
    """``T[m−1, p] = Σ_{j≥1} v_m(p − j·m)`` with ``v_m(p) = G·log(G/nz)`` for the group of
    ``m`` bins starting at ``p`` (G its mass, nz its non-zero bins): sums over groups
    spaced ``m`` apart are differences of two entries. One row per group size."""
    n = cum.shape[0] - 1
    rows = []
    for m in range(1, max_per + 1):  # group sizes (n // levels of them), not candidates
        g = cum[m:] - cum[:-m]
        z = nzc[m:] - nzc[:-m]
        v = g * torch.log(torch.where(g > 0, g / torch.where(z > 0, z, 1.0), 1.0))
        r = -(-(n + 1) // m) + 1
        vp = torch.nn.functional.pad(v, (0, r * m - v.shape[0])).view(r, m)
        rows.append((vp.cumsum(0) - vp).reshape(-1)[: n + 1])
    return torch.stack(rows)


class _KLTables:
    """The prefix sums :func:`kl_divergence` reads, built once per histogram (a search
    evaluates several stages of candidates on the same histogram)."""

    def __init__(self, hist: torch.Tensor, levels: int) -> None:
        pad = torch.nn.functional.pad
        self.h = h = hist.to(_F64)
        self.total = h.sum()
        self.cum = pad(h.cumsum(0), (1, 0))
        self.nzc = pad((h > 0).to(_F64).cumsum(0), (1, 0))
        self.hlh = pad(_xlogx(h).cumsum(0), (1, 0))
        # groups of up to n // levels bins: the widest window's
        self.group = _group_table(self.cum, self.nzc, max(1, h.shape[0] // levels))


def kl_divergence(hist: torch.Tensor, start: torch.Tensor, stop: torch.Tensor, levels: int,
                  tables: _KLTables | None = None) -> torch.Tensor:
    """KL(P‖Q) of each candidate window ``hist[start:stop]`` (TensorRT/MXNet entropy calibration).

    P is the window with the mass left of it added to its first bin and the mass right
    of it added to its last bin. Q quantizes the window (tails excluded) to ``levels``
    levels: ``(stop − start) // levels`` bins per level, the last level takes the
    remainder; each level's mass is spread evenly over its bins where P is non-zero.
    Both are normalised; ``KL = Σ p·log(p/q)`` (``scipy.stats.entropy(P, Q)``).

    With ``G_j`` the mass and ``nz_j`` the non-zero bins of level j,
    ``KL = (Σ p·log p − Σ_j P_j·log(G_j/nz_j)) / N + log(Σ_j G_j / N)``. ``Σ p·log p`` comes
    from a prefix sum; the levels strictly between the first and last are groups of
    equal size ``m`` spaced ``m`` apart, whose sum is read from a strided prefix sum
    per group size (:func:`_group_table`). So every candidate costs O(1) after an
    O(bins²/levels) table.

    Args:
        hist: ``[n]`` counts.
        start, stop: ``[K]`` integer bin indices with ``stop − start ≥ levels``.
        tables: :class:`_KLTables` of ``hist`` for ``levels``, to reuse across calls.

    Returns:
        ``[K]`` divergences (``inf`` where Q is zero but P is not).
    """
    t = tables if tables is not None else _KLTables(hist, levels)
    h, total, cum, nzc, hlh, table = t.h, t.total, t.cum, t.nzc, t.hlh, t.group
    left = cum[start]
    right = total - cum[stop]
    per = (stop - start) // levels
    first_end = start + per
    last_start = start + (levels - 1) * per
    row = (per - 1) * table.shape[1]
    flat = table.view(-1)
    middle = flat[row + last_start] - flat[row + first_end]
    # first and last levels: P also holds the tails there, so a bin can be non-zero in P
    # where h is 0
    g0 = cum[first_end] - cum[start]
    z0 = nzc[first_end] - nzc[start] + ((h[start] == 0) & (left > 0)).to(_F64)
    g1 = cum[stop] - cum[last_start]
    z1 = nzc[stop] - nzc[last_start] + ((h[stop - 1] == 0) & (right > 0)).to(_F64)

    def term(p, g, z):
        # P > 0 with G = 0 gives log(0) = -inf: Q is zero where P is not, KL = inf
        return torch.where(p > 0, p * torch.log(g / torch.where(z > 0, z, 1.0)), 0.0)

    cross = middle + term(g0 + left, g0, z0) + term(g1 + right, g1, z1)
    plogp = hlh[stop - 1] - hlh[start + 1] + _xlogx(h[start] + left) + _xlogx(h[stop - 1] + right)
    inside = cum[stop] - cum[start]
    kl = (plogp - cross) / total + torch.log(inside / total)
    return torch.nan_to_num(kl, nan=float("inf"), posinf=float("inf"))


# --- searches -----------------------------------------------------------------------
def _grid_search(err_fn: Callable[[torch.Tensor], torch.Tensor], batch: int, dims: int,
                 device, stages) -> torch.Tensor:
    """Minimise ``err_fn`` over clip fractions ``f ∈ [0, 1)^dims`` (per row), coarse to fine.

    ``err_fn`` takes ``[B, K, dims]`` fractions and returns ``[B, K]`` errors; each stage
    is one call. Returns the best ``[B, dims]`` fractions.
    """
    best = torch.zeros(batch, dims, dtype=_F64, device=device)
    best_err = torch.full((batch,), float("inf"), dtype=_F64, device=device)
    for first, step, count in stages:
        offsets = (first + torch.arange(count, dtype=_F64, device=device)) * step
        grid = torch.cartesian_prod(*([offsets] * dims)).view(-1, dims)
        cand = (best[:, None, :] + grid[None]).clamp(0, 1 - 1 / 2048)
        err = err_fn(cand)
        err_min, idx = err.min(1)
        better = err_min < best_err  # keep the previous best if no candidate beats it
        best = torch.where(better[:, None], cand[torch.arange(batch, device=device), idx], best)
        best_err = torch.where(better, err_min, best_err)
    return best


def kl_histogram(hist: torch.Tensor, lo: float, hi: float, symmetric: bool) -> tuple[torch.Tensor, float]:
    """The histogram the KL search runs on, and the position of 0 in it (in bins).

    Symmetric: the ``|x|`` histogram over ``[0, amax]``. Either way the bin holding 0
    gets its neighbour's count (as ModelOpt does): 0 is exactly representable, and a
    spike of exact zeros (ReLU outputs, padding) would otherwise dominate the
    divergence and drive the search to clip half the range.
    """
    h = hist.reshape(1, -1).to(_F64)
    n = h.shape[1]
    lo_t = torch.tensor([lo], dtype=_F64, device=h.device)
    hi_t = torch.tensor([hi], dtype=_F64, device=h.device)
    if symmetric:
        h, _ = abs_histogram(h, lo_t, hi_t)
        zero = 0.0
    else:
        zero = min(max(-lo / ((hi - lo) / n), 0.0), float(n))
    h = h[0].clone()
    z = min(int(zero), n - 1)
    h[z] = h[z + 1] if z + 1 < n else h[z - 1]
    return h, zero


def search_kl(hist: torch.Tensor, lo: float, hi: float, qp: dict) -> tuple[float, float]:
    """Range with the smallest KL divergence (see :func:`kl_divergence`), per tensor.

    Symmetric: the ``|x|`` histogram, every threshold from ``levels`` bins to the
    whole range (TensorRT), with ``levels = (quant_max − quant_min + 1) // 2`` (128 for
    int8). Affine: windows ``[start, stop)`` of the signed histogram that contain 0,
    with ``levels = quant_max − quant_min + 1`` (256), searched coarse to fine in 2D.
    Both run on :func:`kl_histogram`.
    """
    n = hist.numel()
    nlev = qp["quant_max"] - qp["quant_min"] + 1
    sym = is_symmetric(qp["qscheme"])
    h, zero = kl_histogram(hist, lo, hi, sym)
    if sym:
        levels = nlev // 2
        amax = max(abs(lo), abs(hi))
        if n < levels:
            return -amax, amax
        stop = torch.arange(levels, n + 1, device=h.device)
        kl = kl_divergence(h, torch.zeros_like(stop), stop, levels)
        t = amax * int(stop[int(torch.argmin(kl))]) / n
        return -t, t
    levels = nlev
    width = (hi - lo) / n
    max_left, max_right = int(zero), n - int(-(-zero // 1))
    if n < levels:
        return lo, hi
    tables = _KLTables(h, levels)

    def err_fn(f):
        start = torch.round(f[0, :, 0] * max_left).long()
        stop = n - torch.round(f[0, :, 1] * max_right).long()
        ok = stop - start >= levels
        kl = kl_divergence(h, torch.where(ok, start, 0), torch.where(ok, stop, n), levels, tables)
        return torch.where(ok, kl, float("inf"))[None]

    best = _grid_search(err_fn, 1, 2, h.device, _STAGES_KL_2D)[0]
    start = int(torch.round(best[0] * max_left))
    stop = n - int(torch.round(best[1] * max_right))
    return lo + start * width, lo + stop * width


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
