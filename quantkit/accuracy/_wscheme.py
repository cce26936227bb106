"""WeightScheme: how a weight observer quantizes a linear weight, as the rounding algorithms
(GPTQ, AWQ) need it: group-wise or per-channel integer qparams and round-to-nearest (or NF4
codes, or the float8 E4M3/E5M2 grid with ``amax / float8_max`` scales)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._qmath import (NF4_VALUES, DEFAULT_EPS, FLOAT8_DTYPES, choose_qparams, dequantize_float8, fake_quantize,
                      float8_scale, is_symmetric, quantize_float8, underlying_dtype)

__all__ = ["WeightScheme", "WEIGHT_ALGORITHMS"]

# the values of QuantConfig(weight_algorithm=...) and of a weight observer's ``weight_algorithm``
WEIGHT_ALGORITHMS = ("rtn", "gptq", "awq")


@dataclass(frozen=True)
class WeightScheme:
    """Integer weight quantization of a ``[out_features, in_features]`` weight.

    Args:
        quant_min, quant_max: integer range.
        symmetric: symmetric (zero point fixed) or affine qparams.
        group_size: input features that share one scale; None: one scale per output row.
        dtype: integer dtype of the stored values (decides unsigned symmetric zero points).
        eps: smallest scale.
        customized_qrange: the range was given by the user (see ``_qmath.choose_qparams``).
        nf4: NF4 codes (QLoRA's table) with per-group absmax scales instead of integers.
        float8: the float8 grid of ``dtype`` (``float8_e4m3fn``/``float8_e5m2``) with scales
            ``amax / float8_max`` (``_qmath.float8_scale``) and ``_qmath.quantize_float8``'s
            rounding (nearest, ties to even, saturating); codes ``q`` are the stored bytes (0..255).
    """

    quant_min: int
    quant_max: int
    symmetric: bool
    group_size: int | None = None
    dtype: torch.dtype = torch.int8
    eps: float = DEFAULT_EPS
    customized_qrange: bool = False
    nf4: bool = False
    float8: bool = False

    def __post_init__(self) -> None:
        if not self.quant_min < self.quant_max:
            raise ValueError(f"quant_min must be below quant_max, got [{self.quant_min}, {self.quant_max}]")
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise ValueError(f"group_size must be a positive int or None, got {self.group_size!r}")
        if self.float8 and (self.dtype not in FLOAT8_DTYPES or not self.symmetric or self.nf4):
            raise ValueError(f"a float8 weight scheme is symmetric with a float8 dtype, got dtype {self.dtype}")

    @classmethod
    def of(cls, obs) -> "WeightScheme":
        """The scheme a weight observer declares (``quant_min``/``quant_max``, ``symmetric`` or
        its ``qscheme``, ``group_size``, ``dtype``, ``eps``)."""
        symmetric = getattr(obs, "symmetric", None)
        if symmetric is None:
            symmetric = is_symmetric(obs.qscheme)
        eps = getattr(obs, "eps", DEFAULT_EPS)
        group = getattr(obs, "group_size", None)
        return cls(
            quant_min=int(obs.quant_min), quant_max=int(obs.quant_max), symmetric=bool(symmetric),
            group_size=None if group is None or group <= 0 else int(group),
            dtype=underlying_dtype(getattr(obs, "dtype", torch.int8)),
            eps=float(eps.reshape(-1)[0]) if isinstance(eps, torch.Tensor) else float(eps),
            customized_qrange=bool(getattr(obs, "has_customized_qrange", False)),
            nf4=getattr(obs, "scheme", None) == "nf4",
            float8=bool(getattr(obs, "float8_rounding", False)),
        )

    def group(self, in_features: int) -> int:
        """Columns per group for a weight with ``in_features`` columns."""
        gs = self.group_size or in_features
        if in_features % gs:
            raise ValueError(f"group size {gs} does not divide the {in_features} input features")
        return gs

    def row_qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One ``(scale, zero_point)`` per row of ``w`` (``[N, k]``), from the row's min/max."""
        if self.float8:  # amax / float8_max, as the FP8 weight observers (symmetric)
            return float8_scale(w.abs().amax(1), self.dtype, self.eps), torch.zeros(w.shape[0], dtype=torch.int64)
        if self.nf4:  # absmax, as _qmath.nf4_scales
            return w.abs().amax(1).float().clamp(min=self.eps), torch.zeros(w.shape[0], dtype=torch.int64)
        qscheme = torch.per_channel_symmetric if self.symmetric else torch.per_channel_affine
        return choose_qparams(w.amin(1), w.amax(1), qscheme=qscheme, dtype=self.dtype, quant_min=self.quant_min,
                              quant_max=self.quant_max, eps=self.eps, customized_qrange=self.customized_qrange)

    def qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Round-to-nearest qparams of ``w`` (``[N, K]``): ``[N, K // group]`` scales and zero points."""
        n, k = w.shape
        gs = self.group(k)
        scale, zp = self.row_qparams(w.reshape(n * (k // gs), gs))
        return scale.reshape(n, k // gs), zp.reshape(n, k // gs)

    def fake_quantize(self, w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
        """``dequantize(quantize(w))`` with ``[N, G]`` qparams (the values convert stores)."""
        n, k = w.shape
        gs = self.group(k)
        flat = w.float().reshape(n * (k // gs), gs)
        if self.float8:
            s = scale.reshape(-1, 1).float()
            return dequantize_float8(quantize_float8(flat, s, self.dtype), s).reshape(n, k)
        if self.nf4:
            q, _ = self.round(flat, scale.reshape(-1, 1).float(), zero_point.reshape(-1, 1))
            return (self._table(w.device)[q] * scale.reshape(-1, 1).float()).reshape(n, k)
        out = fake_quantize(flat, scale.reshape(-1).float(), zero_point.reshape(-1), self.quant_min, self.quant_max,
                            self.dtype, axis=0)
        return out.reshape(n, k)

    def rtn(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` rounded to nearest with its own qparams."""
        return self.fake_quantize(w, *self.qparams(w))

    def _table(self, device) -> torch.Tensor:
        return torch.tensor(NF4_VALUES, dtype=torch.float32, device=device)

    def round(self, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, dequantized)`` of ``x`` for broadcastable qparams, in ``x``'s float dtype: integers
        ``clamp(round(x / scale) + zp)``, NF4 codes (the nearest table value, ties down), or float8
        bytes (``quantize_float8``, in float32)."""
        if self.float8:
            s = scale.float()
            q8 = quantize_float8(x.float(), s, self.dtype)
            return q8.view(torch.uint8).to(torch.int64), dequantize_float8(q8, s).to(x.dtype)
        if self.nf4:
            table = self._table(x.device).to(x.dtype)
            q = torch.bucketize(x / scale.to(x.dtype), (table[1:] + table[:-1]) / 2)
            return q, table[q] * scale.to(x.dtype)
        zp = zero_point.to(x.dtype)
        q = torch.clamp(torch.round(x / scale.to(x.dtype)) + zp, self.quant_min, self.quant_max)
        return q, (q - zp) * scale.to(x.dtype)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
        """Float32 weight from integers/codes ``q`` (``[N, K]``) and ``[N, G]`` qparams."""
        gs = q.shape[1] // scale.shape[1]
        s = scale.repeat_interleave(gs, dim=1).double()
        if self.float8:
            return (q.to(torch.uint8).view(self.dtype).double() * s).float()
        if self.nf4:
            return (self._table(q.device).double()[q.long()] * s).float()
        return ((q.double() - zero_point.repeat_interleave(gs, dim=1).double()) * s).float()
