"""The FFN's GEMM epilogue + GELU + per-token int8 quantize: quantkit's fused kernel against Inductor (issue 28).

In the per-token recipe, between the FFN's two int8 GEMMs sits ``v = gelu(y * s_row + b)`` followed by
``choose_qparams_per_token`` and ``quantize_per_token`` of ``v``. Inductor compiles that chain into one
loop nest with two passes over each row and recomputes the GELU in both. This times, side by side and
interleaved round by round, at MiniLM's shape (32 x 128 tokens, 1536 features):

* Inductor: the chain exactly as the lowered graph writes it, ``torch.compile``d;
* quantkit: ``torch.ops.quantkit.per_token_quant_cpu`` with the program ``mul_row, add_col, gelu``;
* the floor: Inductor's GELU of the same tensor alone (one read, one write, one erf per element).

It also prints how many of the integers the two disagree on (polynomial ``erf`` against ATen's).

    python benchmarks/bench_per_token_quant.py [--rounds 30] [--tokens 4096] [--features 1536]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from quantkit.kernels import per_token_quant_cpu
from quantkit.kernels._cpu_isa import cpu_has
from quantkit.kernels._per_token_quant_cpu import status

_FLAGS = ("avx2", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16", "amx_tile")


def _inductor_chain(y, rs, b):
    v = torch.nn.functional.gelu(y * rs + b)
    scale = v.abs().amax(-1, keepdim=True).clamp_min(1e-5) / 127
    q = torch.clamp(torch.round(v * torch.reciprocal(scale)), -128, 127) + 128
    return q.to(torch.uint8), scale


def _time(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--features", type=int, default=1536)
    args = ap.parse_args(argv)
    st = status()
    if not st.available:
        raise SystemExit(f"per_token_quant_cpu does not run here: {st.reason}")
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    print(f"machine: {name}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"flags: {', '.join(f for f in _FLAGS if cpu_has(f)) or 'none'}")
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(args.tokens, args.features, generator=gen) * 3
    rs = torch.rand(args.tokens, 1, generator=gen) * 0.1 + 0.01
    b = torch.randn(args.features, generator=gen)
    chain = torch.compile(_inductor_chain)
    gelu = torch.compile(lambda t: torch.nn.functional.gelu(t))

    def ours(y, rs, b):
        return per_token_quant_cpu(y, ["mul_row", "add_col", "gelu"], row_scale=rs, cols=[b])

    runs = {"Inductor chain": (chain, (y, rs, b)), "quantkit per_token_quant_cpu": (ours, (y, rs, b)),
            "Inductor GELU alone (floor)": (gelu, (y,))}
    for fn, a in runs.values():  # compile and warm up
        for _ in range(3):
            fn(*a)
    times = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, (fn, a) in runs.items():
            times[k].append(_time(fn, *a))
    qi, si = chain(y, rs, b)
    qo, so = ours(y, rs, b)
    differ = float((qi != qo).double().mean())
    base = statistics.median(times["Inductor chain"])
    print(f"shape {args.tokens} x {args.features}, {args.rounds} interleaved rounds, median ms:")
    for k, t in times.items():
        m = statistics.median(t)
        print(f"  {k:32s} {m:8.2f} ms   {base / m:5.2f}x Inductor chain")
    print(f"integers that differ: {differ:.2e} of all; max scale rel. diff "
          f"{float(((so - si) / si).abs().max()):.1e}")


if __name__ == "__main__":
    main()
