"""Triton W4A16 GEMM: float activations times int4 group-wise weights, dequantized in registers.

``quantkit::w4a16_linear(x[..., K], w_packed[N, K // 2], scale[N, G], zero_point[N, G],
group_size, signed, bias)`` (``G = ceil(K / g)``: a last group of the remainder) computes ``x @ W^T + bias``
with ``W[n, k] = (q[n, k] - zp[n, k // g]) * scale[n, k // g]``: the representation ``quantkit.convert`` stores (two 4-bit values per byte, element
``2i`` in the low nibble; unsigned ``[0, 15]`` or, with ``signed``, two's complement ``[-8, 7]``).

Each program loads a ``[BLOCK_K, BLOCK_N]`` tile of packed bytes, unpacks and dequantizes it in
registers to fp16/bf16 (the activations' dtype; float32 activations use bf16), and accumulates
``tl.dot`` in float32; the weights never exist in float in memory. Ragged M, N and K edges are masked.
On CPU the op dequantizes with ``quantkit._qmath`` and runs a float matmul (the same result up to
float rounding); the tests run the Triton kernel itself on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from quantkit import _qmath

__all__ = ["w4a16_linear"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# interpreter tiles (CPU tensors under TRITON_INTERPRET=1): small, so tests cross tile edges
_INTERPRET_META = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)


def _config(bm, bn, bk, stages, warps):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), num_stages=stages, num_warps=warps)


# decode-sized M (1-16 tokens) is memory bound: narrow M tiles, wide N/K tiles so each program
# streams a large weight tile (the shapes follow gpt-fast / torchao's int4 Triton configs); the
# larger-M entries serve prefill
_CONFIGS = [
    _config(16, 64, 128, 4, 4), _config(16, 128, 128, 4, 4), _config(16, 64, 256, 3, 4),
    _config(16, 32, 128, 4, 2), _config(32, 128, 64, 4, 4), _config(64, 128, 64, 3, 4),
    _config(128, 128, 64, 3, 8),
]


@triton.jit
def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_ym, stride_yn,
    GROUP_SIZE: tl.constexpr, SIGNED: tl.constexpr, HAS_BIAS: tl.constexpr, COMPUTE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=(offs_m[:, None] < M) & mask_k[None, :], other=0.0)
        wmask = mask_k[:, None] & (offs_n[None, :] < N)
        # [BLOCK_K, BLOCK_N] bytes: row k holds element k in its low (even k) or high (odd k) nibble
        packed = tl.load(w_ptr + offs_n[None, :] * stride_wn + (offs_k[:, None] // 2) * stride_wk,
                         mask=wmask, other=0).to(tl.int32)
        q = (packed >> ((offs_k[:, None] % 2) * 4)) & 0xF
        if SIGNED:
            q = tl.where(q >= 8, q - 16, q)
        g = offs_k[:, None] // GROUP_SIZE
        scale = tl.load(s_ptr + offs_n[None, :] * stride_sn + g * stride_sg, mask=wmask, other=0.0)
        zp = tl.load(z_ptr + offs_n[None, :] * stride_sn + g * stride_sg, mask=wmask, other=0).to(tl.int32)
        w = ((q - zp).to(tl.float32) * scale).to(COMPUTE)
        x = x.to(COMPUTE)
        if UPCAST_DOT:  # operands rounded to COMPUTE, multiplied in fp32 (interpreter: see _launch)
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), out_dtype=tl.float32)
        else:
            acc += tl.dot(x, w, out_dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, y,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@functools.cache
def _autotuned():
    return triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "GROUP_SIZE"])(_w4a16_kernel)


def _check(x, w_packed, scale, zero_point, group_size, bias) -> None:
    if x.dtype not in _FLOATS:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if w_packed.dtype != torch.uint8 or w_packed.dim() != 2:
        raise TypeError(f"w_packed must be a 2-D uint8 tensor (two int4 values per byte), got {w_packed.dtype} "
                        f"{tuple(w_packed.shape)}")
    n, k = w_packed.shape[0], w_packed.shape[1] * 2
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but w_packed holds {k} per row")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2, got {group_size}")
    groups = (n, _qmath.group_count(k, group_size))  # a last group of the remainder when it does not divide
    if tuple(scale.shape) != groups or tuple(zero_point.shape) != groups:
        raise ValueError(f"scale and zero_point must be {groups} (one per group), got {tuple(scale.shape)} and "
                         f"{tuple(zero_point.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")


def _launch(x2, w_packed, scale, zero_point, group_size, signed, bias, y2) -> None:
    """Run ``_w4a16_kernel`` on ``x2[M, K]`` into ``y2[M, N]`` (autotuned on CUDA; fixed small tiles
    for CPU tensors under ``TRITON_INTERPRET=1``)."""
    m, k = x2.shape
    n = w_packed.shape[0]
    compute = tl.float16 if x2.dtype == torch.float16 else tl.bfloat16
    args = (x2, w_packed, scale, zero_point, bias if bias is not None else scale, y2, m, n, k,
            x2.stride(0), x2.stride(1), w_packed.stride(0), w_packed.stride(1),
            scale.stride(0), scale.stride(1), y2.stride(0), y2.stride(1))
    # Triton 3's interpreter multiplies bf16 tl.dot operands as raw bits (measured: errors of 1e10), so on
    # CPU tensors bf16 operands are rounded to bf16 and multiplied in fp32: the same products, exact in fp32
    upcast = x2.device.type != "cuda" and compute == tl.bfloat16
    flags = dict(GROUP_SIZE=group_size, SIGNED=signed, HAS_BIAS=bias is not None, COMPUTE=compute,
                 UPCAST_DOT=upcast)
    if x2.device.type == "cuda":
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

        wrap_triton(_autotuned())[grid](*args, **flags)
    else:
        meta = _INTERPRET_META
        grid = (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))
        wrap_triton(_w4a16_kernel)[grid](*args, **flags, **meta)


@triton_op("quantkit::w4a16_linear", mutates_args=())
def w4a16_linear(x: torch.Tensor, w_packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                 group_size: int, signed: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only int4 linear: ``x @ dequantize(w)^T + bias`` with the weights dequantized in registers.

    Args:
        x: activations ``[..., K]`` (fp16 / bf16; float32 is computed in bf16 and returned as float32).
        w_packed: uint8 ``[N, K // 2]``, two int4 values per byte (:func:`quantkit._qmath.pack_int4`).
        scale: float32 ``[N, ceil(K / group_size)]``.
        zero_point: integer ``[N, ceil(K / group_size)]`` (int8 is how ``quantkit.convert`` stores them).
        group_size: input features per scale; when it does not divide K the last group holds the
            remainder (the kernel's ``k // GROUP_SIZE`` indexing needs nothing else).
        signed: values are two's complement ``[-8, 7]`` (else unsigned ``[0, 15]``).
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype.

    Example:
        >>> y = torch.ops.quantkit.w4a16_linear(x, packed, scale, zp, 128, False, None)
    """
    _check(x, w_packed, scale, zero_point, group_size, bias)
    k, n = x.shape[-1], w_packed.shape[0]
    x2 = x.reshape(-1, k)
    y2 = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _launch(x2, w_packed.contiguous(), scale.float().contiguous(), zero_point.contiguous(), group_size,
                signed, bias, y2)
    return y2.reshape(*x.shape[:-1], n)


@w4a16_linear.register_fake
def _(x, w_packed, scale, zero_point, group_size, signed, bias=None):
    _check(x, w_packed, scale, zero_point, group_size, bias)
    return x.new_empty((*x.shape[:-1], w_packed.shape[0]))


@w4a16_linear.register_kernel("cpu")
def _(x, w_packed, scale, zero_point, group_size, signed, bias=None):
    _check(x, w_packed, scale, zero_point, group_size, bias)
    q = _qmath.unpack_int4(w_packed, signed)
    lo, hi = (-8, 7) if signed else (0, 15)
    w = _qmath.dequantize_group(q, scale.float(), zero_point, lo, hi, q.dtype, group_size)
    y = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)
