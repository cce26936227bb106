"""Triton W4A16 (quantkit.w4a16_linear, int4 g128) against bf16 cuBLAS (F.linear) on CUDA, decode sizes.

    python benchmarks/bench_w4a16_gpu.py [--group-size 128]

For each LLM weight shape (N x K) and M = 1, 2, 4, 8, 16 tokens: the median time of both, side by
side (triton.testing.do_bench, CUDA graphs off), the speedup, and the Triton result's relative error
against a float64 reference. Needs CUDA; without it, prints why and exits 0 (run from
benchmarks/gpu_check.sh on a GPU machine).
"""

from __future__ import annotations

import argparse
import sys

import torch

# (name, N, K): Llama-2-7B attention / MLP, Llama-3-8B MLP, Llama-2-70B attention
SHAPES = [("qkvo 7B", 4096, 4096), ("up/gate 7B", 11008, 4096), ("down 7B", 4096, 11008),
          ("up/gate 8B", 14336, 4096), ("down 8B", 4096, 14336), ("qkvo 70B", 8192, 8192)]
TOKENS = (1, 2, 4, 8, 16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (this benchmark is for GPU machines)")
        return 0
    import triton.testing

    import quantkit  # noqa: F401  (registers the ops)
    from quantkit import _qmath
    from quantkit.kernels import w4a16_linear

    g = args.group_size
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, int4 g{g} asymmetric")
    print("| shape | N x K | M | bf16 cuBLAS (us) | W4A16 Triton (us) | speedup | rel. error vs float64 |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.02
        lo, hi = _qmath.group_min_max(w, g)
        scale, zp = _qmath.choose_qparams_group(lo, hi, quant_min=0, quant_max=15, symmetric=False,
                                                dtype=torch.uint8)
        q = _qmath.quantize_group(w, scale, zp, 0, 15, torch.uint8, g)
        w_dq = _qmath.dequantize_group(q, scale, zp, 0, 15, torch.uint8, g)
        packed = _qmath.pack_int4(q).to(dev)
        scale_d, zp_d = scale.to(dev), zp.to(dev)
        w16 = w_dq.to(dev, torch.bfloat16)
        for m in TOKENS:
            x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
            y = w4a16_linear(x, packed, scale_d, zp_d, g, False, None)
            ref = x.double() @ w_dq.to(dev).double().t()
            err = float((y.double() - ref).norm() / ref.norm())
            t_bf16 = triton.testing.do_bench(lambda: torch.nn.functional.linear(x, w16), return_mode="median")
            t_w4 = triton.testing.do_bench(lambda: w4a16_linear(x, packed, scale_d, zp_d, g, False, None),
                                           return_mode="median")
            print(f"| {name} | {n} x {k} | {m} | {t_bf16 * 1e3:.1f} | {t_w4 * 1e3:.1f} | {t_bf16 / t_w4:.2f}x | "
                  f"{err:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
