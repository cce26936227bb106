"""``quantkit::int4_linear_cpu``: int4 group-wise weight-only linear for x86 CPUs with AVX512-VNNI.

The aten kernel (``_weight_int4pack_mm_for_cpu``) spends ~16 vector instructions per 64 weights
(a LUT permute and two FMAs per 16): on this machine it decodes ~8 GB/s of int4 per core, about a
third of what memory delivers (``benchmarks/int4_cpu_probe.c``). This kernel spends ~3.5:

* Weight nibbles ``q`` in [0, 15] are already unsigned bytes once masked: ``v & 0x0F0F0F0F`` and
  ``(v >> 4) & 0x0F0F0F0F`` give 128 weights from 64 bytes in three instructions.
* ``vpdpbusd`` multiplies 64 of them by signed int8 activations per instruction, accumulating
  exactly in int32.
* The activations are not rounded to 8 bits: each row's group of ``x`` is split into two int8
  digits, ``x ~= s * (a + b / 254)`` with ``s = max|x| / 127``, ``a = round(x / s)`` and ``b`` the
  rounded remainder, so ``x`` keeps ~15 bits relative to its group's largest value: finer than the
  bf16 rounding W4A16 kernels apply (8 bits relative to each value). Two ``vpdpbusd`` per 64
  weights, one per digit.
* Per group and 16 outputs, two FMAs turn the integer dots into ``sum x * w`` with
  ``w = (q - zp) * scale``: ``scale * s * (dot_a + dot_b / 254) - scale * zp * sum(x)``.

The result is accurate to ~2e-5 of the output's scale against float64 (``tests/test_int4_cpu_kernel.py``).

Layout (``pack_int4_cpu``): output channels in blocks of 16 (one zmm of float32 results); for each
block and each 8 consecutive inputs ``k0..k7``, 16 dwords, one per channel, byte ``i`` holding
``q[k_i] | q[k_{4+i}] << 4``. Scales: ``[N / 16, G, 2, 16]`` float32: ``scale`` and the
zero point ``zp`` (unsigned, as a float), ``G = ceil(K / group)``: when the group size does not
divide K the last group holds the remainder (a multiple of 8: both are), with its own activation
scale too.

Rows are processed 4 at a time (the unpacked weights are reused across them); from ``M = 32`` on
(prefill) the weight is instead decoded to bf16, 512 output channels at a time, and multiplied by
oneDNN's bf16 GEMM (bf16 activations and result there, as in aten's kernel). Where the CPU has
AVX512-BF16 the decode rounds with ``vcvtne2ps2bf16``, two 16-channel blocks per 64-byte store
(the same bits as the portable integer rounding): a [128, 576] x [576, 1536] prefill GEMM took
0.75 -> 0.50 ms, [128, 2048] x [2048, 8192] 8.1 -> 5.8 ms (2 threads, AMX Xeon; the bf16 GEMM
alone 0.26 and 3.2 ms).

The C++ is compiled on first use with Inductor's C++ builder (the compiler and flags ``torch.compile``
already uses on CPU) into quantkit's own kernel cache, and loaded only after its SHA-256 matches the
digest recorded when quantkit built it (``kernels/_kernel_cache.py``: Inductor's own cache runs any
library planted under the hash name). ``status()`` says whether this CPU and toolchain run it and, when
not, why (no AVX512-VNNI, a refused cache folder, a library that fails its digest check, a compiler
error); callers keep ``aten._weight_int4pack_mm_for_cpu`` where it cannot run and report that reason.
"""

from __future__ import annotations

import functools

import torch

from ._cpu_isa import cpu_has
from ._kernel_cache import KernelLoadError, KernelStatus, cache_dir, define_cpu_op, load, load_with_status, verify

__all__ = ["int4_linear_cpu", "pack_int4_cpu", "available", "status", "KERNEL", "PREFILL_ROWS", "PREFILL_COLUMNS",
           "BLOCK_N"]

