"""``quantkit::per_token_quant_cpu``: a float prologue and per-token int8 quantization in one pass, on CPU.

For each row ``x`` of ``[..., N]``: apply a short *program* of elementwise steps (the per-token scale
and bias of the GEMM that produced ``x``, GELU or ReLU, a per-column SmoothQuant factor, bf16 rounding
where the graph runs a step in bf16), then ``choose_qparams_per_token`` + ``quantize_per_token``::

    scale = max(amax|v|, 1e-5) / 127          (float32, one per row)
    q = clamp(round(v * (1 / scale)), -128, 127) + 128   (uint8: the shifted integers the GEMM reads)

Why: Inductor writes this chain as one loop nest with two passes over the row (the ``amax`` and the
quantize), and recomputes the prologue in both; for a GELU that is two ``erf`` per element. Measured
on the AMX Xeon (issue 28, MiniLM's FFN: 4096 x 1536): 11.9 ms for Inductor's kernel against 4.9 ms
for the GELU alone. Here the row's values are computed once into a buffer that stays in L1, then
quantized from it.

Numerics: the same float32 operations in the same order as the graph's ops (``v * s_row``, ``+ b``,
GELU ``0.5 x (1 + erf(x / sqrt 2))``, ``* c``), except that ``erf``, ``tanh`` and ``exp`` are
polynomial approximations (Abramowitz-Stegun 7.1.26 for ``erf``, as ATen's vectorized ``erf``;
Cephes ``expf``): about 1e-7 absolute on ``erf``, so a value that lands within that of a rounding
boundary may get the neighbouring integer. ``tests/kernels/test_per_token_quant_cpu.py`` checks
the integers against a float64 reference (at most one level off, and rarely) and the scales to
float32 rounding.

Portable C++ (GCC/Clang vector extensions of 16 floats, compiled ``-march=native`` by Inductor's
flags), parallel over rows with OpenMP; built on first use into quantkit's kernel cache and loaded
after its digest check (``kernels/_kernel_cache.py``). ``status()`` says whether it runs here.
"""

from __future__ import annotations

import functools

import torch

from ._cpp_math import cephes_expf
from ._kernel_cache import KernelStatus, define_cpu_op, load, load_with_status

__all__ = ["per_token_quant_cpu", "available", "status", "KERNEL", "STEPS"]

KERNEL = "quantkit::per_token_quant_cpu"
# the program's steps, applied in order to each element (the ids the C++ switch reads)
STEPS = {"mul_row": 1, "add_col": 2, "bf16": 3, "gelu": 4, "gelu_tanh": 5, "relu": 6, "mul_col": 7}
_MAX_STEPS = 16

_SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>

#pragma GCC optimize("tree-loop-vectorize")

typedef float pq_v __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t pq_vi __attribute__((vector_size(64)));
typedef uint32_t pq_vu __attribute__((vector_size(64)));
typedef uint8_t pq_vb __attribute__((vector_size(16), aligned(1), may_alias));
constexpr int64_t W = 16;

static inline pq_v pq_splat(float a) { return (pq_v){} + a; }

// the erf / exp polynomials may fuse their multiply-adds (Inductor builds with -ffp-contract=off);
// the steps that repeat the graph's own ops (row scale, bias, column factor, the quantize) do not
#define PQ_FMA __attribute__((optimize("fp-contract=fast")))

// exp(x), x clamped to [-87, 88]: Cephes expf (_cpp_math.py)
""" + cephes_expf("pq_exp", "pq_v", "pq_vi", attributes="PQ_FMA") + r"""
// erf(x): Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7), the formula ATen's vectorized erf uses
PQ_FMA static inline pq_v pq_erf(pq_v x) {
  const pq_v ax = x < 0.0f ? -x : x;
  const pq_v t = 1.0f / (ax * 0.3275911f + 1.0f);
  pq_v p = pq_splat(1.061405429f);
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  const pq_v y = 1.0f - p * t * pq_exp(-(ax * ax));
  return x < 0.0f ? -y : y;
}

static inline pq_v pq_bf16(pq_v v) {  // round to the nearest bf16, ties to even (finite values)
  pq_vu b = (pq_vu)v;
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  return (pq_v)b;
}

