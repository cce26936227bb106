"""``quantkit::int8_sdpa_cpu``: attention on static per-tensor int8/uint8 q, k, v, on CPU.

``softmax(((q - zq) . (k - zk)^T) * (sq * sk * scale) + mask) @ ((v - zv) * sv)``, for the stored
integers of a static ``quantize_per_tensor`` of q, k and v (the ``"attention"`` op family of
``W8A8Quantizer``). The reference q/dq graph computes the same attention in float32 on the
dequantized tensors; here:

* ``Q.K^T`` is integer and exact: ``|q - zq|, |k - zk| <= 255``, so up to head dim 258 every partial
  sum is an integer below ``2**24`` and float32 adds of the integer products are exact (the fast path:
  float FMA-width vectors); past that the products are summed in int32 (``D <= 33025``, checked). The
  reference's float32 sums of dequantized values round; these do not.
* the scale, mask, softmax (max-subtracted ``exp``, one float32 sum) and ``P @ V`` are float32,
  with ``V`` dequantized once per (batch, head): float parts agree with the reference to float32
  rounding (``tests/test_int8_attention.py`` states the tolerance). A query whose keys are all
  masked gets zeros, as torch 2.13's ``scaled_dot_product_attention`` gives (measured, CPU).

Why a kernel of our own: torchao 0.18's ``torchao::qscaled_dot_product`` has no CPU kernel in this
build (only Meta is registered: "Could not run ... with arguments from the 'CPU' backend"), and it
quantizes the softmax output too, which the reference graph does not.

Portable C++ (no intrinsics): GCC/Clang vector extensions of 8 floats, compiled for the ISA
Inductor's flags name (``-march=native``), 4 query rows x 16 keys (or output columns) per register
tile, and a vector exp of its own (Inductor's flags turn off loop vectorisation and keep
``-fmath-errno``). Parallel over (batch, head, 32-query block) with OpenMP. Measured, 1 thread on
this AVX2 machine (CPU time, MiniLM's 32 x 12 x 128 x 32 attention): 51 ms against 30 ms for torch's
fp32 SDPA -- exact, not faster here; a VNNI ``vpdpbusd`` path is not written. Built on first use into
quantkit's kernel cache and loaded after its digest check (``kernels/_kernel_cache.py``);
``status()`` says whether it runs here and why not.
"""

from __future__ import annotations

import functools

import torch

from ._cpp_math import cephes_expf
from ._kernel_cache import KernelStatus, define_cpu_op, load, load_with_status

__all__ = ["int8_sdpa_cpu", "int8_scores_cpu", "available", "status", "KERNEL", "MAX_HEAD_DIM"]

KERNEL = "quantkit::int8_sdpa_cpu"
MAX_HEAD_DIM = (2 ** 31 - 1) // (255 * 255)  # int32 Q.K^T stays exact up to this head dim (33025)