KERNEL = "quantkit::int4_linear_cpu"

BLOCK_N = 16      # output channels per zmm
PREFILL_ROWS = 32  # from this many rows on, decode to bf16 and use the bf16 GEMM
PREFILL_COLUMNS = 512  # output channels decoded at a time there (a [K, 512] bf16 scratch: 4 MiB at K = 4096)

_SOURCE = r"""
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>

#define QK_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

static inline uint16_t qk_f32_to_bf16(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return (uint16_t)(u >> 16);
}

// lanes 0..n-1 of 16 (all for n >= 16)
static inline __mmask16 qk_first(int64_t n) {
  return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

// 16 activations from x[i..] (float32, or bf16 when x_bf16), masked lanes zero
QK_TARGET static inline __m512 qk_load_x(const void* x, int64_t i, __mmask16 mk, int64_t x_bf16) {
  if (x_bf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(mk, (const void*)((const uint16_t*)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(mk, (const float*)x + i);
}

// MR rows of the activation digits (xa, xb: int8, row stride K; xs: the groups' scales s, xsum:
// their sums, row stride G) times NB 16-channel weight blocks (stride wstride dwords; scales stride
// sstride floats) -> acc_out[MR][NB * 16].
template <int MR, int NB>
QK_TARGET static inline void qk_block(const int8_t* xa, const int8_t* xb, const float* xs, const float* xsum,
                                      const uint32_t* w, int64_t wstride, const float* sb, int64_t sstride,
                                      int64_t K, int64_t G, int64_t gs, float* acc_out) {
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  const __m512 inv = _mm512_set1_ps(1.0f / 254.0f);
  __m512 out[MR][NB];
  for (int r = 0; r < MR; ++r) for (int b = 0; b < NB; ++b) out[r][b] = _mm512_setzero_ps();
  const int64_t octets = gs / 8;
  for (int64_t g = 0; g < G; ++g) {
    __m512i da[MR][NB], db[MR][NB];
    for (int r = 0; r < MR; ++r) for (int b = 0; b < NB; ++b) da[r][b] = db[r][b] = _mm512_setzero_si512();
    const int64_t o_end = (g + 1) * octets < K / 8 ? (g + 1) * octets : K / 8;  // a remainder group is shorter
    for (int64_t o = g * octets; o < o_end; ++o) {
      __m512i a0[MR], a1[MR], b0[MR], b1[MR];
      for (int r = 0; r < MR; ++r) {
        const int32_t* pa = (const int32_t*)(xa + r * K + o * 8);
        const int32_t* pb = (const int32_t*)(xb + r * K + o * 8);
        a0[r] = _mm512_set1_epi32(pa[0]); a1[r] = _mm512_set1_epi32(pa[1]);
        b0[r] = _mm512_set1_epi32(pb[0]); b1[r] = _mm512_set1_epi32(pb[1]);
      }
      for (int b = 0; b < NB; ++b) {
        // 16 lines ahead in this block's stream: ~10% on weights coming from DRAM (measured, M = 1)
        _mm_prefetch((const char*)(w + b * wstride + (o + 16) * 16), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512((const void*)(w + b * wstride + o * 16));
        const __m512i lo = _mm512_and_si512(v, lo4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), lo4);
        for (int r = 0; r < MR; ++r) {
          da[r][b] = _mm512_dpbusd_epi32(da[r][b], lo, a0[r]);
          db[r][b] = _mm512_dpbusd_epi32(db[r][b], lo, b0[r]);
          da[r][b] = _mm512_dpbusd_epi32(da[r][b], hi, a1[r]);
          db[r][b] = _mm512_dpbusd_epi32(db[r][b], hi, b1[r]);
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 s = _mm512_loadu_ps(sb + b * sstride + g * 32), z = _mm512_loadu_ps(sb + b * sstride + g * 32 + 16);
      const __m512 sz = _mm512_mul_ps(s, z);
      for (int r = 0; r < MR; ++r) {
        const __m512 d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(db[r][b]), inv, _mm512_cvtepi32_ps(da[r][b]));
        out[r][b] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(xs[r * G + g])), d, out[r][b]);
        out[r][b] = _mm512_fnmadd_ps(sz, _mm512_set1_ps(xsum[r * G + g]), out[r][b]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) for (int b = 0; b < NB; ++b) _mm512_storeu_ps(acc_out + (r * NB + b) * 16, out[r][b]);
}

template <int MR, int NB>
QK_TARGET static inline void qk_rows(const int8_t* xa, const int8_t* xb, const float* xs, const float* xsum,
                                     const uint32_t* w, const float* sb, void* y, int64_t m, int64_t nb,
                                     int64_t N, int64_t K, int64_t G, int64_t gs, int64_t bf16_out) {
  float acc[MR * NB * 16];
  qk_block<MR, NB>(xa + m * K, xb + m * K, xs + m * G, xsum + m * G, w + nb * (K / 8) * 16, (K / 8) * 16,
                   sb + nb * G * 32, G * 32, K, G, gs, acc);
  for (int r = 0; r < MR; ++r) {
    const float* a = acc + r * NB * 16;
    if (bf16_out) {
      uint16_t* yr = (uint16_t*)y + (m + r) * N + nb * 16;
      for (int c = 0; c < NB * 16; ++c) yr[c] = qk_f32_to_bf16(a[c]);
    } else {
      std::memcpy((float*)y + (m + r) * N + nb * 16, a, NB * 16 * sizeof(float));
    }
  }
}

// y[M, N] = x[M, K] @ W^T; x and y float32 (x_bf16 = 0) or bf16 (x_bf16 = 1).
QK_TARGET void kernel(const void* x, const uint32_t* w, const float* sb, void* y,
                      int64_t M, int64_t N, int64_t K, int64_t gs, int64_t x_bf16, int64_t threads) {
  const int64_t G = (K + gs - 1) / gs;  // the last group holds the remainder when gs does not divide K
  std::vector<int8_t> xa((size_t)(M * K)), xb((size_t)(M * K));
  std::vector<float> xs((size_t)(M * G)), xsum((size_t)(M * G));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t base = m * K + g * gs, len = K - g * gs < gs ? K - g * gs : gs;
      __m512 vmax = _mm512_setzero_ps();
      __mmask16 nan = 0;
      for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 mk = qk_first(len - i);
        const __m512 v = qk_load_x(x, base + i, mk, x_bf16);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
      }
      float amax = _mm512_reduce_max_ps(vmax);
      if (nan || amax > 3.4e38f) amax = __builtin_nanf("");  // NaN or inf activations: a NaN result row
      const __m512 rs = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f), k254 = _mm512_set1_ps(254.0f);  // NaN: 0
      const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
      __m512i sa = _mm512_setzero_si512(), sbv = _mm512_setzero_si512();
      for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 mk = qk_first(len - i);
        const __m512 t = _mm512_mul_ps(qk_load_x(x, base + i, mk, x_bf16), rs);
        const __m512i a = _mm512_cvtps_epi32(t);  // round to nearest even
        const __m512i b = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, _mm512_cvtps_epi32(
            _mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(a)), k254))));
        _mm512_mask_cvtepi32_storeu_epi8(xa.data() + base + i, mk, a);
        _mm512_mask_cvtepi32_storeu_epi8(xb.data() + base + i, mk, b);
        sa = _mm512_add_epi32(sa, _mm512_maskz_mov_epi32(mk, a));
        sbv = _mm512_add_epi32(sbv, _mm512_maskz_mov_epi32(mk, b));
      }
      const float s = amax / 127.0f;
      xs[m * G + g] = s;
      xsum[m * G + g] = s * ((float)_mm512_reduce_add_epi32(sa) + (float)_mm512_reduce_add_epi32(sbv) / 254.0f);
    }
  }
  // tasks: groups of NB 16-channel blocks (4 for one row, 2 for two, 1 for row tiles of 4)
  const int64_t nb_per = M == 1 ? 4 : (M == 2 ? 2 : 1);
  const int64_t blocks = N / 16, tasks = (blocks + nb_per - 1) / nb_per;
  const int8_t* pa = xa.data();
  const int8_t* pb = xb.data();
  const float* ps = xs.data();
  const float* pm = xsum.data();
  #pragma omp parallel for num_threads((int)threads) schedule(static)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t nb0 = t * nb_per, nbs = blocks - nb0 < nb_per ? blocks - nb0 : nb_per;
    if (M == 1 && nbs == 4) { qk_rows<1, 4>(pa, pb, ps, pm, w, sb, y, 0, nb0, N, K, G, gs, x_bf16); continue; }
    if (M == 2 && nbs == 2) { qk_rows<2, 2>(pa, pb, ps, pm, w, sb, y, 0, nb0, N, K, G, gs, x_bf16); continue; }
    for (int64_t nb = nb0; nb < nb0 + nbs; ++nb) {
      for (int64_t m = 0; m < M; m += 4) {
        switch (M - m < 4 ? M - m : 4) {
          case 4: qk_rows<4, 1>(pa, pb, ps, pm, w, sb, y, m, nb, N, K, G, gs, x_bf16); break;
          case 3: qk_rows<3, 1>(pa, pb, ps, pm, w, sb, y, m, nb, N, K, G, gs, x_bf16); break;
          case 2: qk_rows<2, 1>(pa, pb, ps, pm, w, sb, y, m, nb, N, K, G, gs, x_bf16); break;
          default: qk_rows<1, 1>(pa, pb, ps, pm, w, sb, y, m, nb, N, K, G, gs, x_bf16); break;
        }
      }
    }
  }
}
"""