// x: [M][N] rows of float32 (is_bf16 = 0) or bf16 (1), row stride xs; prog: n_steps step ids;
// row: [M] (mul_row); c0, c1: [N] vectors read by the add_col / mul_col steps in order of appearance.
void kernel(const void* x, const float* row, const float* c0, const float* c1, const int64_t* prog,
            uint8_t* q, float* scale, int64_t M, int64_t N, int64_t xs, int64_t is_bf16, int64_t n_steps,
            int64_t threads) {
  const int64_t Np = (N + W - 1) / W * W;
  bool is_row = false;  // row holds one value per row only when the program multiplies by it
  for (int64_t s = 0; s < n_steps; ++s) is_row = is_row || prog[s] == 1;
  #pragma omp parallel num_threads(threads)
  {
    // the row and the column vectors padded to whole vectors (the padding lanes are masked out of amax)
    std::vector<float> buf(Np), pc0(Np, 0.0f), pc1(Np, 0.0f);
    if (c0) std::memcpy(pc0.data(), c0, N * sizeof(float));
    if (c1) std::memcpy(pc1.data(), c1, N * sizeof(float));
    const float* cols[2] = {pc0.data(), pc1.data()};
    int32_t steps[16];  // a local copy: the vector stores into the row buffer may alias prog
    for (int64_t s = 0; s < n_steps; ++s) steps[s] = (int32_t)prog[s];
    pq_vi lane;
    for (int64_t l = 0; l < W; ++l) lane[l] = (int32_t)l;
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      float* b = buf.data();
      if (is_bf16) {
        const uint16_t* src = (const uint16_t*)x + m * xs;
        for (int64_t j = 0; j < N; ++j) { uint32_t u = (uint32_t)src[j] << 16; std::memcpy(b + j, &u, 4); }
      } else {
        std::memcpy(b, (const float*)x + m * xs, N * sizeof(float));
      }
      for (int64_t j = N; j < Np; ++j) b[j] = 0.0f;
      pq_v amax = {};
      const float rm = row[is_row ? m : 0];
      for (int64_t j = 0; j < Np; j += W) {
        pq_v v = *(const pq_v*)(b + j);
        int64_t next_col = 0;
        for (int64_t s = 0; s < n_steps; ++s) {
          switch (steps[s]) {
            case 1: v = v * rm; break;
            case 2: v = v + *(const pq_v*)(cols[next_col++] + j); break;
            case 3: v = pq_bf16(v); break;
            case 4: v = (v * 0.5f) * (pq_erf(v * 0.70710678118654752440f) + 1.0f); break;
            case 5: {  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(u) = 1 - 2 / (exp(2u) + 1)
              pq_v u = (v + v * v * v * 0.044715f) * 0.79788456080286535588f;
              u = u > 9.0f ? pq_splat(9.0f) : (u < -9.0f ? pq_splat(-9.0f) : u);
              const pq_v th = 1.0f - 2.0f / (pq_exp(u * 2.0f) + 1.0f);
              v = (v * 0.5f) * (th + 1.0f);
              break;
            }
            case 6: v = v > 0.0f ? v : pq_splat(0.0f); break;
            case 7: v = v * *(const pq_v*)(cols[next_col++] + j); break;
            default: break;
          }
        }
        if (j + W > N) v = (lane + (int32_t)j) < (int32_t)N ? v : pq_splat(0.0f);
        *(pq_v*)(b + j) = v;
        const pq_v a = v < 0.0f ? -v : v;
        amax = a > amax ? a : amax;
      }
      float am = 0.0f;
      for (int64_t l = 0; l < W; ++l) am = amax[l] > am ? amax[l] : am;
      const float sc = (am > 1e-5f ? am : 1e-5f) / 127.0f;
      const float inv = 1.0f / sc;
      scale[m] = sc;
      uint8_t* qr = q + m * N;
      int64_t j = 0;
      for (; j + W <= N; j += W) {
        pq_v v = *(const pq_v*)(b + j) * inv;
        v = (v + 12582912.0f) - 12582912.0f;  // round half to even (|v| <= 128 here)
        v = v < -128.0f ? pq_splat(-128.0f) : (v > 127.0f ? pq_splat(127.0f) : v);
        const pq_vi iv = __builtin_convertvector(v, pq_vi) + 128;
        *(pq_vb*)(qr + j) = __builtin_convertvector(iv, pq_vb);
      }
      for (; j < N; ++j) {
        float v = b[j] * inv;
        v = (v + 12582912.0f) - 12582912.0f;
        v = v < -128.0f ? -128.0f : (v > 127.0f ? 127.0f : v);
        qr[j] = (uint8_t)((int32_t)v + 128);
      }
    }
  }
}
"""

_ARGS = ["const void*", "const float*", "const float*", "const float*", "const int64_t*", "uint8_t*", "float*",
         "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t"]


@functools.cache
def _loaded():
    return load_with_status(KERNEL, lambda: load("per_token_quant_cpu", _ARGS, _SOURCE))


def status() -> KernelStatus:
    """Whether ``per_token_quant_cpu`` runs here and, when not, why. Builds it on first call."""
    return _loaded()[1]


def available() -> bool:
    """Whether ``per_token_quant_cpu`` can run here (``status()`` says why not)."""
    return status().available


def _program(steps) -> list[int]:
    ids = []
    for s in steps:
        if s not in STEPS:
            raise ValueError(f"per_token_quant_cpu: unknown step {s!r}; use one of {sorted(STEPS)}")
        ids.append(STEPS[s])
    if len(ids) > _MAX_STEPS:
        raise ValueError(f"per_token_quant_cpu: at most {_MAX_STEPS} steps, got {len(ids)}")
    return ids


def _check(x, row_scale, cols, steps):
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() < 1:
        raise ValueError(f"per_token_quant_cpu: x must be a float32 or bfloat16 tensor, got {x.dtype} {tuple(x.shape)}")
    n = x.shape[-1]
    want = sum(1 for s in steps if s in ("add_col", "mul_col"))
    if len(cols) != want or want > 2:
        raise ValueError(f"per_token_quant_cpu: the steps read {want} column vectors (at most 2), got {len(cols)}")
    for c in cols:
        if c.dtype != torch.float32 or c.numel() != n:
            raise ValueError(f"per_token_quant_cpu: a column vector must be float32 with {n} values, got {c.dtype} "
                             f"{tuple(c.shape)}")
    if "mul_row" in steps:
        if row_scale is None or row_scale.dtype != torch.float32 or row_scale.numel() != x.numel() // max(n, 1):
            raise ValueError("per_token_quant_cpu: mul_row needs a float32 row_scale with one value per row")
    return n


def _impl(x, row_scale, col0, col1, steps):
    cols = [c for c in (col0, col1) if c is not None]
    n = _check(x, row_scale, cols, steps)
    prog = torch.tensor(_program(steps) or [0], dtype=torch.int64)
    fn, st = _loaded()
    if fn is None:
        raise RuntimeError(f"per_token_quant_cpu cannot run here: {st.reason}")
    x2 = x.reshape(-1, n) if n else x.reshape(0, 0)
    if x2.numel() and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    q = torch.empty(x.shape, dtype=torch.uint8)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32)
    if q.numel():
        rs = row_scale.contiguous().reshape(-1) if row_scale is not None else torch.zeros(1)
        c = [v.contiguous().reshape(-1) for v in cols] + [torch.zeros(1)] * (2 - len(cols))
        fn(x2, rs, c[0], c[1], prog, q, scale, m, n, x2.stride(0), int(x.dtype == torch.bfloat16), len(steps),
           torch.get_num_threads())
    return q, scale


def _fake(x, row_scale, col0, col1, steps):
    cols = [c for c in (col0, col1) if c is not None]
    _check(x, row_scale, cols, steps)
    return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


_LIB = define_cpu_op("per_token_quant_cpu(Tensor x, Tensor? row_scale, Tensor? col0, Tensor? col1, str[] steps) "
                     "-> (Tensor, Tensor)", _impl, _fake)


def per_token_quant_cpu(x, steps=(), *, row_scale=None, cols=()) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply ``steps`` to each element of ``x [..., N]``, then quantize each row symmetrically to int8,
    stored shifted to uint8 (``q + 128``); returns ``(q_u8 [..., N], scale float32 [..., 1])``.

    Args:
        x: float32 or bfloat16, the last dim contiguous.
        steps: names from ``STEPS``, applied in order: ``"mul_row"`` (times ``row_scale``, one value per
            row), ``"add_col"`` / ``"mul_col"`` (plus / times the next vector of ``cols``, ``[N]``),
            ``"gelu"`` (erf), ``"gelu_tanh"``, ``"relu"``, ``"bf16"`` (round to bfloat16).
        row_scale: float32 ``[..., 1]`` for ``"mul_row"``.
        cols: up to two float32 ``[N]`` vectors, in the order the steps read them.

    Example:
        >>> q, s = per_token_quant_cpu(y, ["mul_row", "add_col", "gelu"], row_scale=s_x, cols=[bias])
    """
    cols = list(cols) + [None] * (2 - len(cols))
    return torch.ops.quantkit.per_token_quant_cpu(x, row_scale, cols[0], cols[1], list(steps))
