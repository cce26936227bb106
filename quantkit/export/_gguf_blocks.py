"""GGUF's Q4_0 / Q4_1 / Q8_0 blocks holding quantkit's group-wise integers unchanged.

ggml's layouts (ggml-common.h), 32 weights per block, blocks in row order:

- ``Q4_0``: fp16 ``d``, 16 bytes ``qs``; weight ``j`` (0..15) in the low nibble of ``qs[j]``,
  weight ``j + 16`` in its high nibble; value ``(q - 8) * d``. quantkit's symmetric int4 (uint4 with
  zero point 8, or int4 with zero point 0) is ``q - zero_point + 8`` there.
- ``Q4_1``: fp16 ``d``, fp16 ``m``, the same ``qs``; value ``q * d + m``. quantkit's asymmetric
  ``(q - zp) * s`` is ``d = s``, ``m = -zp * s`` with ``q`` on the unsigned grid [0, 15].
- ``Q8_0``: fp16 ``d``, 32 int8 ``qs``; value ``q * d``. quantkit's symmetric int8 (zero point 0,
  or uint8 with zero point 128).

The integers go in bit for bit; the float32 scales (and Q4_1's ``m``) are rounded to fp16, the one
change, measured per tensor by :func:`fp16_error` (the relative Frobenius error of the weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["GGUF_GROUP", "Blocks", "pack", "kind_of", "fp16_error", "dequantize_blocks"]

GGUF_GROUP = 32  # QK4_0 = QK4_1 = QK8_0 = 32


@dataclass(frozen=True)
class Blocks:
    """One tensor's blocks: ``kind`` ("Q4_0", "Q4_1", "Q8_0") and ``data`` uint8 ``[rows, bytes per row]``."""

    kind: str
    data: np.ndarray


def kind_of(w) -> tuple[str | None, str | None]:
    """``(kind, None)`` for a group-wise weight (``_ct_schemes.GroupWeight``) GGUF stores exactly, else
    ``(None, why)``. A group of 32·r weights (or one per row) is r blocks with the same scale: exact."""
    full = w.quant_max - w.quant_min + 1
    if w.q.dim() != 2 or w.q.shape[1] % GGUF_GROUP:
        return None, f"a weight of shape {tuple(w.q.shape)} (blocks of 32 along its rows)"
    if w.group_size % GGUF_GROUP:
        return None, f"group size {w.group_size} (GGUF's Q4_0/Q4_1/Q8_0 blocks hold 32 weights: use a multiple of 32)"
    zp = w.zero_point.to(torch.int32)
    if full == 16 and w.quant_min in (0, -8):
        shift = 8 if w.quant_min == 0 else 0
        return ("Q4_0" if bool((zp == shift).all()) else "Q4_1"), None
    if full == 256 and w.quant_min in (0, -128):
        shift = 128 if w.quant_min == 0 else 0
        if bool((zp == shift).all()):
            return "Q8_0", None
        return None, "asymmetric int8 weights (GGUF's Q8_0 is symmetric): quantize w8a16 with symmetric=True"
    return None, f"integers in [{w.quant_min}, {w.quant_max}] (GGUF holds full-range int4 or int8)"


def _unsigned4(w, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """quantkit's int4 and zero points on the unsigned grid [0, 15] (signed int4 shifted by 8)."""
    shift = 8 if w.quant_min == -8 else 0
    q = w.q.to(torch.int32)[rows] + shift
    zp = _per_block(w.zero_point.to(torch.int32), w)[rows] + shift
    return q, zp


def _per_block(t: torch.Tensor, w) -> torch.Tensor:
    """A per-group tensor ``[out, in / group_size]`` as one value per 32-wide block ``[out, in / 32]``."""
    n, k = w.q.shape
    return t.reshape(n, k // w.group_size).repeat_interleave(w.group_size // GGUF_GROUP, 1)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> fp16 bytes ``[..., 2]`` (little-endian)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def pack(w, kind: str, rows: torch.Tensor | None = None) -> Blocks:
    """The blocks of ``w`` (a ``GroupWeight`` with group size 32), rows reordered by ``rows`` (llama.cpp's
    Q/K permutation) when given."""
    n, k = w.q.shape
    rows = torch.arange(n) if rows is None else rows
    nb = k // GGUF_GROUP
    scale = _per_block(w.scale.detach().to(torch.float32), w)[rows]
    if kind in ("Q4_0", "Q4_1"):
        q, zp = _unsigned4(w, rows)
        zp = zp.reshape(n, nb)
        if kind == "Q4_0":
            q = q - zp.repeat_interleave(GGUF_GROUP, 1) + 8  # zp is 8 here: the integers as they are
        assert int(q.min()) >= 0 and int(q.max()) <= 15
        q = q.to(torch.uint8).reshape(n, nb, GGUF_GROUP)
        qs = q[..., :16] | (q[..., 16:] << 4)
        head = [_fp16_bytes(scale)]
        if kind == "Q4_1":
            head.append(_fp16_bytes(-zp.to(torch.float32) * scale))
        block = torch.cat(head + [qs], -1)
    elif kind == "Q8_0":
        shift = 128 if w.quant_min == 0 else 0
        q = (w.q.to(torch.int32)[rows] - shift).to(torch.int8).reshape(n, nb, GGUF_GROUP)
        block = torch.cat([_fp16_bytes(scale), q.view(torch.uint8)], -1)
    else:
        raise AssertionError(kind)
    return Blocks(kind, block.reshape(n, -1).numpy())


def dequantize_blocks(w, kind: str) -> torch.Tensor:
    """What GGUF's blocks of ``w`` decode to (float32), from quantkit's integers and fp16 scales,
    in torch: ``(q - zp) * fp16(s)``, Q4_1 as ``q * fp16(s) + fp16(-zp * s)``."""
    n, k = w.q.shape
    s = _per_block(w.scale.detach().to(torch.float32), w)
    d = s.to(torch.float16).to(torch.float32).repeat_interleave(GGUF_GROUP, 1)
    if kind == "Q4_1":
        q, zp = _unsigned4(w, torch.arange(n))
        m = (-zp.reshape(n, -1).to(torch.float32) * s).to(torch.float16).to(torch.float32)
        return q.to(torch.float32) * d + m.repeat_interleave(GGUF_GROUP, 1)
    zp = _per_block(w.zero_point.to(torch.int32), w).repeat_interleave(GGUF_GROUP, 1)
    return (w.q.to(torch.int32) - zp).to(torch.float32) * d


def fp16_error(w, kind: str) -> float:
    """Relative Frobenius error that fp16 scales add to quantkit's dequantized weight."""
    ref = w.dequantized(torch.float64)
    got = dequantize_blocks(w, kind).to(torch.float64)
    den = float(ref.norm())
    return float((got - ref).norm()) / den if den else 0.0
