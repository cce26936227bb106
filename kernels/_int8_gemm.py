"""Triton int8 x int8 -> int32 GEMM with a fused dequantize / bias / activation / requantize epilogue.

One kernel serves two ops:

* ``quantkit::int8_linear``: ``a[..., K] @ w[N, K]^T`` (an ``nn.Linear`` weight), activation
  scale per tensor or per row (token), weight scale per output channel, bias, relu/gelu,
  output fp32/fp16/bf16 or requantized int8/uint8.
* ``quantkit::int8_bmm``: batched ``a[..., M, K] @ b[..., K, N]`` for attention matmuls,
  both operands activations with per-tensor scale and zero point.

uint8 operands are shifted to int8 in registers (``x - 128``, exact) so ``tl.dot`` always sees
int8; the shift folds into the zero point, and zero points are corrected with row / column
sums accumulated in the same K loop: ``sum((a - za)(b - zb)) = sum(ab) - za*colsum(b)
- zb*rowsum(a) + K*za*zb``. Ragged M, N and K are masked, never padded.

On CUDA the ops run the autotuned Triton kernel; on CPU they run ``torch._int_mm`` plus the same
epilogue in torch, so they also work eagerly (and in the tests the Triton kernel itself is run on
CPU tensors through ``_launch`` under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from quantkit._qmath import default_qrange, quantize

__all__ = ["int8_linear", "int8_bmm", "ACTIVATIONS", "OUT_DTYPES"]

# epilogue activations, by name; the index is the kernel's ACTIVATION constexpr
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh")
OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8)
_FLOAT_OUT = (torch.float32, torch.float16, torch.bfloat16)
_TL_OUT = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
           torch.int8: tl.int8, torch.uint8: tl.uint8}

# tile sizes when the kernel runs under TRITON_INTERPRET=1 (CPU tensors): small, so the
# interpreter stays fast and the tests cross several M/N/K tile edges
_INTERPRET_META = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=4)


def _config(bm, bn, bk, stages, warps, group_m=8):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m),
                         num_stages=stages, num_warps=warps)


# Autotune spaces. int8 mma wants BLOCK_K >= 64 (k=32 per instruction, two per stage);
# sm90 has 228 KB of shared memory per SM, so deeper pipelines and 256-wide tiles fit
# (the shapes follow torch/_inductor/kernel/mm_common.py int8 configs and torchao's
# int8_mm.py); Ampere (sm80/86, 164/100 KB) gets the smaller ones. The small-BLOCK_M
# entries serve decode-sized M (16-64 rows) without wasting most of a 128-row tile.
_SM90_CONFIGS = [
    _config(128, 256, 128, 3, 8), _config(256, 128, 128, 3, 8), _config(128, 128, 128, 4, 8),
    _config(128, 128, 64, 5, 4), _config(64, 256, 128, 4, 4), _config(64, 128, 128, 4, 4),
    _config(32, 128, 128, 4, 4), _config(16, 128, 256, 3, 4), _config(16, 64, 256, 4, 4),
]
_AMPERE_CONFIGS = [
    _config(128, 256, 64, 3, 8), _config(256, 128, 64, 3, 8), _config(128, 128, 64, 4, 4),
    _config(128, 64, 64, 4, 4), _config(64, 128, 64, 4, 4), _config(64, 64, 128, 3, 4),
    _config(32, 64, 128, 4, 4), _config(16, 64, 128, 4, 4), _config(16, 32, 256, 3, 4),
]


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row, column) tile of program ``pid`` in grouped ordering: GROUP_M row tiles share the
    same weight columns while they are in L2 (the GEMM kernels' common launch order)."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (pid % width) % group_size, (pid % width) // group_size


@triton.jit
def tile_offsets(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """``(offs_m, offs_n, offs_k, mask_m, mask_n)`` of program ``pid``'s output tile (grouped order,
    :func:`grouped_tile`): its row and column indices, the first K block's indices, and which rows
    and columns lie inside M and N (the GEMM kernels' common prologue)."""
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    return offs_m, offs_n, offs_k, offs_m < M, offs_n < N


@triton.jit
def _round_half_even(x):
    # torch.round rounds half to even; libdevice.rint is not available in the interpreter
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _int8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, a_zp_ptr, b_zp_ptr, bias_ptr,
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    stride_asb, stride_asm, stride_bsn,
    out_inv_scale, out_zp,
    A_UNSIGNED: tl.constexpr, B_UNSIGNED: tl.constexpr,
    HAS_A_ZP: tl.constexpr, HAS_B_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, REQUANT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    batch = tl.program_id(1)
    offs_m, offs_n, offs_k, mask_m, mask_n = tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    a_ptrs = a_ptr + batch * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + batch * stride_bb + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    A_CORR: tl.constexpr = HAS_A_ZP or A_UNSIGNED
    B_CORR: tl.constexpr = HAS_B_ZP or B_UNSIGNED
    # masked-out uint8 elements load 128, which is 0 after the shift, so sums stay exact
    A_OTHER: tl.constexpr = 128 if A_UNSIGNED else 0
    B_OTHER: tl.constexpr = 128 if B_UNSIGNED else 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    a_rowsum = tl.zeros((BLOCK_M,), dtype=tl.int32)
    b_colsum = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=A_OTHER)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=B_OTHER)
        if A_UNSIGNED:
            a = (a.to(tl.int16) - 128).to(tl.int8)
        if B_UNSIGNED:
            b = (b.to(tl.int16) - 128).to(tl.int8)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        if B_CORR:
            a_rowsum += tl.sum(a.to(tl.int32), axis=1)
        if A_CORR:
            b_colsum += tl.sum(b.to(tl.int32), axis=0)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # zero points (per tensor), with the uint8 shift folded in
    za = 0
    zb = 0
    if HAS_A_ZP:
        za = tl.load(a_zp_ptr).to(tl.int32)
    if A_UNSIGNED:
        za = za - 128
    if HAS_B_ZP:
        zb = tl.load(b_zp_ptr).to(tl.int32)
    if B_UNSIGNED:
        zb = zb - 128
    if A_CORR:
        acc = acc - za * b_colsum[None, :]
    if B_CORR:
        acc = acc - zb * a_rowsum[:, None]
    if A_CORR and B_CORR:
        acc = acc + K * za * zb

    a_scale = tl.load(a_scale_ptr + batch * stride_asb + offs_m * stride_asm, mask=mask_m, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n * stride_bsn, mask=mask_n, other=0.0)
    y = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 1:
        y = tl.maximum(y, 0.0)
    elif ACTIVATION == 2:
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    elif ACTIVATION == 3:
        # tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        y = 0.5 * y * (1.0 + (2.0 * tl.sigmoid(2.0 * u) - 1.0))
    if REQUANT:
        y = _round_half_even(y * out_inv_scale) + out_zp
        y = tl.minimum(tl.maximum(y, QMIN), QMAX)
    c_ptrs = c_ptr + batch * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, y.to(OUT_DTYPE), mask=mask_m[:, None] & mask_n[None, :])