_SOURCE = r"""
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>
#include <omp.h>

// Inductor's flags say -fno-tree-loop-vectorize and -fmath-errno (no vector std::exp): this file
// turns loop vectorisation back on and brings its own exp, a polynomial the vectoriser can inline.
#pragma GCC optimize("tree-loop-vectorize")

// GCC/Clang vector extensions (portable, no intrinsics): 8 floats, loaded from any float address
typedef float qk_v8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t qk_v8i __attribute__((vector_size(32)));

// exp(x) of 8 lanes, x <= 0 (scores minus their row maximum), Cephes expf (_cpp_math.py); a masked key (-inf) gives 0
""" + cephes_expf("qk_exp8", "qk_v8", "qk_v8i", clamp_high=False) + r"""
constexpr int64_t RT = 4;   // query rows per register tile
constexpr int64_t SB = 16;  // keys (and value columns) per register tile: two AVX2 vectors of float

// One (batch, head): query rows [t0, t1). kT: (k - zk) transposed [D][Sp] in ACC (float when every
// partial sum of integer products stays below 2**24, so float adds are exact; else int32), keys
// padded with zeros to Sp (a multiple of SB); vf: (v - zv) * sv [S][Dvp], columns padded to Dvp.
// Each RT x SB tile of scores (and of the output) is summed in registers.
template <typename T, typename ACC>
static void qk_rows(const T* q, const float* mask, float* out, int32_t* scores, int64_t b, int64_t h,
                    int64_t t0, int64_t t1, int64_t H, int64_t T_, int64_t S, int64_t Sp, int64_t D, int64_t Dv,
                    int64_t Dvp, const int64_t* qs, const int64_t* ms, int64_t zq, float score_scale,
                    int64_t has_mask, const ACC* kT, const float* vf, std::vector<ACC>& qz,
                    std::vector<float>& row, std::vector<float>& o) {
  for (int64_t r0 = t0; r0 < t1; r0 += RT) {
    const int64_t nr = t1 - r0 < RT ? t1 - r0 : RT;
    for (int64_t r = 0; r < RT; ++r) {  // rows past the end are zeros: computed, never stored
      const T* qp = q + b * qs[0] + h * qs[1] + (r0 + (r < nr ? r : 0)) * qs[2];
      for (int64_t d = 0; d < D; ++d) qz[r * D + d] = r < nr ? (ACC)((int32_t)qp[d] - (int32_t)zq) : (ACC)0;
    }
    for (int64_t s0 = 0; s0 < Sp; s0 += SB) {
      ACC acc[RT][SB];
      if constexpr (std::is_same_v<ACC, float>) {  // the tile in 8 registers: 4 rows x 2 vectors
        qk_v8 a[RT][2] = {};
        for (int64_t d = 0; d < D; ++d) {
          const qk_v8 k0 = *(const qk_v8*)(kT + d * Sp + s0), k1 = *(const qk_v8*)(kT + d * Sp + s0 + 8);
          for (int64_t r = 0; r < RT; ++r) {
            const float qv = qz[r * D + d];
            a[r][0] += qv * k0;
            a[r][1] += qv * k1;
          }
        }
        for (int64_t r = 0; r < RT; ++r)
          for (int64_t j = 0; j < 8; ++j) { acc[r][j] = a[r][0][j]; acc[r][8 + j] = a[r][1][j]; }
      } else {
        for (int64_t r = 0; r < RT; ++r) for (int64_t j = 0; j < SB; ++j) acc[r][j] = 0;
        for (int64_t d = 0; d < D; ++d) {
          const ACC* kp = kT + d * Sp + s0;
          for (int64_t r = 0; r < RT; ++r) {
            const ACC qv = qz[r * D + d];
            #pragma omp simd
            for (int64_t j = 0; j < SB; ++j) acc[r][j] += qv * kp[j];
          }
        }
      }
      for (int64_t r = 0; r < nr; ++r) {
        float* f = row.data() + r * Sp + s0;
        #pragma omp simd
        for (int64_t j = 0; j < SB; ++j) f[j] = (float)acc[r][j] * score_scale;
        if (scores) {
          int32_t* sp = scores + ((b * H + h) * T_ + r0 + r) * S;
          for (int64_t j = 0; j < SB && s0 + j < S; ++j) sp[s0 + j] = (int32_t)acc[r][j];
        }
      }
    }
    for (int64_t r = 0; r < RT; ++r) {
      float* f = row.data() + r * Sp;
      if (r >= nr) { for (int64_t s = 0; s < Sp; ++s) f[s] = 0.0f; continue; }
      if (has_mask) {
        const float* mp = mask + b * ms[0] + h * ms[1] + (r0 + r) * ms[2];
        const int64_t m3 = ms[3];
        for (int64_t s = 0; s < S; ++s) f[s] += mp[s * m3];
      }
      for (int64_t s = S; s < Sp; ++s) f[s] = -std::numeric_limits<float>::infinity();  // padding: p = 0
      qk_v8 m8 = (qk_v8){} - std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < Sp; s += 8) { const qk_v8 x = *(qk_v8*)(f + s); m8 = x > m8 ? x : m8; }
      float mx = m8[0];
      for (int j = 1; j < 8; ++j) mx = m8[j] > mx ? m8[j] : mx;
      if (mx == -std::numeric_limits<float>::infinity()) {  // every key masked: 0, as torch's SDPA gives
        for (int64_t s = 0; s < Sp; ++s) f[s] = 0.0f;
        continue;
      }
      qk_v8 sum8 = {};
      for (int64_t s = 0; s < Sp; s += 8) {
        const qk_v8 e = qk_exp8(*(qk_v8*)(f + s) - mx);
        *(qk_v8*)(f + s) = e;
        sum8 += e;
      }
      float sum = 0.0f;
      for (int j = 0; j < 8; ++j) sum += sum8[j];
      const float inv = 1.0f / sum;
      for (int64_t s = 0; s < Sp; s += 8) *(qk_v8*)(f + s) *= inv;
    }
    for (int64_t e0 = 0; e0 < Dvp; e0 += SB) {
      qk_v8 a[RT][2] = {};  // 4 rows x 16 output columns in 8 registers
      for (int64_t s = 0; s < S; ++s) {
        const qk_v8 v0 = *(const qk_v8*)(vf + s * Dvp + e0), v1 = *(const qk_v8*)(vf + s * Dvp + e0 + 8);
        for (int64_t r = 0; r < RT; ++r) {
          const float p = row[r * Sp + s];
          a[r][0] += p * v0;
          a[r][1] += p * v1;
        }
      }
      for (int64_t r = 0; r < nr; ++r) {
        float* op = out + ((b * H + h) * T_ + r0 + r) * Dv;
        for (int64_t j = 0; j < SB && e0 + j < Dv; ++j) op[e0 + j] = a[r][j / 8][j % 8];
      }
    }
  }
}

template <typename T, typename ACC>
static void qk_run(const T* q, const T* k, const T* v, const float* mask, float* out, int32_t* scores,
                   int64_t B, int64_t H, int64_t T_, int64_t S, int64_t D, int64_t Dv, const int64_t* st,
                   int64_t zq, int64_t zk, int64_t zv, float score_scale, float sv, int64_t has_mask,
                   int64_t threads) {
  const int64_t* qs = st; const int64_t* ks = st + 3; const int64_t* vs = st + 6; const int64_t* ms = st + 9;
  const int64_t TB = 32;  // query rows per task: the head's K and V are reused across them
  const int64_t tblocks = (T_ + TB - 1) / TB;
  const int64_t Sp = (S + SB - 1) / SB * SB, Dvp = (Dv + SB - 1) / SB * SB;
  std::vector<ACC> kT_all((size_t)(B * H * Sp * D));
  std::vector<float> vf_all((size_t)(B * H * S * Dvp));
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    ACC* kd = kT_all.data() + bh * Sp * D;
    for (int64_t i = 0; i < Sp * D; ++i) kd[i] = (ACC)0;
    for (int64_t s = 0; s < S; ++s) {
      const T* kp = k + b * ks[0] + h * ks[1] + s * ks[2];
      const T* vp = v + b * vs[0] + h * vs[1] + s * vs[2];
      float* vd = vf_all.data() + (bh * S + s) * Dvp;
      for (int64_t d = 0; d < D; ++d) kd[d * Sp + s] = (ACC)((int32_t)kp[d] - (int32_t)zk);
      for (int64_t e = 0; e < Dvp; ++e) vd[e] = e < Dv ? (float)((int32_t)vp[e] - (int32_t)zv) * sv : 0.0f;
    }
  }
  #pragma omp parallel num_threads(threads)
  {
    std::vector<ACC> qz((size_t)(RT * D));
    std::vector<float> row((size_t)(RT * Sp));
    std::vector<float> o((size_t)(RT * Dvp));
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < B * H * tblocks; ++task) {
      const int64_t bh = task / tblocks, tb = task % tblocks;
      const int64_t t0 = tb * TB, t1 = t0 + TB < T_ ? t0 + TB : T_;
      qk_rows<T, ACC>(q, mask, out, scores, bh / H, bh % H, t0, t1, H, T_, S, Sp, D, Dv, Dvp, qs, ms, zq,
                      score_scale, has_mask, kT_all.data() + bh * Sp * D, vf_all.data() + bh * S * Dvp, qz, row, o);
    }
  }
}

// st: 12 strides (q, k, v: batch, head, row; mask: batch, head, query, key). want_scores: also write
// the integer Q.K^T to scores [B, H, T, S] (tests).
void kernel(const void* q, const void* k, const void* v, const float* mask, float* out, int32_t* scores,
            const int64_t* st, int64_t B, int64_t H, int64_t T_, int64_t S, int64_t D, int64_t Dv,
            int64_t is_signed, int64_t zq, int64_t zk, int64_t zv, float score_scale, float sv,
            int64_t has_mask, int64_t want_scores, int64_t threads) {
  int32_t* sc = want_scores ? scores : nullptr;
  // |q - zq| and |k - zk| are at most 255: D products sum below 2**24 (exact in float) up to D = 258
  const bool exact_in_float = D * 255 * 255 < (int64_t(1) << 24);
  if (is_signed) {
    const int8_t *q8 = (const int8_t*)q, *k8 = (const int8_t*)k, *v8 = (const int8_t*)v;
    if (exact_in_float)
      qk_run<int8_t, float>(q8, k8, v8, mask, out, sc, B, H, T_, S, D, Dv, st, zq, zk, zv, score_scale, sv, has_mask, threads);
    else
      qk_run<int8_t, int32_t>(q8, k8, v8, mask, out, sc, B, H, T_, S, D, Dv, st, zq, zk, zv, score_scale, sv, has_mask, threads);
  } else {
    const uint8_t *q8 = (const uint8_t*)q, *k8 = (const uint8_t*)k, *v8 = (const uint8_t*)v;
    if (exact_in_float)
      qk_run<uint8_t, float>(q8, k8, v8, mask, out, sc, B, H, T_, S, D, Dv, st, zq, zk, zv, score_scale, sv, has_mask, threads);
    else
      qk_run<uint8_t, int32_t>(q8, k8, v8, mask, out, sc, B, H, T_, S, D, Dv, st, zq, zk, zv, score_scale, sv, has_mask, threads);
  }
}
"""

