"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): round a linear weight column by column, each rounding error
compensated on the columns not yet rounded through the inverse Hessian of the layer input.

The algorithm is the paper's Algorithm 1 with its lazy batch updates (blocks of
``block_size`` columns, errors pushed to later blocks once per block), the Cholesky form of
the inverse Hessian, dampening, ``act_order`` (columns in decreasing Hessian diagonal) and
group-wise qparams chosen when a group's first column is reached, from the group's
current (already error-compensated) weights. With ``act_order`` the groups are still the
consecutive columns of the stored weight (so the usual group-wise storage holds it): a
group's qparams are chosen when the first of its columns comes up in the permuted order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._wscheme import WeightScheme

__all__ = ["GPTQConfig", "GPTQResult", "gptq_quantize"]


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ settings.

    Args:
        block_size: columns per lazy batch update (128 in the paper and reference code).
        percdamp: dampening added to the Hessian diagonal, as a fraction of its mean
            (0.01 in the paper and reference code).
        act_order: quantize columns in decreasing order of the Hessian diagonal (the
            reference's ``--act-order``; better accuracy at no storage cost here).
    """

    block_size: int = 128
    percdamp: float = 0.01
    act_order: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if not 0.0 < float(self.percdamp) <= 1.0:
            raise ValueError(f"percdamp must be in (0, 1], got {self.percdamp!r}")
        if not isinstance(self.act_order, bool):
            raise ValueError(f"act_order must be True or False, got {self.act_order!r}")


@dataclass
class GPTQResult:
    """Integers ``q`` (``[N, K]``, int64) and ``[N, G]`` scales and zero points; ``dequantized``
    is ``(q - zero_point) * scale`` group-wise (float32), the weight the model computes with."""

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    dequantized: torch.Tensor


def _inverse_hessian_cholesky(h: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + λI)⁻¹`` with ``λ = percdamp · mean(diag H)``; the
    dampening grows tenfold (at most 4 times) if ``H + λI`` is not positive definite."""
    damp = percdamp * float(torch.diag(h).mean())
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for _ in range(5):
        lower, info = torch.linalg.cholesky_ex(h + damp * eye)
        if int(info) == 0:
            inv = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            if int(info) == 0:
                return upper
        damp *= 10
    raise ValueError("the layer's input Hessian is not positive definite even after dampening; "
                     "check the calibration data (constant or NaN activations?)")


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, scheme: WeightScheme,
                  config: GPTQConfig = GPTQConfig()) -> GPTQResult:
    """Round ``weight`` (``[N, K]``) with GPTQ for the input second moment ``hessian`` (``[K, K]``).

    Computed in float64. Per-channel schemes (``group_size`` None) take their qparams from the
    original weight (as round-to-nearest does); group-wise ones when each group is reached.
    Input features that calibration never excited (zero Hessian diagonal) get weight 0.

    Args:
        weight: the float weight; not modified.
        hessian: ``XᵀX / n`` of the layer's inputs (any positive multiple gives the same result).
        scheme: the integer scheme (range, symmetric or affine, group size).
        config: block size, dampening, act_order.

    Returns:
        A :class:`GPTQResult`.
    """
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"Hessian of shape {tuple(hessian.shape)} does not match a weight with {k} input features")
    gs = scheme.group(k)
    w = weight.detach().to(torch.float64).clone()
    h = hessian.detach().to(device=w.device, dtype=torch.float64).clone()
    n_groups = k // gs
    scale = torch.empty(n, n_groups, dtype=torch.float32, device=w.device)
    zp = torch.empty(n, n_groups, dtype=torch.int64, device=w.device)
    have = [False] * n_groups
    if scheme.group_size is None:  # per channel: RTN's qparams, from the original weight
        scale[:, 0], zp[:, 0] = scheme.row_qparams(weight.detach().float())
        have[0] = True

    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if config.act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    hinv = _inverse_hessian_cholesky(h, float(config.percdamp))
    invperm = torch.argsort(perm)
    group_of = (perm // gs).tolist()  # group of each permuted column

    q = torch.zeros(n, k, dtype=torch.float64, device=w.device)
    bs = config.block_size
    # (no torch.set_num_threads around this loop: changing the intra-op pool mid-process broke
    # later oneDNN/ATen parallel regions, "vector::reserve", measured in the test suite)
    _column_loop(w, hinv, q, scale, zp, have, group_of, invperm, scheme, gs, bs)
    q = q[:, invperm].to(torch.int64)
    deq = scheme.dequantize(q, scale, zp)
    return GPTQResult(q=q, scale=scale, zero_point=zp, dequantized=deq)


def _column_loop(w, hinv, q, scale, zp, have, group_of, invperm, scheme: WeightScheme, gs: int, bs: int) -> None:
    """Algorithm 1's loop, in place on ``w`` (permuted), ``q``, ``scale``, ``zp`` and ``have``."""
    n, k = w.shape
    cached = None
    for i1 in range(0, k, bs):
        i2 = min(i1 + bs, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            g = group_of[i1 + i]
            if not have[g]:
                # the group's current weights: pending in-block errors applied to its columns
                cols = invperm[g * gs:(g + 1) * gs]
                cur = w[:, cols] - err1[:, :i] @ hinv[i1:i1 + i][:, cols]
                s, z = scheme.row_qparams(cur.float())
                scale[:, g], zp[:, g] = s, z
                have[g] = True
            if g != cached:
                s, z, cached = scale[:, g].double(), zp[:, g].double(), g
            col = w1[:, i]
            qi, dq = scheme.round(col, s, z)
            q[:, i1 + i] = qi
            e = (col - dq) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
