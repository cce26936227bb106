"""FP8 observers: marking an observer for the float8 grid, dynamic FP8, and the MSE range
search on the FP8 grid.

An observer whose ``float8_rounding`` attribute is True quantizes onto the float8 grid
itself (``quantkit._qmath.quantize_float8``: torchao's float8 affine ops), not onto integers
first as the ``quantized_decomposed`` ops with a float8 dtype do; ``quantkit.convert`` emits
torchao's float8 ops for it and the histogram observers search the range on that grid.
"""

from __future__ import annotations

import numpy as np
import torch

from quantkit._errors import ConvertError
from quantkit._qmath import DEFAULT_EPS, FLOAT8_DTYPES, float8_max, float8_values, underlying_dtype

from . import _rangesearch as rs
from ._minmax import PlaceholderObserver

__all__ = ["Float8DynamicObserver", "check_float8_method", "float8_observer", "kv_cache_observer",
           "search_float8_range", "float8_mse"]


class Float8DynamicObserver(PlaceholderObserver):
    """Marks a tensor for dynamic FP8: records nothing; the converted graph computes the scale
    at run time (``amax / float8_max``, per tensor, or per row of the last dimension with
    ``per_token=True``). A :class:`PlaceholderObserver` with a float8 dtype.

    Args:
        dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
        per_token: one scale per token (row of the last dimension) instead of per tensor.
    """

    float8_rounding = True
    qkind = "float8"  # quantkit.pipeline.emit: torchao's float8 ops with a run-time scale

    def __init__(self, dtype=torch.float8_e4m3fn, qscheme=torch.per_tensor_symmetric,
                 is_dynamic: bool = True, per_token: bool = False, **kwargs) -> None:
        kwargs.pop("ch_axis", None)
        if underlying_dtype(dtype) not in FLOAT8_DTYPES:
            raise ValueError(f"Float8DynamicObserver needs a float8 dtype, got {dtype}")
        if qscheme != torch.per_tensor_symmetric:
            raise ValueError(f"dynamic FP8 is symmetric, got qscheme {qscheme}; use torch.per_tensor_symmetric")
        super().__init__(dtype=dtype, qscheme=qscheme, is_dynamic=True, **kwargs)
        self.per_token = bool(per_token)  # the base refuses per-token for anything but int8

    def convert(self, model, observer_node) -> None:
        raise ConvertError(f"FP8 observer at node '{self.node_name}' converts with quantkit.convert only")


class _Marked:
    """Observer constructor that builds ``base(**kwargs)`` and sets ``attrs`` on the observer
    (what it declares); the constructor carries the same attributes, so a quantizer can read
    them from a spec."""

    def __init__(self, base, **attrs) -> None:
        self.base = base
        self.attrs = attrs
        for k, v in attrs.items():
            setattr(self, k, v)

    def __call__(self, **kwargs):
        obs = self.base(**kwargs)
        if not hasattr(obs, "calculate_qparams"):
            raise ValueError(f"{type(obs).__name__} is not an observer; FP8 and KV-cache specs need quantkit's observers")
        if self.attrs.get("float8_rounding"):
            check_float8_method(obs)
        for k, v in self.attrs.items():
            setattr(obs, k, v)
        return obs

    def __repr__(self) -> str:
        return f"marked({self.base!r}, {self.attrs})"


def check_float8_method(obs) -> None:
    """Refuse an observer whose range search models integer levels (the KL and L2 histogram
    methods): raises ValueError in one line."""
    method = getattr(obs, "method", None)
    if getattr(method, "value", method) in ("kl", "l2"):
        raise ValueError(
            f"the {getattr(method, 'value', method)!r} histogram method models integer levels and "
            "cannot search an FP8 range; use 'minmax', 'moving_average_minmax', 'mse' or 'percentile'"
        )


def float8_observer(ctor):
    """``ctor`` (an observer class or ``with_args`` partial) whose observers quantize onto the
    float8 grid (``float8_rounding = True``): usable as a ``QuantizationSpec``'s
    ``observer_or_fake_quant_ctr`` with a float8 dtype. The KL and L2 histogram methods are
    refused when the observer is built (their error models assume equally spaced levels)."""
    return _Marked(ctor, float8_rounding=True)


def kv_cache_observer(ctor, role: str):
    """``ctor`` whose observers declare ``kv_role`` (``"key"`` or ``"value"``): they watch an
    attention's key or value tensor, and ``quantkit.convert`` records them as the KV cache's scales."""
    if role not in ("key", "value"):
        raise ValueError(f"KV-cache role must be 'key' or 'value', got {role!r}")
    return _Marked(ctor, kv_role=role)


