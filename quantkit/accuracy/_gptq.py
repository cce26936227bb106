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

With ``clip_search`` each group's range is the shrink of its min/max (1, 0.975, …, 0.5 of it)
whose rounded group has the least *output* error on the calibration rows,
``(w - q) H_gg (w - q)ᵀ`` with ``H_gg`` the group's block of ``XᵀX`` (the group's share of
``‖X Wᵀ - X Qᵀ‖²``, the later columns' compensation aside), instead of the full min/max.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._wscheme import WeightScheme

__all__ = ["GPTQConfig", "GPTQResult", "gptq_quantize", "clip_search_qparams"]


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ settings.

    Args:
        block_size: columns per lazy batch update (128 in the paper and reference code).
        percdamp: dampening added to the Hessian diagonal, as a fraction of its mean
            (0.01 in the paper and reference code).
        act_order: quantize columns in decreasing order of the Hessian diagonal (the
            reference's ``--act-order``; better accuracy at no storage cost here).
        clip_search: choose each group's clipping range by the group's output error (see
            the module docstring); group-wise integer schemes only (others ignore it).
    """

    block_size: int = 128
    percdamp: float = 0.01
    act_order: bool = True
    clip_search: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if not 0.0 < float(self.percdamp) <= 1.0:
            raise ValueError(f"percdamp must be in (0, 1], got {self.percdamp!r}")
        if not isinstance(self.act_order, bool):
            raise ValueError(f"act_order must be True or False, got {self.act_order!r}")
        if not isinstance(self.clip_search, bool):
            raise ValueError(f"clip_search must be True or False, got {self.clip_search!r}")


@dataclass
class GPTQResult:
    """Integers ``q`` (``[N, K]``, int64) and ``[N, G]`` scales and zero points; ``dequantized``
    is ``(q - zero_point) * scale`` group-wise (float32), the weight the model computes with."""

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    dequantized: torch.Tensor


def _inverse_hessian_cholesky(h: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``(H + λI)⁻¹`` (``UᵀU = (H + λI)⁻¹``) with
    ``λ = percdamp · mean(diag H)``; the dampening grows tenfold (at most 4 times) if
    ``H + λI`` is not positive definite.

    One Cholesky factorization and one triangular inverse (the reference code's
    ``cholesky_inverse`` + second Cholesky cost twice the flops): with ``J`` the reversal
    permutation and ``JHJ = LLᵀ``, ``H⁻¹ = (J L⁻¹ J)ᵀ (J L⁻¹ J)`` and ``J L⁻¹ J`` is upper
    triangular with a positive diagonal, so it is the (unique) upper factor.
    """
    damp = percdamp * float(torch.diag(h).mean())
    k = h.shape[0]
    flipped = h.flip(0, 1)
    for _ in range(5):
        damped = flipped.clone()
        damped.diagonal().add_(damp)
        lower, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            return _lower_triangular_inverse(lower).flip(0, 1).contiguous()
        damp *= 10
    raise ValueError("the layer's input Hessian is not positive definite even after dampening; "
                     "check the calibration data (constant or NaN activations?)")


def _lower_triangular_inverse(lower: torch.Tensor) -> torch.Tensor:
    """``lower⁻¹`` by triangular solves on column blocks: block ``[c0, c1)`` of the (lower
    triangular) inverse is zero above row ``c0``, so each solve only involves ``lower[c0:, c0:]``
    (about k³/3 flops in 8 blocks against k³ for one solve with the whole identity)."""
    k = lower.shape[0]
    step = max(128, -(-k // 8))
    inv = torch.zeros_like(lower)
    eye = torch.eye(step, dtype=lower.dtype, device=lower.device)
    for c0 in range(0, k, step):
        c1 = min(c0 + step, k)
        rhs = torch.zeros(k - c0, c1 - c0, dtype=lower.dtype, device=lower.device)
        rhs[:c1 - c0] = eye[:c1 - c0, :c1 - c0]
        inv[c0:, c0:c1] = torch.linalg.solve_triangular(lower[c0:, c0:], rhs, upper=False)
    return inv


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
    w = weight.detach().to(_DTYPE).clone()
    h = hessian.detach().to(device=w.device, dtype=_DTYPE).clone()
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
    clip_h = h if config.clip_search and scheme.group_size is not None and not scheme.float8 else None

    # (no torch.set_num_threads around this loop: changing the intra-op pool mid-process broke
    # later oneDNN/ATen parallel regions, "vector::reserve", measured in the test suite)
    q = _column_loop(w, hinv, scale, zp, have, group_of, invperm, scheme, gs, config.block_size, clip_h)
    q = q[:, invperm].to(torch.int64)
    deq = scheme.dequantize(q, scale, zp)
    return GPTQResult(q=q, scale=scale, zero_point=zp, dequantized=deq)


# float64 throughout. Measured with float32 instead (1.3-1.9x faster on 384..1536-wide layers):
# int8 per-channel integers of a 384x1536 layer differ from float64's on 0.18%, above the 0.1%
# the NumPy-reference test allows, so float64 stays.
_DTYPE = torch.float64
_SUB_BLOCK = 16  # columns whose rank-1 updates stay inside an [n, 16] slice (cache-resident); measured
                 # 384x384 .. 4096x4096 on this CPU: 16 and 32 within noise, 128 (no sub-blocks) slower


# clip_search's shrink factors of a group's range: 1, 0.975, ..., 0.5 (AWQ's auto_clip goes down to 0.5
# in 5% steps; half steps cost little here: a group's search is [21, n, gs] x [gs, gs])
_CLIP_FACTORS = tuple(1 - i / 40 for i in range(21))


def clip_search_qparams(cur: torch.Tensor, h_gg: torch.Tensor, scheme: WeightScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``cur`` (``[n, gs]``, one group's weights): the qparams of the shrunk range
    (``_CLIP_FACTORS`` of its min/max) with the least ``(w - q) h_gg (w - q)ᵀ``."""
    best_err, best_s, best_z = None, None, None
    for f in _CLIP_FACTORS:
        s, z = scheme.row_qparams((cur * f).float())
        _, dq = scheme.round(cur, s[:, None], z[:, None])
        d = cur - dq
        err = ((d @ h_gg) * d).sum(1)
        if best_err is None:
            best_err, best_s, best_z = err, s, z
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    return best_s, best_z


def _column_loop(w, hinv, scale, zp, have, group_of, invperm, scheme: WeightScheme, gs: int, bs: int,
                 clip_h=None) -> torch.Tensor:
    """Algorithm 1's loop over the permuted ``w`` (``[n, k]``, not modified); fills ``scale``, ``zp``
    and ``have``; returns the integers (``[n, k]``, permuted order, ``w``'s float dtype). With
    ``clip_h`` (the permuted Hessian) each group's qparams come from :func:`clip_search_qparams`.

    Works on the transposed weight, so that each column is a contiguous row. Two levels of
    lazy updates: errors reach the rest of the weight once per block of ``bs`` columns (the
    paper's) and the rest of the block once per sub-block of 16 columns, so the per-column
    rank-1 updates touch only an ``[n, 16]`` slice. Same arithmetic as the column-by-column
    algorithm up to float rounding order.
    """
    n, k = w.shape
    wt = w.t().contiguous()  # [k, n]
    qt = torch.empty_like(wt)
    err = torch.empty(min(bs, k), n, dtype=w.dtype, device=w.device)
    integer = not (scheme.nf4 or scheme.float8)
    cached = None
    for i1 in range(0, k, bs):
        i2 = min(i1 + bs, k)
        blk = wt[i1:i2].clone()  # the block's columns, updated in place by the block's errors
        hinv1 = hinv[i1:i2, i1:i2]
        diag = hinv1.diagonal().tolist()  # Python floats: no 0-d tensor per column
        for j1 in range(0, i2 - i1, _SUB_BLOCK):
            j2 = min(j1 + _SUB_BLOCK, i2 - i1)
            for j in range(j1, j2):
                g = group_of[i1 + j]
                if not have[g]:
                    # the group's current weights: pending in-block errors applied to its columns
                    cols = invperm[g * gs:(g + 1) * gs]
                    cur = wt[cols] - hinv[i1:i1 + j][:, cols].t() @ err[:j]
                    if clip_h is None:
                        scale[:, g], zp[:, g] = scheme.row_qparams(cur.t().float())
                    else:
                        scale[:, g], zp[:, g] = clip_search_qparams(cur.t(), clip_h[cols][:, cols], scheme)
                    have[g] = True
                if g != cached:
                    s, z, cached = scale[:, g].to(w.dtype), zp[:, g].to(w.dtype), g
                col, e, qrow = blk[j], err[j], qt[i1 + j]
                if integer:  # scheme.round's arithmetic, in place: clamp(round(x / s) + z), (q - z) * s
                    torch.div(col, s, out=qrow)
                    qrow.round_().add_(z).clamp_(scheme.quant_min, scheme.quant_max)
                    dq = (qrow - z).mul_(s)
                else:
                    qi, dq = scheme.round(col, s, z)
                    qrow.copy_(qi)
                torch.sub(col, dq, out=e).div_(diag[j])
                if j + 1 < j2:
                    blk[j + 1:j2].addr_(hinv1[j, j + 1:j2], e, alpha=-1)
            if j2 < i2 - i1:
                blk[j2:].addmm_(hinv1[j1:j2, j2:].t(), err[j1:j2], alpha=-1)
        if i2 < k:
            wt[i2:].addmm_(hinv[i1:i2, i2:].t(), err[:i2 - i1], alpha=-1)
    return qt.t()
