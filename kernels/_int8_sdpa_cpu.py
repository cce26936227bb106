"""``quantkit::int8_sdpa_cpu``: attention on static per-tensor int8/uint8 q, k, v, on CPU.

``softmax(((q - zq) . (k - zk)^T) * (sq * sk * scale) + mask) @ ((v - zv) * sv)``, for the stored
integers of a static ``quantize_per_tensor`` of q, k and v (the ``"attention"`` op family of
``W8A8Quantizer``). The reference q/dq graph computes the same attention in float32 on the
dequantized tensors; here:

* ``Q.K^T`` is integer: the zero points are subtracted into int16 and the products summed in int32,
  which is exact (``|q - zq|, |k - zk| <= 255``, so ``D * 255**2`` must stay below ``2**31``:
  ``D <= 33025``, checked). The reference's float32 sums round; these do not.
* the scale, mask, softmax (max-subtracted ``exp``, one float32 sum) and ``P @ V`` are float32,
  with ``V`` dequantized once per (batch, head): float parts agree with the reference to float32
  rounding (``tests/test_int8_attention.py`` states the tolerance). A query whose keys are all
  masked gets zeros, as torch 2.13's ``scaled_dot_product_attention`` gives (measured, CPU).

Why a kernel of our own: torchao 0.18's ``torchao::qscaled_dot_product`` has no CPU kernel in this
build (only Meta is registered: "Could not run ... with arguments from the 'CPU' backend"), and it
quantizes the softmax output too, which the reference graph does not.

Portable C++ (no intrinsics): the int16 dot products are loops the compiler vectorises with the
ISA Inductor's flags name (``-march=native``: ``vpmaddwd`` on AVX2, exact since each pair of int16
products fits int32). Parallel over (batch, head, query-block) with OpenMP. Built on first use into
quantkit's kernel cache and loaded after its digest check (``kernels/_kernel_cache.py``);
``status()`` says whether it runs here and why not.
"""

from __future__ import annotations

import functools

import torch

from ._kernel_cache import KernelLoadError, KernelStatus, cache_dir, load

__all__ = ["int8_sdpa_cpu", "int8_scores_cpu", "available", "status", "KERNEL", "MAX_HEAD_DIM"]

KERNEL = "quantkit::int8_sdpa_cpu"
MAX_HEAD_DIM = (2 ** 31 - 1) // (255 * 255)  # int32 Q.K^T stays exact up to this head dim (33025)

