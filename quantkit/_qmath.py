"""The one source of quantization math: ranges, qparams, quantize, dequantize, SQNR.

Observers, convert, the kernels' references and the tests all call these functions.
The formulas follow torchao's ``UniformQuantizationObserverBase._calculate_qparams``
operation for operation (float32 arithmetic, same rounding), so that quantkit's
observers give bit-identical qparams to torchao's.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# importing torchao registers the `quantized_decomposed` op library
import torchao.quantization.pt2e  # noqa: F401

__all__ = [
    "DEFAULT_EPS",
    "FLOAT8_DTYPES",
    "float8_max",
    "float8_values",
    "float8_scale",
    "quantize_float8",
    "dequantize_float8",
    "default_qrange",
    "is_symmetric",
    "is_per_channel",
    "symmetric_divisor",
    "symmetric_zero_point",
    "choose_qparams",
    "quantize",
    "dequantize",
    "fake_quantize",
    "fake_quantize_fused",
    "fake_quantize_per_token",
    "sqnr",
    "NF4_VALUES",
    "group_min_max",
    "choose_qparams_group",
    "quantize_group",
    "dequantize_group",
    "group_count",
    "expand_group_params",
    "nf4_scales",
    "DOUBLE_QUANT_BLOCK",
    "double_quantize_scales",
    "dequantize_scales",
    "quantize_nf4",
    "dequantize_nf4",
    "pack_int4",
    "unpack_int4",
]

# torch.finfo(torch.float32).eps, the floor torchao uses for scales
DEFAULT_EPS = torch.finfo(torch.float32).eps

_QRANGES = {
    torch.int8: (-128, 127),
    torch.qint8: (-128, 127),
    torch.uint8: (0, 255),
    torch.quint8: (0, 255),
    torch.int16: (-(2**15), 2**15 - 1),
    torch.uint16: (0, 2**16 - 1),
    torch.int32: (-(2**31), 2**31 - 1),
    torch.qint32: (-(2**31), 2**31 - 1),
    # float8: the finite range truncated to integers, as torch's quantized_decomposed ops
    # bound it (torch/ao/quantization/fx/_decomposed.py _DTYPE_TO_QVALUE_BOUNDS): +-448, +-57344
    torch.float8_e4m3fn: (int(torch.finfo(torch.float8_e4m3fn).min), int(torch.finfo(torch.float8_e4m3fn).max)),
    torch.float8_e5m2: (int(torch.finfo(torch.float8_e5m2).min), int(torch.finfo(torch.float8_e5m2).max)),
}

# float8 dtypes the quantized_decomposed ops accept (torchao's convert_pt2e SUPPORTED_QDTYPES)
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

_UNDERLYING = {torch.qint8: torch.int8, torch.quint8: torch.uint8, torch.qint32: torch.int32}


def underlying_dtype(dtype: torch.dtype) -> torch.dtype:
    """Map quantized dtypes (torch.quint8, ...) to their plain integer dtype."""
    return _UNDERLYING.get(dtype, dtype)


def default_qrange(dtype: torch.dtype) -> tuple[int, int]:
    """Full range of ``dtype``, e.g. (-128, 127) for int8, (-448, 448) for float8_e4m3fn.

    Raises:
        ValueError: for a dtype that is not a quantization dtype.
    """
    if dtype not in _QRANGES:
        raise ValueError(
            f"unsupported quantization dtype {dtype}; use one of torch.int8, torch.uint8, torch.int16, torch.int32, "
            "torch.float8_e4m3fn, torch.float8_e5m2"
        )
    return _QRANGES[dtype]


def is_symmetric(qscheme: torch.qscheme) -> bool:
    return qscheme in (torch.per_tensor_symmetric, torch.per_channel_symmetric)


def is_per_channel(qscheme: torch.qscheme) -> bool:
    return qscheme in (
        torch.per_channel_symmetric,
        torch.per_channel_affine,
        torch.per_channel_affine_float_qparams,
    )


def symmetric_divisor(quant_min: int, quant_max: int) -> float:
    """Symmetric schemes map ``[-amax, amax]`` with ``scale = amax / symmetric_divisor``
    (half the integer range, as torchao)."""
    return float(quant_max - quant_min) / 2


def symmetric_zero_point(dtype: torch.dtype, quant_min: int, quant_max: int,
                         customized_qrange: bool = False) -> int:
    """Zero point of a symmetric scheme: 0 for signed types, the middle of the range for
    unsigned ones (128 for uint8 unless the range was customised, 2^15 for uint16)."""
    if dtype in (torch.quint8, torch.uint8):
        return (quant_min + quant_max) // 2 if customized_qrange else 128
    if dtype == torch.uint16:
        return 2**15
    return 0


_PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)


def _f32(x: float) -> float:
    return float(np.float32(x))


def _choose_qparams_scalar(min_val, max_val, qscheme, dtype, quant_min, quant_max, eps, customized_qrange):
    """:func:`choose_qparams` for one CPU range, in Python floats rounded to float32
    after every operation, so the result is bit-identical to the tensor formula (one
    rounding of the exact float64 result is the float32 result for +, -, / and max:
    53 >= 2*24 + 2 bits). A third of the tensor path's cost, which is ~15 small ops.
    Returns None where that argument does not hold and the caller uses the tensors."""
    if isinstance(min_val, torch.Tensor) and (min_val.numel() != 1 or min_val.device.type != "cpu"):
        return None
    if isinstance(max_val, torch.Tensor) and (max_val.numel() != 1 or max_val.device.type != "cpu"):
        return None
    if quant_max - quant_min > 2**16 or (
            isinstance(eps, torch.Tensor) and (eps.numel() != 1 or eps.device.type != "cpu")):
        return None
    lo, hi, floor = _f32(float(min_val)), _f32(float(max_val)), _f32(float(eps))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    neg, pos = min(lo, 0.0), max(hi, 0.0)
    if qscheme == torch.per_tensor_symmetric:
        scale = max(_f32(max(-neg, pos) / symmetric_divisor(quant_min, quant_max)), floor)
        zero_point = symmetric_zero_point(dtype, quant_min, quant_max, customized_qrange)
    else:
        scale = max(_f32(_f32(pos - neg) / _f32(float(quant_max - quant_min))), floor)
        zero_point = quant_min - round(_f32(neg / scale))  # round half to even, as torch.round
        zero_point = min(max(zero_point, quant_min), quant_max)
    # from_numpy: a third of torch.tensor's cost
    return torch.from_numpy(np.array([scale], np.float32)), torch.from_numpy(np.array([zero_point], np.int64))


def choose_qparams(
    min_val: torch.Tensor | float,
    max_val: torch.Tensor | float,
    *,
    qscheme: torch.qscheme,
    dtype: torch.dtype,
    quant_min: int,
    quant_max: int,
    eps: float | torch.Tensor = DEFAULT_EPS,
    customized_qrange: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point that map ``[min_val, max_val]`` onto ``[quant_min, quant_max]``.

    The range is always widened to include 0, so that 0.0 is exactly representable.
    A constant or all-zero tensor never gets a zero scale: scales are floored at ``eps``.

    Args:
        min_val, max_val: observed minimum and maximum: tensors (scalars, or one per
            channel), or Python floats for a per-tensor scheme.
        qscheme: torch.per_tensor_affine / per_tensor_symmetric / per_channel_*.
        dtype: target integer dtype; decides the symmetric zero point for unsigned types.
        quant_min, quant_max: integer range.
        eps: smallest allowed scale.
        customized_qrange: the range was given by the user (symmetric unsigned types
            then use the range's midpoint as the zero point, as torchao does).

    Returns:
        ``(scale, zero_point)``: float32 and int64 tensors of shape ``[1]`` (per tensor)
        or ``[C]`` (per channel).
    """
    if qscheme in _PER_TENSOR:
        fast = _choose_qparams_scalar(min_val, max_val, qscheme, dtype, quant_min, quant_max, eps,
                                      customized_qrange)
        if fast is not None:
            return fast
    if not isinstance(min_val, torch.Tensor):
        min_val, max_val = torch.tensor(float(min_val)), torch.tensor(float(max_val))
    min_val = min_val.detach().float()
    max_val = max_val.detach().float()
    device = min_val.device
    if not isinstance(eps, torch.Tensor):
        eps = torch.tensor([eps], dtype=torch.float32, device=device)
    eps = eps.to(device)
    min_val_neg = torch.min(min_val, torch.zeros_like(min_val))
    max_val_pos = torch.max(max_val, torch.zeros_like(max_val))
    zero_point = torch.zeros(min_val_neg.size(), dtype=torch.int64, device=device)
    if is_symmetric(qscheme):
        max_val_pos = torch.max(-min_val_neg, max_val_pos)
        scale = max_val_pos / symmetric_divisor(quant_min, quant_max)
        scale = torch.max(scale, eps)
        mid = symmetric_zero_point(dtype, quant_min, quant_max, customized_qrange)
        if mid:
            zero_point = zero_point.new_full(zero_point.size(), mid)
    elif qscheme == torch.per_channel_affine_float_qparams:
        scale = (max_val - min_val) / float(quant_max - quant_min)
        scale = torch.where(scale > eps, scale, torch.ones_like(scale))
        zero_point = -1 * min_val / scale
    else:
        scale = (max_val_pos - min_val_neg) / float(quant_max - quant_min)
        scale = torch.max(scale, eps)
        zero_point = quant_min - torch.round(min_val_neg / scale).to(torch.int)
        zero_point = torch.clamp(zero_point, quant_min, quant_max).to(torch.int64)
    if scale.dim() == 0:
        scale = scale.reshape(1)
    if zero_point.dim() == 0:
        zero_point = zero_point.reshape(1)
    return scale.to(torch.float32), zero_point


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    zero_point: torch.Tensor | int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
    axis: int | None = None,
) -> torch.Tensor:
    """Quantize ``x`` exactly as the ``quantized_decomposed`` graph ops do.

    Per tensor when ``axis`` is None (scale/zero_point scalars), otherwise per channel
    along ``axis``. For a float8 ``dtype`` the ops' arithmetic is the integer one
    (``clamp(round(x / scale) + zero_point, quant_min, quant_max)``, rounded to integers
    before the cast) followed by a round-to-nearest cast to float8, as torch's
    ``quantized_decomposed`` ops and hence torchao's ``convert_pt2e`` compute it.
    """
    dtype = underlying_dtype(dtype)
    ops = torch.ops.quantized_decomposed
    if axis is None:
        return ops.quantize_per_tensor.default(
            x, float(scale), int(zero_point), quant_min, quant_max, dtype
        )
    return ops.quantize_per_channel.default(
        x, scale, zero_point, axis, quant_min, quant_max, dtype
    )


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor | float,
    zero_point: torch.Tensor | int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
    axis: int | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize` (to float32)."""
    dtype = underlying_dtype(dtype)
    ops = torch.ops.quantized_decomposed
    if axis is None:
        return ops.dequantize_per_tensor.default(
            q, float(scale), int(zero_point), quant_min, quant_max, dtype
        )
    return ops.dequantize_per_channel.default(
        q, scale, zero_point, axis, quant_min, quant_max, dtype
    )


def float8_max(dtype: torch.dtype) -> float:
    """Largest finite value of a float8 dtype: 448 (``float8_e4m3fn``), 57344 (``float8_e5m2``)."""
    if dtype not in FLOAT8_DTYPES:
        raise ValueError(f"unsupported float8 dtype {dtype}; use torch.float8_e4m3fn or torch.float8_e5m2")
    return float(torch.finfo(dtype).max)


def float8_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a float8 dtype, ascending, as float64 (253 for e4m3fn, 247 for e5m2;
    -0 and +0 are one value): the grid that FP8 rounding maps onto."""
    float8_max(dtype)  # checks the dtype
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).double()
    return torch.unique(every[torch.isfinite(every)])  # sorted


def float8_scale(amax: torch.Tensor | float, dtype: torch.dtype = torch.float8_e4m3fn,
                 eps: float = DEFAULT_EPS) -> torch.Tensor:
    """FP8 scale of a symmetric range ``[-amax, amax]``: ``amax / float8_max(dtype)`` in float32,
    floored at ``eps`` (an all-zero tensor gets no zero scale). The same value
    :func:`choose_qparams` gives a ``per_*_symmetric`` float8 scheme with the range ``+-max``.
    Returns a float32 tensor shaped like ``amax`` (``[1]`` for a number)."""
    amax = torch.as_tensor(amax, dtype=torch.float32).detach().float()
    if amax.dim() == 0:
        amax = amax.reshape(1)
    return torch.clamp(amax.abs() / float8_max(dtype), min=eps)


def quantize_float8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Round ``x / scale`` (float32) to the nearest float8 value (ties to even), saturating at
    ``+-float8_max``: torchao's ``quantize_affine_float8_non_decomposed``, the op FP8 graphs
    carry. ``scale`` broadcasts against ``x`` (``[1]``, ``[N, 1]`` per channel, ``[..., 1]`` per token).
    Unlike the ``quantized_decomposed`` ops with a float8 dtype, nothing is rounded to an
    integer first."""
    return torch.ops.torchao.quantize_affine_float8_non_decomposed.default(x, scale, dtype)


def dequantize_float8(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_float8`: ``q * scale`` in float32, cast to ``out_dtype``."""
    return torch.ops.torchao.dequantize_affine_float8_non_decomposed.default(q, scale, out_dtype)


def fake_quantize(x, scale, zero_point, quant_min, quant_max, dtype, axis=None) -> torch.Tensor:
    """``dequantize(quantize(x))``: the value the int8 graph computes with."""
    return dequantize(
        quantize(x, scale, zero_point, quant_min, quant_max, dtype, axis),
        scale, zero_point, quant_min, quant_max, dtype, axis,
    )


def fake_quantize_fused(x: torch.Tensor, inv_scale: float, scale: float, zero_point: int, quant_min: int,
                        quant_max: int) -> torch.Tensor:
    """``dequantize_per_tensor(quantize_per_tensor(x))`` (float32, 8-bit integers) in one buffer and
    four passes: the values of ``(clamp(round(x * (1/s)) + zp, qmin, qmax) - zp) * s`` without the
    integer tensor in between (``inv_scale`` is ``1.0 / scale``, as the op computes it).
    ``r = round(x * (1/s))`` is clamped to ``[qmin - zp, qmax - zp]`` directly: for ``|r| < 2**24``
    adding and subtracting the integer ``zp`` is exact in float32, and a larger ``|r|`` lies beyond
    both bounds either way, so every value is equal (``==``); only a small negative input that
    rounds to zero keeps the sign, ``-0.0``, which no sum, product or norm downstream can tell from
    ``0.0``. (NaN stays NaN, where the integer tensor would hold some integer: a search scores a
    non-finite output as failing either way.)"""
    t = torch.mul(x, inv_scale)
    return t.round_().clamp_(quant_min - zero_point, quant_max - zero_point).mul_(scale)


# choose_qparams_per_token's floor on a row's absolute maximum, and its divisor (int8 only)
_PER_TOKEN_AMAX_FLOOR, _PER_TOKEN_DIVISOR = 1e-5, 127


def fake_quantize_per_token(x: torch.Tensor, quant_min: int = -128, quant_max: int = 127) -> torch.Tensor:
    """``dequantize_per_token(quantize_per_token(x, *choose_qparams_per_token(x, int8)))`` for float32
    ``x``, in four passes over ``x`` and no integer tensor: each row (last dimension) is scaled by
    ``s = max(amax, 1e-5) / 127``, rounded, clamped to ``[quant_min, quant_max]`` and scaled back.
    The same float32 operations as the ``quantized_decomposed`` ops on the same values (they compute
    ``x * (1/s) + 0``, round, clamp, cast, ``- 0``, ``* s``: the zero point is 0 and the cast exact), so
    every value is equal (``==``); only a negative input that rounds to zero keeps the sign,
    ``-0.0``, as in :func:`fake_quantize_fused`."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=_PER_TOKEN_AMAX_FLOOR).div(_PER_TOKEN_DIVISOR)
    t = x.mul(1.0 / scale)
    return t.round_().clamp_(quant_min, quant_max).mul_(scale)


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20·log10(‖ref‖ / ‖ref − approx‖).

    Computed in float64. Returns ``inf`` when the two are identical.
    """
    ref = reference.detach().double()
    err = (ref - approx.detach().double()).norm()
    if err == 0:
        return float("inf")
    return float(20 * torch.log10(ref.norm() / err))


# --- group-wise weights (int4 / int8 weight-only) and NF4 --------------------------------------
# NF4 (QLoRA, Dettmers et al. 2023, appendix E; bitsandbytes' NF4 code book): the 16 quantiles of
# N(0, 1) normalised to [-1, 1] with an exact 0; codes are indices into this ascending table.
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def group_count(in_features: int, group_size: int) -> int:
    """Groups of ``group_size`` along ``in_features``, the last one holding the remainder when the
    size does not divide (576 features in groups of 128: 4 full groups and one of 64, so 5)."""
    return -(-int(in_features) // int(group_size))


def _check_2d(w: torch.Tensor, group_size: int) -> None:
    if w.dim() != 2 or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group-wise quantization needs a 2-D weight and a group size >= 1, got shape "
                         f"{tuple(w.shape)} and group_size={group_size!r}")


def _padded(w: torch.Tensor, group_size: int, mode: str = "zeros") -> torch.Tensor:
    """``w`` ``[N, K]`` widened along K to whole groups: ``[N, G * group_size]``. ``mode="edge"``
    repeats the last column (min, max and absmax of the remainder group unchanged); ``"zeros"``
    pads with 0 (for element-wise work whose padded results are sliced off)."""
    _check_2d(w, group_size)
    k = w.shape[1]
    pad = group_count(k, group_size) * group_size - k
    if pad == 0:
        return w
    if mode == "edge":
        return torch.cat([w, w[:, -1:].expand(w.shape[0], pad)], dim=1)
    return torch.cat([w, w.new_zeros(w.shape[0], pad)], dim=1)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N, G, group_size]`` view of the edge-padded ``w`` (the remainder group keeps its own range)."""
    p = _padded(w, group_size, "edge")
    return p.reshape(p.shape[0], p.shape[1] // group_size, group_size)


def group_min_max(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimum and maximum of each group of ``group_size`` consecutive input features of the
    ``[N, K]`` weight ``w``: two float32 ``[N, G]`` tensors, ``G = group_count(K, group_size)``
    (a last group of the remainder when the size does not divide K)."""
    g = _grouped(w.detach().float(), group_size)
    return g.amin(-1), g.amax(-1)


def choose_qparams_group(min_val: torch.Tensor, max_val: torch.Tensor, *, quant_min: int, quant_max: int,
                         symmetric: bool, dtype: torch.dtype = torch.int8,
                         eps: float | torch.Tensor = DEFAULT_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of every group (shapes of ``min_val``, e.g. ``[N, G]``):
    :func:`choose_qparams`' per-channel formula applied to each group's range.

    Returns:
        ``(scale float32, zero_point int8)``; the zero points fit int8 for every 4- and 8-bit range
        (``[0, 15]``, ``[-8, 7]``, ``[-128, 127]``) and are stored that small in artifacts.
    """
    qscheme = torch.per_channel_symmetric if symmetric else torch.per_channel_affine
    scale, zp = choose_qparams(min_val, max_val, qscheme=qscheme, dtype=dtype, quant_min=quant_min,
                               quant_max=quant_max, eps=eps, customized_qrange=True)
    return scale.reshape(min_val.shape), zp.reshape(min_val.shape).to(torch.int8)


def quantize_group(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int,
                   quant_max: int, dtype: torch.dtype, group_size: int) -> torch.Tensor:
    """Quantize the ``[N, K]`` weight ``w`` group-wise exactly as the graph op
    ``quantized_decomposed.quantize_per_channel_group`` does (``scale``/``zero_point``: one per group,
    ``[N, G]``). A remainder group is computed by the same op on ``w`` padded to whole groups, the
    padding sliced off: each element's arithmetic is the op's."""
    k = w.shape[-1]
    q = torch.ops.quantized_decomposed.quantize_per_channel_group.default(
        _padded(w, group_size), scale, zero_point, quant_min, quant_max, underlying_dtype(dtype), group_size)
    return q if q.shape[-1] == k else q[:, :k].contiguous()


def dequantize_group(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, quant_min: int,
                     quant_max: int, dtype: torch.dtype, group_size: int,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_group`: ``(q - zero_point) * scale`` per group, as
    ``quantized_decomposed.dequantize_per_channel_group`` (a remainder group as in :func:`quantize_group`)."""
    k = q.shape[-1]
    w = torch.ops.quantized_decomposed.dequantize_per_channel_group.default(
        _padded(q, group_size), scale, zero_point, quant_min, quant_max, underlying_dtype(dtype), group_size,
        out_dtype)
    return w if w.shape[-1] == k else w[:, :k].contiguous()


def expand_group_params(t: torch.Tensor, in_features: int, group_size: int, fine: int) -> torch.Tensor:
    """Per-group ``t`` ``[N, G]`` repeated onto groups of ``fine`` (a size dividing both ``group_size``
    and ``in_features``): ``[N, in_features // fine]``. A group of 128 is two of 64 with the same
    scale, so a remainder layout (576 = 4 x 128 + 64) is exactly a regular one of 64 (5 -> 9 columns)."""
    if group_size % fine or in_features % fine:
        raise ValueError(f"group size {fine} must divide group_size={group_size} and {in_features} features")
    n_groups = group_count(in_features, group_size)
    reps = torch.full((n_groups,), group_size // fine, dtype=torch.int64)
    reps[-1] = (in_features - (n_groups - 1) * group_size) // fine
    return t.reshape(t.shape[0], n_groups).repeat_interleave(reps.to(t.device), dim=1).contiguous()


def nf4_scales(w: torch.Tensor, group_size: int, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """NF4's per-group absmax scales of the ``[N, K]`` weight ``w`` (float32 ``[N, G]``, a remainder
    group of its own), floored at ``eps`` so an all-zero group gets no zero scale."""
    return _grouped(w.detach().float(), group_size).abs().amax(-1).clamp(min=eps)


def quantize_nf4(w: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """NF4 codes (uint8 in ``[0, 15]``) of ``w``: per group, the index of the table value
    nearest ``w / absmax`` (an exact tie goes to the lower value)."""
    table = torch.tensor(NF4_VALUES, dtype=torch.float32, device=w.device)
    n, k = w.shape
    x = _grouped(w.detach().float(), group_size) / scale.reshape(n, -1, 1)
    codes = torch.bucketize(x, (table[1:] + table[:-1]) / 2)
    return codes.to(torch.uint8).reshape(n, -1)[:, :k].contiguous()


def dequantize_nf4(codes: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, group_size: int,
                   out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``table[codes] * scale`` per group (a table look-up), cast to ``out_dtype``."""
    n, k = codes.shape
    values = _padded(table.float()[codes.long()], group_size)
    values = values.reshape(n, -1, group_size) * scale.float().reshape(n, -1, 1)
    return values.reshape(n, -1)[:, :k].to(out_dtype)


# --- NF4 double quantization (QLoRA, Dettmers et al. 2023, section 3) ------------------------------
# QLoRA quantizes the fp32 absmax scales c2 a second time "with 8-bit Floats with a blocksize of 256",
# after subtracting their mean ("since the c2 are positive, we subtract the mean from c2 before
# quantization to center the values around zero and make use of symmetric quantization"). Here: the
# mean (one fp32 offset per weight), then blocks of 256 consecutive scales (row-major over [N, G]),
# each divided by its own fp32 block scale absmax / 448 and rounded to float8_e4m3fn (nearest, ties
# to even). Dequantized: fp8 * block_scale + offset, in float32.
DOUBLE_QUANT_BLOCK = 256
_DQ_FP8 = torch.float8_e4m3fn


def double_quantize_scales(scale: torch.Tensor, block_size: int = DOUBLE_QUANT_BLOCK,
                           eps: float = DEFAULT_EPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QLoRA's double quantization of NF4's fp32 absmax ``scale`` (any shape, e.g. ``[N, G]``).

    Returns:
        ``(codes, block_scale, offset)``: float8_e4m3fn codes shaped like ``scale``, float32
        ``[ceil(scale.numel() / block_size)]`` block scales (floored at ``eps``) and the float32
        ``[1]`` mean that was subtracted (computed in float64, rounded once).
    """
    s = scale.detach().float()
    flat = s.reshape(-1)
    offset = flat.double().mean().float().reshape(1)
    centred = flat - offset
    blocks = group_count(flat.numel(), block_size)
    padded = torch.cat([centred, centred.new_zeros(blocks * block_size - flat.numel())]).reshape(blocks, block_size)
    block_scale = (padded.abs().amax(-1) / float8_max(_DQ_FP8)).clamp(min=eps)
    x = (padded / block_scale[:, None]).clamp(-float8_max(_DQ_FP8), float8_max(_DQ_FP8))
    codes = x.to(_DQ_FP8).reshape(-1)[:flat.numel()].reshape(s.shape)
    return codes, block_scale, offset


def dequantize_scales(codes: torch.Tensor, block_scale: torch.Tensor, offset: torch.Tensor,
                      block_size: int = DOUBLE_QUANT_BLOCK) -> torch.Tensor:
    """Inverse of :func:`double_quantize_scales`: ``float(codes) * block_scale + offset`` (float32,
    shaped like ``codes``): the NF4 scales a double-quantized weight is dequantized with."""
    flat = codes.float().reshape(-1)
    per = block_scale.float().repeat_interleave(block_size)[:flat.numel()]
    return (flat * per + offset.float().reshape(())).reshape(codes.shape)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit integers (int8 in ``[-8, 7]`` or uint8 in ``[0, 15]``), two per byte along the
    last dimension (even), into uint8: element ``2i`` in the low nibble, ``2i + 1`` in the high one."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dimension, got shape {tuple(q.shape)}")
    nib = q.to(torch.int16) & 0xF  # two's complement nibble for negative values
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, signed: bool) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int8 in ``[-8, 7]`` (``signed``) or uint8 in ``[0, 15]``."""
    # uint8 throughout (no wider temporaries): 4-5x faster than through int16 on a 4096 x 4096 weight
    nib = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    if signed:  # sign-extend the nibble: move it to the top of an int8, shift back arithmetically
        return (nib.view(torch.int8) << 4) >> 4
    return nib