_ARGS = ["const void*", "const void*", "const void*", "const float*", "float*", "int32_t*", "const int64_t*",
         "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t",
         "float", "float", "int64_t", "int64_t", "int64_t"]


@functools.cache
def _loaded():
    return load_with_status(KERNEL, lambda: load("int8_sdpa_cpu", _ARGS, _SOURCE))


def status() -> KernelStatus:
    """Whether ``int8_sdpa_cpu`` runs here and, when not, why (a compiler Inductor can use and a
    kernel cache that passes its checks; any x86 or Arm CPU otherwise). Builds it on first call."""
    return _loaded()[1]


def available() -> bool:
    """Whether ``int8_sdpa_cpu`` can run here (``status()`` says why not)."""
    return status().available


def _check(q, k, v, mask):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"int8_sdpa_cpu: q, k, v must be [B, H, T, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"int8_sdpa_cpu: q, k, v must all be uint8 or all int8, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, h, t, d = q.shape
    if tuple(k.shape[:2]) != (b, h) or tuple(v.shape[:2]) != (b, h) or k.shape[3] != d or v.shape[2] != k.shape[2]:
        raise ValueError(f"int8_sdpa_cpu: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"int8_sdpa_cpu: head dim {d} > {MAX_HEAD_DIM}: the int32 Q.K^T could overflow")
    if mask is not None and mask.dtype not in (torch.bool, torch.float32, torch.bfloat16):
        raise ValueError(f"int8_sdpa_cpu: attn_mask must be bool or float, got {mask.dtype}")
    return b, h, t, k.shape[2], d, v.shape[3]


def _run(q, k, v, mask, q_scale, q_zp, k_scale, k_zp, v_scale, v_zp, scale, want_scores):
    b, h, t, s, d, dv = _check(q, k, v, mask)
    fn, st = _loaded()
    if fn is None:
        raise RuntimeError(f"int8_sdpa_cpu cannot run here: {st.reason}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if mask is None:
        m = torch.zeros(1)
        mstr = [0, 0, 0, 0]
    else:
        if mask.dtype == torch.bool:  # True attends: 0 added, else -inf
            m = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, float("-inf"))
        else:
            m = mask.float()
        m = m.expand(b, h, t, s)  # broadcast: stride 0 where the mask is shared
        mstr = list(m.stride())
    strides = torch.tensor([*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *mstr], dtype=torch.int64)
    out = torch.empty(b, h, t, dv, dtype=torch.float32)
    scores = torch.empty(b, h, t, s, dtype=torch.int32) if want_scores else torch.empty(1, dtype=torch.int32)
    if out.numel():
        sm = float(scale) if scale is not None else d ** -0.5
        fn(q, k, v, m, out, scores, strides, b, h, t, s, d, dv, int(q.dtype == torch.int8), int(q_zp), int(k_zp),
           int(v_zp), float(q_scale) * float(k_scale) * sm, float(v_scale), int(mask is not None), int(want_scores),
           torch.get_num_threads())
    return out, scores


def _impl(q, k, v, attn_mask, q_scale, q_zp, k_scale, k_zp, v_scale, v_zp, scale):
    return _run(q, k, v, attn_mask, q_scale, q_zp, k_scale, k_zp, v_scale, v_zp, scale, False)[0]


def _fake(q, k, v, attn_mask, q_scale, q_zp, k_scale, k_zp, v_scale, v_zp, scale):
    b, h, t, _, _, dv = _check(q, k, v, attn_mask)
    return q.new_empty((b, h, t, dv), dtype=torch.float32)


_LIB = define_cpu_op("int8_sdpa_cpu(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float q_scale, int q_zp, "
                     "float k_scale, int k_zp, float v_scale, int v_zp, float? scale) -> Tensor", _impl, _fake)


def int8_sdpa_cpu(q, k, v, attn_mask=None, *, q_scale: float, q_zp: int, k_scale: float, k_zp: int,
                  v_scale: float, v_zp: int, scale: float | None = None) -> torch.Tensor:
    """Attention on the stored integers of per-tensor quantized ``q [B, H, T, D]``, ``k [B, H, S, D]``,
    ``v [B, H, S, Dv]`` (``torch.ops.quantkit.int8_sdpa_cpu``): float32 ``[B, H, T, Dv]``.

    Args:
        q, k, v: uint8 (or int8) tensors, the last dim contiguous; any other strides.
        attn_mask: None, bool (True attends) or an additive float mask broadcastable to ``[B, H, T, S]``.
        q_scale, q_zp, ...: the per-tensor qparams (dequantized value ``(x - zp) * scale``).
        scale: the softmax scale (default ``D ** -0.5``, as ``scaled_dot_product_attention``).

    Example:
        >>> out = int8_sdpa_cpu(q8, k8, v8, mask, q_scale=0.02, q_zp=128, k_scale=0.02, k_zp=128,
        ...                     v_scale=0.01, v_zp=128)
    """
    return torch.ops.quantkit.int8_sdpa_cpu(q, k, v, attn_mask, q_scale, q_zp, k_scale, k_zp, v_scale, v_zp, scale)


def int8_scores_cpu(q, k, *, q_zp: int, k_zp: int) -> torch.Tensor:
    """The kernel's integer part alone: ``(q - zq) . (k - zk)^T`` as int32 ``[B, H, T, S]`` (for tests)."""
    v = torch.zeros(*k.shape[:3], 1, dtype=k.dtype)
    return _run(q, k, v, None, 1.0, q_zp, 1.0, k_zp, 1.0, 0, 1.0, True)[1]