_SOURCE = r"""
#include <cstdint>
#include <cmath>
#include <limits>
#include <vector>
#include <omp.h>

// One (batch, head): rows [t0, t1) of the output. q/k/v strides are in elements, the last dim contiguous.
template <typename T>
static void qk_rows(const T* q, const T* k, const T* v, const float* mask, float* out, int32_t* scores,
                    int64_t b, int64_t h, int64_t t0, int64_t t1, int64_t H, int64_t T_, int64_t S, int64_t D,
                    int64_t Dv, const int64_t* qs, const int64_t* ks, const int64_t* vs, const int64_t* ms,
                    int64_t zq, int64_t zk, int64_t zv, float score_scale, float sv, int64_t has_mask,
                    const int16_t* kz, const float* vf, std::vector<int16_t>& qz, std::vector<float>& row) {
  for (int64_t t = t0; t < t1; ++t) {
    const T* qp = q + b * qs[0] + h * qs[1] + t * qs[2];
    for (int64_t d = 0; d < D; ++d) qz[d] = (int16_t)((int32_t)qp[d] - (int32_t)zq);
    float mx = -std::numeric_limits<float>::infinity();
    const float* mp = has_mask ? mask + b * ms[0] + h * ms[1] + t * ms[2] : nullptr;
    for (int64_t s = 0; s < S; ++s) {
      const int16_t* kp = kz + s * D;
      int32_t acc = 0;
      for (int64_t d = 0; d < D; ++d) acc += (int32_t)qz[d] * (int32_t)kp[d];
      if (scores) scores[((b * H + h) * T_ + t) * S + s] = acc;
      float f = (float)acc * score_scale;
      if (mp) f += mp[s * ms[3]];
      row[s] = f;
      mx = f > mx ? f : mx;
    }
    float* op = out + ((b * H + h) * T_ + t) * Dv;
    for (int64_t e = 0; e < Dv; ++e) op[e] = 0.0f;
    if (mx == -std::numeric_limits<float>::infinity()) continue;  // every key masked: 0, as torch's SDPA gives
    float sum = 0.0f;
    for (int64_t s = 0; s < S; ++s) { row[s] = std::exp(row[s] - mx); sum += row[s]; }
    const float inv = 1.0f / sum;
    for (int64_t s = 0; s < S; ++s) {
      const float p = row[s] * inv;
      const float* vp = vf + s * Dv;
      for (int64_t e = 0; e < Dv; ++e) op[e] += p * vp[e];
    }
  }
}

template <typename T>
static void qk_run(const T* q, const T* k, const T* v, const float* mask, float* out, int32_t* scores,
                   int64_t B, int64_t H, int64_t T_, int64_t S, int64_t D, int64_t Dv, const int64_t* st,
                   int64_t zq, int64_t zk, int64_t zv, float score_scale, float sv, int64_t has_mask,
                   int64_t threads) {
  const int64_t* qs = st; const int64_t* ks = st + 3; const int64_t* vs = st + 6; const int64_t* ms = st + 9;
  const int64_t TB = 32;  // query rows per task: K and V of the head are reused across them
  const int64_t tblocks = (T_ + TB - 1) / TB;
  // each (batch, head) needs k - zk (int16) and (v - zv) * sv (float32): built once per head
  std::vector<int16_t> kz_all((size_t)(B * H * S * D));
  std::vector<float> vf_all((size_t)(B * H * S * Dv));
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t s = 0; s < S; ++s) {
      const T* kp = k + b * ks[0] + h * ks[1] + s * ks[2];
      const T* vp = v + b * vs[0] + h * vs[1] + s * vs[2];
      int16_t* kd = kz_all.data() + (bh * S + s) * D;
      float* vd = vf_all.data() + (bh * S + s) * Dv;
      for (int64_t d = 0; d < D; ++d) kd[d] = (int16_t)((int32_t)kp[d] - (int32_t)zk);
      for (int64_t e = 0; e < Dv; ++e) vd[e] = (float)((int32_t)vp[e] - (int32_t)zv) * sv;
    }
  }
  #pragma omp parallel num_threads(threads)
  {
    std::vector<int16_t> qz((size_t)D);
    std::vector<float> row((size_t)S);
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < B * H * tblocks; ++task) {
      const int64_t bh = task / tblocks, tb = task % tblocks;
      const int64_t t0 = tb * TB, t1 = t0 + TB < T_ ? t0 + TB : T_;
      qk_rows<T>(q, k, v, mask, out, scores, bh / H, bh % H, t0, t1, H, T_, S, D, Dv, qs, ks, vs, ms, zq, zk, zv,
                 score_scale, sv, has_mask, kz_all.data() + bh * S * D, vf_all.data() + bh * S * Dv, qz, row);
    }
  }
}

// st: 12 strides (q, k, v: batch, head, row; mask: batch, head, query, key). want_scores: also write
// the int32 Q.K^T to scores [B, H, T, S] (tests).
void kernel(const void* q, const void* k, const void* v, const float* mask, float* out, int32_t* scores,
            const int64_t* st, int64_t B, int64_t H, int64_t T_, int64_t S, int64_t D, int64_t Dv,
            int64_t is_signed, int64_t zq, int64_t zk, int64_t zv, float score_scale, float sv,
            int64_t has_mask, int64_t want_scores, int64_t threads) {
  int32_t* sc = want_scores ? scores : nullptr;
  if (is_signed)
    qk_run<int8_t>((const int8_t*)q, (const int8_t*)k, (const int8_t*)v, mask, out, sc, B, H, T_, S, D, Dv, st,
                   zq, zk, zv, score_scale, sv, has_mask, threads);
  else
    qk_run<uint8_t>((const uint8_t*)q, (const uint8_t*)k, (const uint8_t*)v, mask, out, sc, B, H, T_, S, D, Dv, st,
                    zq, zk, zv, score_scale, sv, has_mask, threads);
}
"""

_ARGS = ["const void*", "const void*", "const void*", "const float*", "float*", "int32_t*", "const int64_t*",
         "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t",
         "float", "float", "int64_t", "int64_t", "int64_t"]


@functools.cache
def _loaded():
    try:
        fn = load("int8_sdpa_cpu", _ARGS, _SOURCE)
    except KernelLoadError as exc:
        return None, KernelStatus(KERNEL, False, str(exc), fault=True)
    except Exception as exc:  # noqa: BLE001  Inductor internals of another torch release: a reason, not a crash
        text = " ".join(str(exc).split())[:200]
        return None, KernelStatus(KERNEL, False, f"building it failed ({type(exc).__name__}: {text})", fault=True)
    return fn, KernelStatus(KERNEL, True, f"built and verified in {cache_dir()}")


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


def _register():
    """Define the op once per process (this file may be imported as ``quantkit.kernels`` and as ``kernels``)."""
    if hasattr(torch.ops.quantkit, "int8_sdpa_cpu"):
        return None
    lib = torch.library.Library("quantkit", "FRAGMENT")
    lib.define("int8_sdpa_cpu(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, float q_scale, int q_zp, "
               "float k_scale, int k_zp, float v_scale, int v_zp, float? scale) -> Tensor")
    lib.impl("int8_sdpa_cpu", _impl, "CPU")
    torch.library.register_fake("quantkit::int8_sdpa_cpu", _fake, lib=lib)
    return lib


_LIB = _register()


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
