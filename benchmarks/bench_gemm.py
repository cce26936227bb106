"""GPU GEMM benchmark for issue 4: fused W8A8 linear vs bf16 cuBLAS vs torch._int_mm + separate epilogue.

Shapes: M in {16, 128, 1024, 4096, 8192} x (N, K) in {(4096, 4096), (11008, 4096), (4096, 11008)}.
Static per-tensor activation scale, per-channel weight scale, bias, bf16 output. Reports TOPS
(2*M*N*K / time) and the ratios the issue targets (fused >= 1.6x bf16 at M >= 4096 on 4096x4096,
fused >= 1.0x _int_mm + epilogue everywhere). Needs CUDA; exits with a message without it.

    python benchmarks/bench_gemm.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

MS = (16, 128, 1024, 4096, 8192)
NKS = ((4096, 4096), (11008, 4096), (4096, 11008))


def _time(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100) * 1e-3  # seconds (median)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="M in {128, 4096} only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemm.py needs a CUDA GPU")
    from quantkit.kernels import int8_linear

    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    print("| M | N | K | bf16 TOPS | _int_mm+epi TOPS | fused TOPS | fused/bf16 | fused/(_int_mm+epi) | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator(device=dev).manual_seed(0)
    for n, k in NKS:
        w = torch.randint(-128, 128, (n, k), device=dev, dtype=torch.int8, generator=gen)
        w_t = w.t()  # [K, N] column-major view for _int_mm (what it wants for the second operand)
        w_scale = torch.rand(n, device=dev, generator=gen) * 0.01
        bias = torch.randn(n, device=dev, generator=gen)
        w_bf16 = (w.float() * w_scale[:, None]).to(torch.bfloat16)
        for m in (128, 4096) if args.quick else MS:
            a = torch.randint(-128, 128, (m, k), device=dev, dtype=torch.int8, generator=gen)
            a_scale = torch.tensor([0.02], device=dev)
            a_bf16 = (a.float() * 0.02).to(torch.bfloat16)

            def fused():
                return int8_linear(a, a_scale, None, w, w_scale, bias, "none", torch.bfloat16)

            def int_mm_epilogue():
                acc = torch._int_mm(a, w_t)
                return (acc.float() * (a_scale * w_scale) + bias).to(torch.bfloat16)

            def bf16():
                return torch.nn.functional.linear(a_bf16, w_bf16, bias.to(torch.bfloat16))

            ref = int_mm_epilogue().float()
            err = float((fused().float() - ref).norm() / ref.norm())
            flops = 2 * m * n * k
            t_bf16, t_mm, t_fused = _time(bf16), _time(int_mm_epilogue), _time(fused)
            print(f"| {m} | {n} | {k} | {flops / t_bf16 / 1e12:.0f} | {flops / t_mm / 1e12:.0f} | "
                  f"{flops / t_fused / 1e12:.0f} | {t_bf16 / t_fused:.2f} | {t_mm / t_fused:.2f} | {err:.1e} |",
                  flush=True)


if __name__ == "__main__":
    main()
