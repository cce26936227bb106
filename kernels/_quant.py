"""Fused per-token dynamic quantization: absmax -> scale -> int8 in one kernel.

Per row of ``x[..., K]``: ``scale = max(absmax / 127.5, eps)`` and
``q = clamp(round(x * (1 / scale)), -128, 127)`` -- the formulas of
``quantkit._qmath.choose_qparams`` (symmetric int8) and ``quantize``, row by row, so the
result equals ``quantize_per_tensor`` applied to each row with its own scale.

``quantize_per_token(x, **DECOMPOSED)`` instead reproduces the pair of graph ops
``quantized_decomposed.choose_qparams_per_token`` + ``quantize_per_token`` (``scale =
max(absmax, 1e-5) / 127``) that ``quantkit.convert`` emits for per-token layers; the CUDA
lowering replaces that pair with this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from quantkit._qmath import DEFAULT_EPS, choose_qparams, quantize

from ._int8_gemm import _round_half_even

__all__ = ["quantize_per_token", "DECOMPOSED"]

# arguments that make quantize_per_token match torch's quantized_decomposed per-token ops:
# scale = clamp(absmax, min=1e-5) / 127; eps is then below every scale, so it never binds
DECOMPOSED = {"eps": 1e-5 / 127 / 2, "divisor": 127.0, "amax_floor": 1e-5}

# rows up to this length are read once (kept in registers between the absmax and the
# quantize step); longer rows are streamed twice in BLOCK_K chunks
_MAX_SINGLE_PASS_K = 8192


@triton.jit
def _quantize_per_token_kernel(
    x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, eps, divisor, amax_floor,
    BLOCK_K: tl.constexpr, SINGLE_PASS: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    if SINGLE_PASS:
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        amax = 0.0
        for k in range(0, K, BLOCK_K):
            x = tl.load(x_row + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    # symmetric int8: divisor (quant_max - quant_min) / 2 = 127.5 by default
    scale = tl.maximum(tl.maximum(amax, amax_floor) / divisor, eps)
    inv = 1.0 / scale
    tl.store(scale_ptr + row, scale)
    if SINGLE_PASS:
        q = tl.minimum(tl.maximum(_round_half_even(x * inv), -128.0), 127.0)
        tl.store(q_row + offs, q.to(tl.int8), mask=offs < K)
    else:
        for k in range(0, K, BLOCK_K):
            x = tl.load(x_row + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(_round_half_even(x * inv), -128.0), 127.0)
            tl.store(q_row + k + offs, q.to(tl.int8), mask=k + offs < K)


def _check(x: torch.Tensor, eps: float, divisor: float, amax_floor: float) -> None:
    if not x.is_floating_point():
        raise TypeError(f"quantize_per_token expects a floating point tensor, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"quantize_per_token expects x[..., K] with K > 0, got shape {tuple(x.shape)}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if not divisor > 0 or not amax_floor >= 0:
        raise ValueError(f"divisor must be > 0 and amax_floor >= 0, got {divisor} and {amax_floor}")


@triton_op("quantkit::quantize_per_token", mutates_args=())
def quantize_per_token(x: torch.Tensor, eps: float = DEFAULT_EPS, divisor: float = 127.5,
                       amax_floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one scale per row (token) of ``x[..., K]``.

    Per row, ``scale = max(max(absmax, amax_floor) / divisor, eps)``.

    Args:
        x: float tensor (fp32/fp16/bf16); rows are the last dimension.
        eps: smallest scale (default float32 eps, as ``choose_qparams``).
        divisor, amax_floor: 127.5 and 0 give ``choose_qparams``'s symmetric int8 scale;
            ``**DECOMPOSED`` gives ``quantized_decomposed.choose_qparams_per_token``'s.

    Returns:
        ``(q, scale)``: int8 ``[..., K]`` and float32 ``[..., 1]``; ``q * scale`` approximates ``x``.

    Example:
        >>> q, s = quantkit.kernels.quantize_per_token(x)
        >>> y = quantkit.kernels.int8_linear(q, s, None, qw, sw)
    """
    _check(x, eps, divisor, amax_floor)
    return _launch(x, eps, divisor, amax_floor)


def _launch(x: torch.Tensor, eps: float = DEFAULT_EPS, divisor: float = 127.5,
            amax_floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``_quantize_per_token_kernel`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = torch.empty(x2.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)
    single = k <= _MAX_SINGLE_PASS_K
    block = triton.next_power_of_2(k) if single else 2048
    if x2.shape[0]:
        wrap_triton(_quantize_per_token_kernel)[(x2.shape[0],)](
            x2, q, scale, k, x2.stride(0), q.stride(0), eps, divisor, amax_floor,
            BLOCK_K=block, SINGLE_PASS=single
        )
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], 1)


@quantize_per_token.register_fake
def _(x, eps=DEFAULT_EPS, divisor=127.5, amax_floor=0.0):
    _check(x, eps, divisor, amax_floor)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@quantize_per_token.register_kernel("cpu")
def _(x, eps=DEFAULT_EPS, divisor=127.5, amax_floor=0.0):
    _check(x, eps, divisor, amax_floor)
    amax = x.detach().float().abs().amax(dim=-1, keepdim=True)
    if divisor == 127.5 and amax_floor == 0.0:
        scale, _ = choose_qparams(-amax, amax, qscheme=torch.per_tensor_symmetric, dtype=torch.int8,
                                  quant_min=-128, quant_max=127, eps=eps)
    else:
        scale = (amax.clamp(min=amax_floor) / divisor).clamp(min=eps)
    x2 = x.detach().float().reshape(-1, x.shape[-1])
    zero = torch.zeros(x2.shape[0], dtype=torch.int64)
    q = quantize(x2, scale.reshape(-1), zero, -128, 127, torch.int8, axis=0)
    return q.reshape(x.shape), scale.reshape(amax.shape)
