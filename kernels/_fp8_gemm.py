"""Triton FP8 GEMM: E4M3 activations x E4M3 weights, float32 accumulation, scales in the epilogue.

``quantkit::fp8_linear(a[..., K], w[N, K], a_scale, w_scale, bias, out_dtype)`` computes
``(a @ w^T) * a_scale ⊗ w_scale + bias`` for ``float8_e4m3fn`` operands: ``a_scale`` one float32 per
tensor or per row (token), ``w_scale`` one per tensor or per output channel; output fp32 / bf16 / fp16.
It is what ``quantkit.compile``'s FP8 lowering can run on CUDA instead of ``torch._scaled_mm``
(``compile(..., fp8_kernel="triton")``): the same operands and scales, in any layout mix (per-token
activations with a per-tensor weight scale need no repeated scale tensors), with the bias added in fp32.

Each program loads ``[BLOCK_M, BLOCK_K]`` and ``[BLOCK_K, BLOCK_N]`` float8 tiles (the weight read
through its ``[N, K]`` strides: no transposed copy) and accumulates ``tl.dot`` in float32 (FP8 MMA on
sm_89+). Ragged M, N and K are masked (masked float8 loads are 0). On CPU the op dequantizes and runs
a float32 matmul; the tests run the Triton kernel itself on CPU tensors under ``TRITON_INTERPRET=1``
(triton 3.9's interpreter computes float8 ``tl.dot`` exactly: checked against float64 there).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ._int8_gemm import _config, tile_offsets

__all__ = ["fp8_linear", "FP8_OUT_DTYPES"]

FP8_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_E4M3 = torch.float8_e4m3fn
# interpreter tiles (CPU tensors under TRITON_INTERPRET=1): small, so tests cross M/N/K tile edges
_INTERPRET_META = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=4)


# FP8 wgmma/mma takes k=32 per instruction: BLOCK_K >= 64 (128 keeps two in flight per stage); sm90's
# 228 KB of shared memory per SM fits 128x256x128 tiles at 3-4 stages of 1-byte operands (the shapes
# follow Triton tutorial 03's FP8 configs and torch/_inductor/kernel/mm_common.py's persistent fp8
# configs); the small-BLOCK_M entries serve decode-sized M (1-64 tokens)
_CONFIGS = [
    _config(128, 256, 128, 3, 8), _config(256, 128, 128, 3, 8), _config(128, 128, 128, 4, 8),
    _config(128, 128, 64, 5, 4), _config(64, 256, 128, 4, 4), _config(64, 128, 128, 4, 4),
    _config(32, 128, 128, 4, 4), _config(16, 128, 256, 3, 4), _config(16, 64, 256, 4, 4),
]


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, w_ptr, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
    A_PER_ROW: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    offs_m, offs_n, offs_k, mask_m, mask_n = tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # w^T tile [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        acc = tl.dot(a, w, acc, out_dtype=tl.float32)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    if A_PER_ROW:
        sa = tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    else:
        sa = tl.load(a_scale_ptr)
    if W_PER_CHANNEL:
        sw = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    else:
        sw = tl.load(w_scale_ptr)
    acc = acc * sa * sw
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@functools.cache
def _autotuned():
    return triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "A_PER_ROW", "W_PER_CHANNEL"])(_fp8_gemm_kernel)


def _check(a, w, a_scale, w_scale, bias, out_dtype) -> None:
    if a.dtype != _E4M3 or w.dtype != _E4M3:
        raise TypeError(f"a and w must be float8_e4m3fn, got {a.dtype} and {w.dtype}")
    if w.dim() != 2 or a.dim() < 1:
        raise ValueError(f"w must be [N, K] and a [..., K], got {tuple(w.shape)} and {tuple(a.shape)}")
    n, k = w.shape
    if a.shape[-1] != k:
        raise ValueError(f"a has {a.shape[-1]} features but w has {k} (w is [N, K], an nn.Linear weight)")
    rows = a.numel() // k if k else 0
    for name, s, count, what in (("a_scale", a_scale, rows, "row of a"), ("w_scale", w_scale, n, "output channel")):
        if s.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {s.dtype}")
        if s.numel() not in (1, count):
            raise ValueError(f"{name} must have 1 element (per tensor) or {count} (one per {what}), got {s.numel()}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if out_dtype not in FP8_OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {[str(d) for d in FP8_OUT_DTYPES]}, got {out_dtype}")


def _launch(a2, w, a_scale, w_scale, bias, c2) -> None:
    """Run ``_fp8_gemm_kernel`` on ``a2[M, K]`` and ``w[N, K]`` into ``c2[M, N]`` (autotuned on CUDA;
    fixed small tiles for CPU tensors under ``TRITON_INTERPRET=1``); scales are flat float32."""
    m, k = a2.shape
    n = w.shape[0]
    args = (a2, w, c2, a_scale, w_scale, bias if bias is not None else w_scale, m, n, k,
            a2.stride(0), a2.stride(1), w.stride(0), w.stride(1), c2.stride(0), c2.stride(1))
    flags = dict(A_PER_ROW=a_scale.numel() != 1, W_PER_CHANNEL=w_scale.numel() != 1, HAS_BIAS=bias is not None)
    if a2.device.type == "cuda":
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        wrap_triton(_autotuned())[grid](*args, **flags)
    else:
        meta = _INTERPRET_META
        grid = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        wrap_triton(_fp8_gemm_kernel)[grid](*args, **flags, **meta)


@triton_op("quantkit::fp8_linear", mutates_args=())
def fp8_linear(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 linear: ``(a @ w^T) * a_scale ⊗ w_scale + bias`` with E4M3 operands, float32 accumulation.

    Args:
        a: ``float8_e4m3fn`` activations ``[..., K]``.
        w: ``float8_e4m3fn`` weight ``[N, K]`` (an ``nn.Linear`` weight, any strides).
        a_scale: float32, one element (per tensor) or one per row of ``a`` (per token, e.g. ``[..., 1]``).
        w_scale: float32, one element or ``N`` (per output channel, e.g. ``[N, 1]`` or ``[1, N]``).
        bias: ``[N]`` (added in float32) or None.
        out_dtype: float32, bfloat16 or float16.

    Returns:
        ``[..., N]`` of ``out_dtype``.

    Example:
        >>> y = torch.ops.quantkit.fp8_linear(xq, wq, sx, sw, bias, torch.bfloat16)
    """
    _check(a, w, a_scale, w_scale, bias, out_dtype)
    k, n = a.shape[-1], w.shape[0]
    a2 = a.reshape(-1, k)
    c2 = torch.empty((a2.shape[0], n), dtype=out_dtype, device=a.device)
    if a2.shape[0] and n:
        _launch(a2, w, a_scale.reshape(-1).contiguous(), w_scale.reshape(-1).contiguous(),
                None if bias is None else bias.contiguous(), c2)
    return c2.reshape(*a.shape[:-1], n)


@fp8_linear.register_fake
def _(a, w, a_scale, w_scale, bias=None, out_dtype=torch.float32):
    _check(a, w, a_scale, w_scale, bias, out_dtype)
    return a.new_empty((*a.shape[:-1], w.shape[0]), dtype=out_dtype)


@fp8_linear.register_kernel("cpu")
def _(a, w, a_scale, w_scale, bias=None, out_dtype=torch.float32):
    _check(a, w, a_scale, w_scale, bias, out_dtype)
    k, n = a.shape[-1], w.shape[0]
    a2 = a.reshape(-1, k).float()
    y = (a2 @ w.float().t()) * a_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).reshape(*a.shape[:-1], n)