def _groups(dtype: torch.dtype) -> list[tuple[float, np.ndarray]]:
    """The rounding boundaries between consecutive float8 values (midpoints, in units of the
    scale), grouped by the gap between the two values: ``[(gap, ascending midpoints), ...]``.
    The grid is uniform within a binade, so there are a few dozen groups."""
    v = float8_values(dtype).numpy()
    gaps, mids = np.diff(v), (v[1:] + v[:-1]) / 2
    out = []
    for gap in np.unique(gaps):
        out.append((float(gap), mids[gaps == gap]))
    return out


_GROUPS: dict = {}


def _grouped(dtype):
    if dtype not in _GROUPS:
        _GROUPS[dtype] = _groups(dtype)
    return _GROUPS[dtype]


def _mse_part(table: rs.ErrorTable, scale: np.ndarray, dtype, covered: bool) -> np.ndarray:
    """``N·mse − Σx²`` of fake-quantizing the histogram onto the float8 grid times ``scale``.

    With levels ``ℓ_q`` (ascending), boundaries ``b_q`` between ``ℓ_q`` and ``ℓ_{q+1}`` (their
    midpoint: round to nearest) and ``I(x) = ∫_{-∞}^{x} F``: ``Σ(x − ℓ(x))² = Σ(x − ℓ_top)² −
    2·Σ_q (ℓ_{q+1} − ℓ_q)·I(b_q)`` (by parts; the end levels collect the clipped mass). The
    integer grid is the case of equal gaps (``_rangesearch._mse_part``)."""
    integral = np.zeros_like(scale)
    for gap, mids in _grouped(dtype):
        integral += gap * table.sum_integral(mids, scale, 0.0, covered)
    top = float8_max(dtype)
    # part = top² s² N − 2 top s t1 − 2 s ΣgapI
    return scale * (scale * (top * top * table.total) - 2 * top * table.t1 - 2 * integral)


def float8_mse(hist: np.ndarray, lo: float, hi: float, scale: np.ndarray, dtype) -> np.ndarray:
    """Expected mean squared error of fake-quantizing a histogram (``[n]`` counts over
    ``[lo, hi]``, uniform within bins) onto the float8 grid with each candidate ``scale``."""
    fmax = float8_max(dtype)
    s_max = float(np.max(scale))
    table = rs.ErrorTable(np.asarray(hist, np.float64), lo, hi, -fmax * s_max, fmax * s_max)
    err = _mse_part(table, np.asarray(scale, np.float64), dtype, False) + table.t2
    return np.maximum(err, 0) / max(table.total, 1)


def search_float8_range(h: np.ndarray, lo: float, hi: float, qp: dict, objective: str = "mse",
                        stages=None) -> tuple[float, float]:
    """The symmetric range ``[-t, t]`` whose FP8 scale ``t / float8_max`` minimises the expected
    squared error on the float8 grid (rounding + clipping), searched as
    :func:`quantkit.observers._rangesearch.search_range` searches integer grids: thresholds
    ``amax·(1 − j/GRID)``, coarse to fine (:data:`~._rangesearch.STAGES_1D`).

    Args:
        h: ``[n]`` float64 counts over ``[lo, hi]``.
        qp: the observer's settings (``dtype`` a float8 dtype, ``eps``); symmetric only.
    """
    if objective != "mse":
        raise ValueError(f"FP8 range search supports the 'mse' objective, got {objective!r}")
    dtype = underlying_dtype(qp["dtype"])
    fmax = float8_max(dtype)
    lo, hi = float(lo), float(hi)
    amax = max(-min(lo, 0.0), max(hi, 0.0))
    s_max = amax / fmax
    table = rs.ErrorTable(h, lo, hi, -fmax * s_max, fmax * s_max)
    if table.flat or amax == 0:
        return lo, hi
    eps = float(qp.get("eps", DEFAULT_EPS))
    covered = s_max >= eps and table.covers(-fmax * s_max, fmax * s_max)
    step = s_max / rs.GRID

    def err_at(j):
        s = s_max - step * j
        np.maximum(s, eps, out=s)
        return _mse_part(table, s, dtype, covered)

    best = rs._grid_search(err_at, None, 1, stages or rs.STAGES_1D)
    t = amax * (1 - int(best[0]) / rs.GRID)
    return -t, t