_DECODE_SOURCE = r"""
#include <immintrin.h>
#include <cstdint>
#include <omp.h>

#define QK_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define QK_TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

// (q - zp) * scale for the j-th of the 8 nibbles of each dword of v, 16 channels
#define QK_DECODE_F32(v, j, z, s) \
  _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, ((j) & 3) * 8 + ((j) >> 2) * 4), \
                                                                   _mm512_set1_epi32(0xF))), z), s)

// Columns [16 * nb0, 16 * (nb0 + nbs)) of the bf16 transposed weight Wt[K, N] = ((q - zp) * scale)^T,
// from the packed layout, into out[K, 16 * nbs] (the prefill path decodes a slice at a time).
// Rounding to bf16 is to nearest even in both variants (bit-identical results).
QK_TARGET static void decode_portable(const uint32_t* w, const float* sb, uint16_t* out, int64_t K, int64_t gs,
                                      int64_t nb0, int64_t nbs, int64_t threads) {
  const int64_t G = (K + gs - 1) / gs, octets = K / 8, width = nbs * 16;
  const __m512i rnd = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
  #pragma omp parallel for num_threads((int)threads) schedule(static)
  for (int64_t o = 0; o < octets; ++o) {
    const int64_t g = (o * 8) / gs;
    for (int64_t nb = nb0; nb < nb0 + nbs; ++nb) {
      const __m512 s = _mm512_loadu_ps(sb + (nb * G + g) * 32), z = _mm512_loadu_ps(sb + (nb * G + g) * 32 + 16);
      const __m512i v = _mm512_loadu_si512((const void*)(w + (nb * octets + o) * 16));
      for (int j = 0; j < 8; ++j) {
        const __m512i u = _mm512_castps_si512(QK_DECODE_F32(v, j, z, s));
        const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, rnd),
                                                              _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
        _mm256_storeu_si256((__m256i*)(out + (o * 8 + j) * width + (nb - nb0) * 16), _mm512_cvtepi32_epi16(r));
      }
    }
  }
}

// The same with AVX512-BF16: one vcvtne2ps2bf16 rounds two 16-channel blocks, stored as 32 adjacent
// columns (one 64-byte store) instead of six integer instructions and a 32-byte store per block.
QK_TARGET_BF16 static void decode_bf16(const uint32_t* w, const float* sb, uint16_t* out, int64_t K, int64_t gs,
                                       int64_t nb0, int64_t nbs, int64_t threads) {
  const int64_t G = (K + gs - 1) / gs, octets = K / 8, width = nbs * 16;
  // rows of out in order (its writes are 4x the packed reads): each octet's 8 rows, all columns
  #pragma omp parallel for num_threads((int)threads) schedule(static)
  for (int64_t o = 0; o < octets; ++o) {
    const int64_t g = (o * 8) / gs;
    uint16_t* row = out + o * 8 * width;
    int64_t nb = nb0;
    for (; nb + 1 < nb0 + nbs; nb += 2) {
      const float* p0 = sb + (nb * G + g) * 32;
      const float* p1 = p0 + G * 32;
      const __m512 s0 = _mm512_loadu_ps(p0), z0 = _mm512_loadu_ps(p0 + 16);
      const __m512 s1 = _mm512_loadu_ps(p1), z1 = _mm512_loadu_ps(p1 + 16);
      const __m512i v0 = _mm512_loadu_si512((const void*)(w + (nb * octets + o) * 16));
      const __m512i v1 = _mm512_loadu_si512((const void*)(w + ((nb + 1) * octets + o) * 16));
      uint16_t* dst = row + (nb - nb0) * 16;
#define QK_PAIR(j) \
      _mm512_storeu_si512((void*)(dst + (j) * width), \
                          (__m512i)_mm512_cvtne2ps_pbh(QK_DECODE_F32(v1, j, z1, s1), QK_DECODE_F32(v0, j, z0, s0)));
      QK_PAIR(0) QK_PAIR(1) QK_PAIR(2) QK_PAIR(3) QK_PAIR(4) QK_PAIR(5) QK_PAIR(6) QK_PAIR(7)
#undef QK_PAIR
    }
    if (nb < nb0 + nbs) {  // an odd last block
      const __m512 s = _mm512_loadu_ps(sb + (nb * G + g) * 32), z = _mm512_loadu_ps(sb + (nb * G + g) * 32 + 16);
      const __m512i v = _mm512_loadu_si512((const void*)(w + (nb * octets + o) * 16));
      for (int j = 0; j < 8; ++j)
        _mm256_storeu_si256((__m256i*)(row + j * width + (nb - nb0) * 16),
                            (__m256i)_mm512_cvtneps_pbh(QK_DECODE_F32(v, j, z, s)));
    }
  }
}

void kernel(const uint32_t* w, const float* sb, uint16_t* out, int64_t N, int64_t K, int64_t gs,
            int64_t nb0, int64_t nbs, int64_t threads, int64_t native_bf16) {
  if (native_bf16) decode_bf16(w, sb, out, K, gs, nb0, nbs, threads);
  else decode_portable(w, sb, out, K, gs, nb0, nbs, threads);
}
"""


