"""oneDNN int8 GEMMs on a CPU without VNNI: fp32 vs u8 x s8 with 8-bit and 7-bit weights.

Without VNNI, oneDNN's int8 GEMM (``gemm:jit`` on AVX2) multiplies with ``vpmaddubsw``, which adds two
u8 x s8 products into a saturating int16. This measures, at MiniLM's MLP shape, in one process,
interleaved round by round:

* fp32 ``F.linear`` (what the reference q/dq graph runs),
* ``onednn.qlinear_pointwise`` with full-range int8 weights (fast, saturated: its error is printed),
* the same with 7-bit weights (-64..63, ``QuantConfig(weight_bits=7)``): exact, since
  2 * 255 * 64 = 32640 fits int16,
* ``torch._int_mm`` (s8 x s8), which oneDNN runs in a reference kernel here.

Run it on the CPU in question (``ONEDNN_MAX_CPU_ISA=AVX2`` on a VNNI CPU shows the AVX2 kernels):

    python benchmarks/bench_avx2_int8.py [--m 4096 --k 384 --n 1536 --rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _ms(fn, calls: int = 3) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--k", type=int, default=384)
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-int-mm", action="store_true", help="skip torch._int_mm (seconds per call without VNNI)")
    a = ap.parse_args()
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    flags = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8") if caps.get(f)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU flags: {' '.join(flags) or '?'}")
    gen = torch.Generator().manual_seed(0)
    m, k, n = a.m, a.k, a.n
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    xq = torch.randint(0, 256, (m, k), generator=gen, dtype=torch.uint8)
    ws, wz = torch.full((n,), 0.01), torch.zeros(n, dtype=torch.long)
    rows = {"fp32 linear": lambda: torch.nn.functional.linear(x, w)}
    errors = {}
    for label, lo, hi in (("u8 x s8, 8-bit weights", -128, 127), ("u8 x s8, 7-bit weights", -64, 63)):
        wq = torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int8)
        packed = torch.ops.onednn.qlinear_prepack(wq, [m, k])

        def run(packed=packed):
            return torch.ops.onednn.qlinear_pointwise.default(xq, 0.02, 0, packed, ws, wz, None, 1.0, 0,
                                                              torch.float32, "none", [], "")
        ref = (xq.double() * 0.02) @ (wq.double() * 0.01).T
        errors[label] = float((run().double() - ref).norm() / ref.norm())
        rows[label] = run
    if not a.no_int_mm:
        a8 = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
        w8t = torch.randint(-127, 128, (k, n), generator=gen, dtype=torch.int8)
        rows["_int_mm s8 x s8"] = lambda: torch._int_mm(a8, w8t)
    for fn in rows.values():
        fn()  # warm-up (prepacks, JIT)
    times = {name: [] for name in rows}
    for _ in range(a.rounds):
        for name, fn in rows.items():
            times[name].append(_ms(fn, 1 if name.startswith("_int_mm") else 3))
    base = statistics.median(times["fp32 linear"])
    print(f"{m}x{k}x{n}, median of {a.rounds} interleaved rounds")
    print("| kernel | ms | vs fp32 | relative error vs float64 |")
    print("|---|---|---|---|")
    for name in rows:
        ms = statistics.median(times[name])
        err = f"{errors[name]:.1e}" if name in errors else "-"
        print(f"| {name} | {ms:.2f} | {base / ms:.2f}x | {err} |")


if __name__ == "__main__":
    main()