@functools.lru_cache(maxsize=None)
def _autotuned(capability: tuple[int, int]):
    """The autotuned kernel for one GPU generation (built on first use, not at import)."""
    configs = _SM90_CONFIGS if capability >= (9, 0) else _AMPERE_CONFIGS
    return triton.autotune(configs=configs, key=["M", "N", "K"])(_int8_gemm_kernel)


def _launch(a, b, c, a_scale, b_scale, a_zp, b_zp, bias, *, activation: str = "none",
            out_scale: float = 1.0, out_zp: int = 0) -> torch.Tensor:
    """Run ``_int8_gemm_kernel`` on 3-D views ``a[B, M, K]``, ``b[B, K, N]`` into ``c[B, M, N]``.

    ``a_scale`` has one entry, M (per row, shared by the batches) or B*M (per row of each
    batch, laid out ``[B, M]``); ``b_scale`` N entries or one. CUDA tensors use the autotuned
    kernel; CPU tensors need ``TRITON_INTERPRET=1`` and use small fixed tiles.
    """
    batch, m, k = a.shape
    n = b.shape[2]
    requant = c.dtype in (torch.int8, torch.uint8)
    qmin, qmax = default_qrange(c.dtype) if requant else (0, 0)
    dummy = a_scale  # stands in for absent optional pointers; never read
    args = (
        a, b, c, a_scale, b_scale,
        dummy if a_zp is None else a_zp, dummy if b_zp is None else b_zp, dummy if bias is None else bias,
        m, n, k,
        a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        m if a_scale.numel() == batch * m and batch > 1 else 0,
        0 if a_scale.numel() == 1 else 1, 0 if b_scale.numel() == 1 else 1,
        1.0 / out_scale, out_zp,
    )
    flags = dict(
        A_UNSIGNED=a.dtype == torch.uint8, B_UNSIGNED=b.dtype == torch.uint8,
        HAS_A_ZP=a_zp is not None, HAS_B_ZP=b_zp is not None, HAS_BIAS=bias is not None,
        ACTIVATION=ACTIVATIONS.index(activation), REQUANT=requant, QMIN=qmin, QMAX=qmax,
        OUT_DTYPE=_TL_OUT[c.dtype],
    )
    if a.device.type == "cuda":
        kernel = _autotuned(torch.cuda.get_device_capability(a.device))

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), batch)

        wrap_triton(kernel)[grid](*args, **flags)
    else:
        meta = _INTERPRET_META
        grid = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), batch)
        wrap_triton(_int8_gemm_kernel)[grid](*args, **flags, **meta)
    return c