_GEMV_ARGS = ["const void*", "const uint32_t*", "const float*", "void*", "int64_t", "int64_t", "int64_t", "int64_t",
              "int64_t", "int64_t"]
_DECODE_ARGS = ["const uint32_t*", "const float*", "uint16_t*", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t",
                "int64_t", "int64_t"]


def _cpu_gate() -> str | None:
    """None where this CPU can run the kernel, else why not."""
    if not cpu_has("avx512_vnni"):
        return "this CPU has no AVX512-VNNI (or ONEDNN_MAX_CPU_ISA caps it below)"
    capability = torch.backends.cpu.get_cpu_capability()
    if "avx512" not in capability.lower():  # aten's dispatch capped, e.g. ATEN_CPU_CAPABILITY=avx2
        return f"aten's CPU dispatch is {capability}, not AVX-512 (ATEN_CPU_CAPABILITY)"
    return None


@functools.cache
def _loaded() -> tuple[tuple | None, KernelStatus]:
    """``((gemv, decode), status)``: the two kernels, built or verified and loaded from quantkit's
    kernel cache, or ``(None, status)`` with the reason they cannot run here."""
    why = _cpu_gate()
    if why is not None:
        return None, KernelStatus(KERNEL, False, why)
    return load_with_status(KERNEL, lambda: (load("int4_linear_cpu", _GEMV_ARGS, _SOURCE),
                                             load("int4_decode_cpu", _DECODE_ARGS, _DECODE_SOURCE)))


