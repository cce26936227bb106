"""How fast can int8 MiniLM be against bf16 on this CPU? Its GEMMs and attention, one by one (issue 17).

Issue 17 asks MiniLM (32 x 128 tokens) compiled int8 to be >= 1.6x bf16 compiled, "the limit is 2x"
(VNNI ``vpdpbusd`` against AVX-512 ``vdpbf16ps``). This times the pieces the two models are made of,
side by side, interleaved round by round, at MiniLM's shapes:

* each of the four linear shapes of a layer (q/k/v merged into one GEMM as quantkit's lowering does;
  bf16 keeps three), as oneDNN's bf16 linear on a prepacked weight (what Inductor's freezing runs in the
  bf16 model) and as oneDNN's int8 ``qlinear_pointwise`` (uint8 activations with a zero point, int8
  per-channel weights, bf16 output: what quantkit's lowering runs), and ``torch._int_mm``;
* the attention (``scaled_dot_product_attention``, 32 x 12 heads x 128 x 32) in bf16: both models run it.

It then adds them up per model (6 layers) and prints the ceiling: the int8 model's time if everything
besides its GEMMs cost what the bf16 model's does, and the speedup over bf16 that allows.

    python benchmarks/bench_cpu_int8_ceiling.py [--rounds 15] [--threads N]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

TOKENS, HIDDEN, FFN, HEADS, SEQ, LAYERS = 32 * 128, 384, 1536, 12, 128, 6
# (name, K, N, how many per layer in the bf16 model, in the int8 model)
SHAPES = (("q/k/v", HIDDEN, HIDDEN, 3, 0), ("q/k/v merged", HIDDEN, 3 * HIDDEN, 0, 1),
          ("attention out", HIDDEN, HIDDEN, 1, 1), ("FFN up", HIDDEN, FFN, 1, 1), ("FFN down", FFN, HIDDEN, 1, 1))


def _bf16_linear(k: int, n: int):
    lin = torch.nn.Linear(k, n).eval().bfloat16()
    compiled = torch.compile(lin)
    x = torch.randn(TOKENS, k).bfloat16()

    def run():
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            return compiled(x)

    return run


def _int8_linear(k: int, n: int):
    x = torch.randint(0, 256, (TOKENS, k), dtype=torch.uint8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    packed = torch.ops.onednn.qlinear_prepack(w, [TOKENS, k])
    scales, zps, bias = torch.rand(n) * 0.01, torch.zeros(n, dtype=torch.int32), torch.randn(n)
    return lambda: torch.ops.onednn.qlinear_pointwise(x, 0.02, 3, packed, scales, zps, bias, 1.0, 0,
                                                      torch.bfloat16, "none", [], "")


def _int_mm(k: int, n: int):
    x = torch.randint(-127, 128, (TOKENS, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (k, n), dtype=torch.int8)
    return lambda: torch._int_mm(x, w)


def _sdpa(dtype):
    q, k, v = (torch.randn(32, HEADS, SEQ, HIDDEN // HEADS, dtype=dtype) for _ in range(3))
    mask = torch.zeros(32, 1, SEQ, SEQ, dtype=dtype)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    flags = ", ".join(f for f in ("avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16") if caps.get(f))
    print(f"machine: {platform.processor() or platform.machine()} ({flags}), {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    variants = {}
    for name, k, n, _, _ in SHAPES:
        variants[f"{name} bf16"] = _bf16_linear(k, n)
        variants[f"{name} int8 qlinear"] = _int8_linear(k, n)
        variants[f"{name} _int_mm"] = _int_mm(k, n)
    variants["SDPA bf16"] = _sdpa(torch.bfloat16)
    variants["SDPA fp32"] = _sdpa(torch.float32)
    times = {name: [] for name in variants}
    with torch.no_grad():
        for fn in variants.values():
            fn()
            fn()
        for _ in range(args.rounds):
            for name, fn in variants.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}

    print(f"\nMiniLM's GEMMs at {TOKENS} tokens and its attention, median ms of {args.rounds} interleaved rounds")
    print("| op | bf16 | int8 qlinear | int8 / bf16 speed | `_int_mm` |")
    print("|---|---|---|---|---|")
    for name, k, n, _, _ in SHAPES:
        b, q, i = ms[f"{name} bf16"], ms[f"{name} int8 qlinear"], ms[f"{name} _int_mm"]
        print(f"| {name} [{TOKENS}x{k}] x [{k}x{n}] | {b:.2f} | {q:.2f} | {b / q:.2f}x | {i:.2f} |")
    print(f"| SDPA 32x{HEADS}x{SEQ}x{HIDDEN // HEADS} | {ms['SDPA bf16']:.2f} | (fp32: {ms['SDPA fp32']:.2f}) | | |")

    gemm_b = LAYERS * sum(ms[f"{name} bf16"] * nb for name, _, _, nb, _ in SHAPES)
    gemm_q = LAYERS * sum(ms[f"{name} int8 qlinear"] * nq for name, _, _, _, nq in SHAPES)
    attn = LAYERS * ms["SDPA bf16"]
    print(f"\nper model ({LAYERS} layers): bf16 GEMMs {gemm_b:.1f} ms, int8 GEMMs {gemm_q:.1f} ms "
          f"({gemm_b / gemm_q:.2f}x), bf16 attention {attn:.1f} ms (both models)")
    for other in (0.0, 10.0):
        b_total, q_total = gemm_b + attn + other, gemm_q + attn + other
        print(f"with {other:.0f} ms of other ops in both: bf16 {b_total:.1f} ms, int8 {q_total:.1f} ms -> "
              f"int8 at most {b_total / q_total:.2f}x bf16 (issue 17 asks >= 1.6x)")
    need = (gemm_b + attn) / 1.6 - attn
    print(f"1.6x would need the int8 GEMMs at {need:.1f} ms ({gemm_b / max(need, 1e-9):.2f}x bf16's) with no other "
          f"ops at all, or an attention faster than bf16's")


if __name__ == "__main__":
    main()
