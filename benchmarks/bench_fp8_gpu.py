"""FP8 GEMM on CUDA: torch._scaled_mm (E4M3, row-wise and tensor-wise scales) and quantkit's Triton
FP8 GEMM (kernels/_fp8_gemm.py, per-token x per-channel scales, autotuned) against bf16 cuBLAS at LLM
shapes; what quantkit.compile's FP8 lowering (quantkit/lowering/_fp8.py) runs on a GPU.

    python benchmarks/bench_fp8_gpu.py          # prints a Markdown table; exits 0 without CUDA

Shapes: Llama-3-8B's linears (qkv 4096->6144, o 4096->4096, gate/up 4096->28672, down 14336->4096)
at 1, 16, 128, 2048 and 8192 tokens. Times are medians of 50 CUDA-event-timed calls after 10
warm-ups, operands pre-quantized (the activation quantize is timed separately, per token).
Public figures to compare with (issue 15): FP8 row-wise GEMMs 1.4-1.65x bf16 on H100.
The Triton column is "n/a" (with the reason printed once) where quantkit's kernels cannot be imported;
its first call per shape includes autotuning (not timed: the warm-ups absorb it).
"""

from __future__ import annotations

import statistics
import sys

import torch

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
TOKENS = (1, 16, 128, 2048, 8192)
E4M3 = torch.float8_e4m3fn


def _time(fn, reps: int = 50, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3  # microseconds


def _rowwise(x: torch.Tensor):
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / 448
    return (x.float() / scale).clamp(-448, 448).to(E4M3), scale


def _triton_fp8():
    """quantkit's fp8_linear, or None with the reason printed (e.g. quantkit or torchao not importable)."""
    try:
        from quantkit.kernels import fp8_linear
    except Exception as e:  # noqa: BLE001  the bench still runs its other columns
        print(f"quantkit's Triton FP8 kernel not measured: {type(e).__name__}: {e}")
        return None
    return fp8_linear


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (the CPU path is tested in tests/test_compile_fp8.py)")
        return 0
    cap = torch.cuda.get_device_capability()
    print(f"device: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}")
    if cap < (8, 9):
        print("FP8 tensor cores need sm_89 or newer; nothing to measure")
        return 0
    triton_fp8 = _triton_fp8()
    print("| shape (K->N) | tokens | bf16 cuBLAS (us) | FP8 row-wise (us) | FP8 tensor-wise (us) | "
          "row-wise speedup | quantize per token (us) | row-wise SQNR vs bf16 (dB) | Triton FP8 (us) | "
          "Triton speedup vs bf16 | Triton SQNR vs bf16 (dB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        wq, sw = _rowwise(w)  # [N, K] row-major: .t() is the column-major [K, N] _scaled_mm wants
        wq_t, sw_t = wq.t(), sw.t().contiguous()
        one = torch.ones((), device="cuda")
        for m in TOKENS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            xq, sx = _rowwise(x)
            t_bf16 = _time(lambda: torch.mm(x, w.t()))
            t_row = _time(lambda: torch._scaled_mm(xq, wq_t, sx, sw_t, out_dtype=torch.bfloat16))
            t_tensor = _time(lambda: torch._scaled_mm(xq, wq_t, one, one, out_dtype=torch.bfloat16))
            t_quant = _time(lambda: _rowwise(x))
            ref = torch.mm(x.float(), w.float().t())
            out = torch._scaled_mm(xq, wq_t, sx, sw_t, out_dtype=torch.bfloat16).float()
            db = 20 * torch.log10(ref.norm() / (ref - out).norm()).item()
            tri = "n/a | n/a | n/a"
            if triton_fp8 is not None:
                try:
                    sw_n = sw.reshape(-1)
                    y = triton_fp8(xq, wq, sx, sw_n, None, torch.bfloat16).float()
                    t_tri = _time(lambda: triton_fp8(xq, wq, sx, sw_n, None, torch.bfloat16))
                    db_tri = 20 * torch.log10(ref.norm() / (ref - y).norm()).item()
                    tri = f"{t_tri:.1f} | {t_bf16 / t_tri:.2f}x | {db_tri:.1f}"
                except Exception as e:  # noqa: BLE001  report it in the row, keep measuring the rest
                    tri = f"failed: {type(e).__name__}: {str(e)[:80]} | | "
            print(f"| {name} ({k}->{n}) | {m} | {t_bf16:.1f} | {t_row:.1f} | {t_tensor:.1f} | "
                  f"{t_bf16 / t_row:.2f}x | {t_quant:.1f} | {db:.1f} | {tri} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