def _compiled():
    """The two compiled kernels, or None where they cannot run here (``status()`` says why)."""
    return _loaded()[0]


def status(build: bool = True) -> KernelStatus:
    """Whether ``int4_linear_cpu`` runs here and why not: AVX512-VNNI (not capped by
    ``ONEDNN_MAX_CPU_ISA``), a C++ compiler Inductor can use, and a kernel cache that passes its
    ownership, permission and digest checks (``fault`` is True for the last two: the CPU could run it).

    Args:
        build: False: never compile or load (for ``inspect``): where this process has not loaded the
            kernel yet, check the cache's libraries without loading them; a kernel not built yet is
            reported as available, "not built yet".

    Example:
        >>> print(status().describe())  # one line
    """
    if build or _loaded.cache_info().currsize:
        return _loaded()[1]
    why = _cpu_gate()
    if why is not None:
        return KernelStatus(KERNEL, False, why)
    try:
        built = verify("int4_linear_cpu", _GEMV_ARGS, _SOURCE) and verify("int4_decode_cpu", _DECODE_ARGS,
                                                                          _DECODE_SOURCE)
    except KernelLoadError as exc:
        return KernelStatus(KERNEL, False, str(exc), fault=True)
    return KernelStatus(KERNEL, True, f"built and verified in {cache_dir()}" if built else
                        f"not built yet: quantkit builds it into {cache_dir()} on first use")