# --- argument checks (shared by the real, CPU and fake implementations) -----------------------

def _check_int8(name: str, t: torch.Tensor, allow_uint8: bool = True) -> None:
    ok = (torch.int8, torch.uint8) if allow_uint8 else (torch.int8,)
    if t.dtype not in ok:
        raise TypeError(f"{name} must be {' or '.join(str(d) for d in ok)}, got {t.dtype}; quantize it first")


def _check_scale(name: str, s: torch.Tensor, allowed: tuple[int, ...], what: str) -> None:
    # float64 is accepted (choose_qparams_symmetric returns it) and read as float32
    if s.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be float32 (or float64), got {s.dtype}")
    if s.numel() not in allowed:
        raise ValueError(f"{name} has {s.numel()} elements; expected {what}")


def _check_zp(name: str, zp: torch.Tensor | None) -> None:
    if zp is not None and (zp.numel() != 1 or zp.is_floating_point()):
        raise ValueError(f"{name} must be an integer tensor with one element (per-tensor zero point)")


def _check_out(out_dtype: torch.dtype, allowed=OUT_DTYPES) -> None:
    if out_dtype not in allowed:
        raise ValueError(f"out_dtype {out_dtype} is not supported; use one of {list(allowed)}")


def _check_linear(a, a_scale, a_zero_point, w, w_scale, bias, activation, out_dtype, out_scale):
    _check_int8("a", a)
    _check_int8("w", w, allow_uint8=False)
    if a.dim() < 2 or w.dim() != 2:
        raise ValueError(f"int8_linear expects a[..., K] and w[N, K], got shapes {tuple(a.shape)} and {tuple(w.shape)}")
    if a.shape[-1] != w.shape[1]:
        raise ValueError(f"inner dimensions differ: a has K={a.shape[-1]}, w has K={w.shape[1]}")
    rows = a.numel() // a.shape[-1] if a.shape[-1] else 0
    _check_scale("a_scale", a_scale, (1, rows), f"1 (per tensor) or {rows} (per row)")
    _check_scale("w_scale", w_scale, (1, w.shape[0]), f"1 or {w.shape[0]} (per output channel)")
    _check_zp("a_zero_point", a_zero_point)
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.shape[0]):
        raise ValueError(f"bias must have shape ({w.shape[0]},), got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; use one of {list(ACTIVATIONS)}")
    _check_out(out_dtype)
    if out_dtype not in _FLOAT_OUT and not out_scale > 0:
        raise ValueError(f"out_scale must be > 0 to requantize to {out_dtype}, got {out_scale}")