def available() -> bool:
    """Whether ``int4_linear_cpu`` can run here (``status()`` says why not)."""
    return status().available


def pack_int4_cpu(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                  group_size: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scale_zero)`` for ``int4_linear_cpu`` from integer weights ``q[N, K]`` (int4 values,
    in [-8, 7] when ``signed`` else [0, 15]), ``scale`` and ``zero_point`` ``[N, K // group_size]``
    (the weight is ``(q - zero_point) * scale``; ``[N, ceil(K / group_size)]`` with a last group of the
    remainder). Needs ``N % 16 == 0``, ``K % 8 == 0`` and ``group_size % 8 == 0``."""
    n, k = q.shape
    if n % BLOCK_N or group_size % 8 or k % 8:
        raise ValueError(f"int4_linear_cpu needs N % {BLOCK_N} == 0, K % 8 == 0 and group_size % 8 == 0; got "
                         f"N={n}, K={k}, group_size={group_size}")
    shift = 8 if signed else 0
    u = (q.to(torch.int64) + shift)
    if int(u.min()) < 0 or int(u.max()) > 15:
        raise ValueError("int4_linear_cpu: weights outside the int4 range")
    u = u.view(n // BLOCK_N, BLOCK_N, k // 8, 8).permute(0, 2, 1, 3)  # [blocks, octets, 16, 8]
    byte = u[..., :4] | (u[..., 4:] << 4)  # byte i: q[k_i] | q[k_{4+i}] << 4
    dword = byte[..., 0] | (byte[..., 1] << 8) | (byte[..., 2] << 16) | (byte[..., 3] << 24)
    packed = torch.where(dword >= 2 ** 31, dword - 2 ** 32, dword).to(torch.int32).contiguous()
    s = scale.to(torch.float32)
    b = zero_point.to(torch.float32) + shift
    g = -(-k // group_size)
    sb = torch.stack([s.view(n // BLOCK_N, BLOCK_N, g), b.view(n // BLOCK_N, BLOCK_N, g)], dim=2)  # [blocks, 16, 2, G]
    return packed, sb.permute(0, 3, 2, 1).contiguous()  # [blocks, G, 2, 16]


def _check(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> tuple[int, int]:
    blocks, octets, lanes = packed.shape
    k, n = octets * 8, blocks * BLOCK_N
    if lanes != BLOCK_N or packed.dtype != torch.int32 or not packed.is_contiguous():
        raise ValueError(f"int4_linear_cpu: packed must be int32 [N/16, K/8, 16] from pack_int4_cpu, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    if x.shape[-1] != k or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"int4_linear_cpu: x must be float32 or bfloat16 [..., {k}], got {x.dtype} {tuple(x.shape)}")
    if (group_size <= 0 or group_size % 8 or scale_zero.dtype != torch.float32
            or tuple(scale_zero.shape) != (blocks, -(-k // group_size), 2, 16) or not scale_zero.is_contiguous()):
        raise ValueError(f"int4_linear_cpu: scale_zero {scale_zero.dtype} {tuple(scale_zero.shape)} is not the "
                         f"contiguous float32 [N/16, ceil(K/group_size), 2, 16] of pack_int4_cpu for K={k}, "
                         f"group_size={group_size}")
    return n, k


@functools.cache
def _native_bf16() -> int:
    """1 where the prefill decode may use AVX512-BF16's conversion (same bits as the portable one)."""
    return int(cpu_has("avx512_bf16"))


def _impl(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = _check(x, packed, scale_zero, group_size)
    kernels = _compiled()
    if kernels is None:
        raise RuntimeError(f"int4_linear_cpu cannot run here: {status().reason}")
    gemv, decode = kernels
    flat = x.dim() == 2 and x.is_contiguous()
    x2 = x if flat else x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    threads = torch.get_num_threads()
    if m >= PREFILL_ROWS:  # decode PREFILL_COLUMNS output channels at a time to bf16, multiply by oneDNN
        xb = x2.to(torch.bfloat16)
        step = PREFILL_COLUMNS // BLOCK_N
        parts = []
        for nb0 in range(0, n // BLOCK_N, step):
            nbs = min(step, n // BLOCK_N - nb0)
            buf = torch.empty(k, nbs * BLOCK_N, dtype=torch.bfloat16)
            decode(packed, scale_zero, buf, n, k, group_size, nb0, nbs, threads, _native_bf16())
            parts.append(torch.mm(xb, buf))
        y = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).to(x.dtype)
    else:
        y = torch.empty(m, n, dtype=x.dtype)
        if m:
            gemv(x2, packed, scale_zero, y, m, n, k, group_size, int(x.dtype == torch.bfloat16), threads)
    return y if flat else y.reshape(*x.shape[:-1], n)


def _fake(x, packed, scale_zero, group_size):
    n, _ = _check(x, packed, scale_zero, group_size)
    return x.new_empty(*x.shape[:-1], n)


_LIB = define_cpu_op("int4_linear_cpu(Tensor x, Tensor packed, Tensor scale_zero, int group_size) -> Tensor",
                     _impl, _fake)


def int4_linear_cpu(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x[..., K] @ W^T`` for the int4 weight ``W[N, K]`` packed by ``pack_int4_cpu``
    (``torch.ops.quantkit.int4_linear_cpu``); output in x's dtype (float32 or bfloat16). Below
    ``PREFILL_ROWS`` rows x keeps ~15 bits per group (see the module docstring); from there on x and
    the decoded weight are bf16."""
    return torch.ops.quantkit.int4_linear_cpu(x, packed, scale_zero, group_size)