def _check_bmm(a, a_scale, a_zero_point, b, b_scale, b_zero_point, out_dtype):
    _check_int8("a", a)
    _check_int8("b", b)
    if a.dim() < 3 or a.dim() != b.dim() or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(
            f"int8_bmm expects a[..., M, K] and b[..., K, N] with equal batch dims, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"inner dimensions differ: a has K={a.shape[-1]}, b has K={b.shape[-2]}")
    rows = a.numel() // a.shape[-1] if a.shape[-1] else 0
    _check_scale("a_scale", a_scale, (1, rows), f"1 (per tensor) or {rows} (per row of a)")
    _check_scale("b_scale", b_scale, (1,), "1 (per tensor)")
    _check_zp("a_zero_point", a_zero_point)
    _check_zp("b_zero_point", b_zero_point)
    _check_out(out_dtype, _FLOAT_OUT)


# --- ops -------------------------------------------------------------------------------------

@triton_op("quantkit::int8_linear", mutates_args=())
def int8_linear(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_zero_point: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    out_dtype: torch.dtype = torch.float32,
    out_scale: float = 1.0,
    out_zero_point: int = 0,
) -> torch.Tensor:
    """Quantized linear: ``act((a - za) @ w^T * a_scale * w_scale + bias)``, optionally requantized.

    Args:
        a: int8 or uint8 activations ``[..., K]``.
        a_scale: float32, one element (per tensor) or one per row of ``a`` (per token).
        a_zero_point: integer tensor with one element, or None for 0 (symmetric).
        w: int8 weight ``[N, K]`` (symmetric: zero point 0).
        w_scale: float32, ``[N]`` (per channel) or one element.
        bias: float ``[N]`` or None.
        activation: one of ``ACTIVATIONS`` ("none", "relu", "gelu", "gelu_tanh").
        out_dtype: fp32 / fp16 / bf16, or int8 / uint8 to requantize with
            ``clamp(round(y / out_scale) + out_zero_point)``.

    Returns:
        ``[..., N]`` tensor of ``out_dtype``.

    Example:
        >>> y = quantkit.kernels.int8_linear(qx, sx, None, qw, sw, b, "relu", torch.bfloat16)
    """
    _check_linear(a, a_scale, a_zero_point, w, w_scale, bias, activation, out_dtype, out_scale)
    k, n = a.shape[-1], w.shape[0]
    a2 = a.reshape(1, -1, k)
    c = torch.empty((1, a2.shape[1], n), dtype=out_dtype, device=a.device)
    _launch(a2, w.t().unsqueeze(0), c, a_scale.reshape(-1).float(), w_scale.reshape(-1).float(),
            a_zero_point, None, bias, activation=activation, out_scale=out_scale, out_zp=out_zero_point)
    return c.reshape(*a.shape[:-1], n)


@int8_linear.register_fake
def _(a, a_scale, a_zero_point, w, w_scale, bias=None, activation="none", out_dtype=torch.float32,
      out_scale=1.0, out_zero_point=0):
    _check_linear(a, a_scale, a_zero_point, w, w_scale, bias, activation, out_dtype, out_scale)
    return a.new_empty((*a.shape[:-1], w.shape[0]), dtype=out_dtype)


def _int_mm_corrected(a, b, za, zb):
    """``sum_k (a - za)(b - zb)`` for 2-D int8/uint8 ``a[M, K]``, ``b[K, N]`` via ``torch._int_mm``."""
    if a.dtype == torch.uint8:
        a, za = (a.to(torch.int16) - 128).to(torch.int8), za - 128
    if b.dtype == torch.uint8:
        b, zb = (b.to(torch.int16) - 128).to(torch.int8), zb - 128
    acc = torch._int_mm(a, b)
    if za:
        acc -= za * b.sum(0, dtype=torch.int32)[None, :]
    if zb:
        acc -= zb * a.sum(1, dtype=torch.int32)[:, None]
    if za and zb:
        acc += a.shape[1] * za * zb
    return acc


def _epilogue(acc, scale, bias, activation, out_dtype, out_scale, out_zp):
    y = acc.float() * scale
    if bias is not None:
        y = y + bias.float()
    if activation == "relu":
        y = torch.relu(y)
    elif activation in ("gelu", "gelu_tanh"):
        y = torch.nn.functional.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
    if out_dtype in _FLOAT_OUT:
        return y.to(out_dtype)
    qmin, qmax = default_qrange(out_dtype)
    return quantize(y, out_scale, out_zp, qmin, qmax, out_dtype)


@int8_linear.register_kernel("cpu")
def _(a, a_scale, a_zero_point, w, w_scale, bias=None, activation="none", out_dtype=torch.float32,
      out_scale=1.0, out_zero_point=0):
    _check_linear(a, a_scale, a_zero_point, w, w_scale, bias, activation, out_dtype, out_scale)
    k, n = a.shape[-1], w.shape[0]
    za = 0 if a_zero_point is None else int(a_zero_point)
    acc = _int_mm_corrected(a.reshape(-1, k), w.t(), za, 0)
    scale = a_scale.reshape(-1, 1).float() * w_scale.reshape(1, -1).float()
    y = _epilogue(acc, scale, bias, activation, out_dtype, out_scale, out_zero_point)
    return y.reshape(*a.shape[:-1], n)


@triton_op("quantkit::int8_bmm", mutates_args=())
def int8_bmm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_zero_point: torch.Tensor | None,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_zero_point: torch.Tensor | None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Batched quantized matmul ``((a - za) @ (b - zb)) * a_scale * b_scale`` (attention scores, att @ v).

    Args:
        a: int8/uint8 ``[..., M, K]``; b: int8/uint8 ``[..., K, N]`` with the same batch dims.
            Any strides (e.g. ``k.transpose(-2, -1)``): the kernel reads them in place.
        a_scale: float32, one element (per tensor) or one per row of ``a`` (per token:
            ``[..., M, 1]``); b_scale: float32, one element (per tensor).
        a_zero_point, b_zero_point: one-element integer tensors, or None for 0.
        out_dtype: fp32, fp16 or bf16.

    Returns:
        ``[..., M, N]`` tensor of ``out_dtype``.
    """
    _check_bmm(a, a_scale, a_zero_point, b, b_scale, b_zero_point, out_dtype)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    a3, b3 = a.reshape(-1, m, k), b.reshape(-1, k, n)
    c = torch.empty((a3.shape[0], m, n), dtype=out_dtype, device=a.device)
    _launch(a3, b3, c, a_scale.reshape(-1).float(), b_scale.reshape(-1).float(), a_zero_point, b_zero_point, None)
    return c.reshape(*a.shape[:-1], n)


@int8_bmm.register_fake
def _(a, a_scale, a_zero_point, b, b_scale, b_zero_point, out_dtype=torch.float32):
    _check_bmm(a, a_scale, a_zero_point, b, b_scale, b_zero_point, out_dtype)
    return a.new_empty((*a.shape[:-1], b.shape[-1]), dtype=out_dtype)


@int8_bmm.register_kernel("cpu")
def _(a, a_scale, a_zero_point, b, b_scale, b_zero_point, out_dtype=torch.float32):
    _check_bmm(a, a_scale, a_zero_point, b, b_scale, b_zero_point, out_dtype)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    a3, b3 = a.reshape(-1, m, k), b.reshape(-1, k, n)
    za = 0 if a_zero_point is None else int(a_zero_point)
    zb = 0 if b_zero_point is None else int(b_zero_point)
    acc = torch.stack([_int_mm_corrected(a3[i], b3[i], za, zb) for i in range(a3.shape[0])])
    scale = a_scale.float().reshape(-1, m, 1) if a_scale.numel() > 1 else a_scale.float().reshape(())
    y = _epilogue(acc, scale * b_scale.reshape(()).float(), None, "none", out_dtype, 1.0, 0)
    return y.reshape(*a.shape[:-1], n)
