"""Weight-only quantization (WeightOnlyQuantizer): GEMM speed, a Llama-architecture model, MiniLM accuracy.

    python benchmarks/bench_weight_only.py                 # all three parts
    python benchmarks/bench_weight_only.py --gemm          # 4096x4096 linear at M = 1 and 8
    python benchmarks/bench_weight_only.py --llama         # hidden 2048, 4 layers, 1 token
    python benchmarks/bench_weight_only.py --minilm [--algorithms rtn,gptq,awq]
    python benchmarks/bench_weight_only.py --gptq          # GPTQ's per-layer math time
    python benchmarks/bench_weight_only.py --gemm --threads 1 --clock cpu   # on a shared machine

Speed is measured side by side in one process, interleaved: every round runs each variant once
(``--calls`` calls, averaged), and the reported speedups are medians of the per-round ratios, so a
busy machine slows every variant of a round alike. Accuracy is all-MiniLM-L6-v2's held-out mean
embedding cosine against fp32 (calibration: the first 128 bundled sentences; held out: the last
100; seq_len 64; every linear quantized, embeddings float), the split of bench_minilm_recipes.py.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch

import quantkit
from quantkit.quantizers import WeightOnlyQuantizer

aten = torch.ops.aten


_CLOCK = time.perf_counter  # --clock cpu: time.thread_time (this thread's CPU time; 1 thread only)


def _timed_rounds(variants: dict, rounds: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call of every variant, per round; the variants of a round run back to back."""
    clock = _CLOCK
    with torch.no_grad():
        for fn in variants.values():  # warm-up (and compilation)
            fn()
            fn()
        times = {name: [] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                t = clock()
                for _ in range(calls):
                    fn()
                times[name].append((clock() - t) / calls)
    return times


def _ratio(times: dict[str, list[float]], base: str, name: str) -> float:
    """Median over rounds of ``base``'s time / ``name``'s time (the speedup of ``name``)."""
    return statistics.median(b / t for b, t in zip(times[base], times[name]))


def _table(times: dict[str, list[float]], base: str, title: str, nbytes: dict | None = None) -> None:
    """Markdown table: median time, speedup vs ``base``; with ``nbytes`` (weight bytes each variant
    reads per call) also the bandwidth that time implies."""
    print(f"\n{title}")
    gbs = "| weight GB/s " if nbytes else ""
    print(f"| variant | median ms/call | speedup vs {base} (median of per-round ratios) {gbs}|")
    print("|---|---|---|" + ("---|" if nbytes else ""))
    for name, ts in times.items():
        med = statistics.median(ts)
        cell = f"| {nbytes[name] / med / 1e9:.1f} " if nbytes and name in nbytes else ("| " if nbytes else "")
        print(f"| {name} | {med * 1e3:.3f} | {_ratio(times, base, name):.2f}x {cell}|")


def _int4_linear(n: int, k: int, group: int):
    """An ``nn.Linear(k, n)`` quantized int4 g``group`` asymmetric through quantkit, eager and lowered."""
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).eval()
    x = torch.randn(1, k)
    prepared = quantkit.prepare(quantkit.capture(model, (x,)), WeightOnlyQuantizer(bits=4, group_size=group))
    quantkit.calibrate(prepared, [x], progress=False)
    return model, quantkit.convert(prepared)


def bench_gemm(args) -> None:
    n = k = 4096
    g = 128
    model, converted = _int4_linear(n, k, g)
    from quantkit.lowering._weight_only import lower_weight_only

    from quantkit.kernels import int4_cpu_available, int4_linear_cpu

    lowered = copy.deepcopy(converted)  # aten's kernel, for its packed weights and the eager lowered graph
    counts = lower_weight_only(lowered, "cpu", int4_kernel="aten")
    assert counts["weight_only_int4"] == 1, counts
    compiled = quantkit.compile(converted)  # quantkit's int4 kernel where this CPU runs it
    packed = next(b for name, b in lowered.named_buffers() if name.startswith("_qk_int4pack_"))
    sz = next(b for name, b in lowered.named_buffers() if name.startswith("_qk_int4_scale_zero_"))
    ours = None
    if int4_cpu_available():
        ours = copy.deepcopy(converted)
        lower_weight_only(ours, "cpu", int4_kernel="quantkit")
        qk_packed = next(b for name, b in ours.named_buffers() if name.startswith("_qk_int4cpu_packed_"))
        qk_sb = next(b for name, b in ours.named_buffers() if name.startswith("_qk_int4cpu_scale_zero_"))
        qk_bytes = qk_packed.numel() * 4 + qk_sb.numel() * 4
    w32 = model[0].weight.detach()
    w16 = w32.bfloat16()
    sz32 = sz.float()
    int4_bytes = packed.numel() + sz.numel() * sz.element_size()
    for m in args.tokens:
        x = torch.randn(m, k)
        xb = x.bfloat16()
        variants = {
            "fp32 eager (F.linear)": lambda: torch.nn.functional.linear(x, w32),
            "bf16 eager (F.linear)": lambda: torch.nn.functional.linear(xb, w16),
            "int4 g128 aten kernel (bf16 in/out)": lambda: aten._weight_int4pack_mm_for_cpu(xb, packed, g, sz),
            "int4 g128 aten lowered graph (fp32 in/out, eager)": lambda: lowered(x),
            "int4 g128 quantkit.compile": lambda: compiled(x),
        }
        if ours is not None:
            variants["int4 g128 quantkit kernel (fp32 in/out)"] = lambda: int4_linear_cpu(x, qk_packed, qk_sb, g)
        if args.diagnose:  # slow variants: aten's fp32-activation path, the unlowered q/dq graph
            variants["int4 g128 kernel (fp32 in/out, fp32 scales)"] = lambda: aten._weight_int4pack_mm_for_cpu(
                x, packed, g, sz32)
            variants["int4 g128 q/dq reference (eager)"] = lambda: converted(x)
        nbytes = {name: int4_bytes for name in variants if name.startswith("int4") and "q/dq" not in name}
        nbytes.update({"fp32 eager (F.linear)": w32.numel() * 4, "bf16 eager (F.linear)": w16.numel() * 2})
        if ours is not None:
            nbytes.update({"int4 g128 quantkit kernel (fp32 in/out)": qk_bytes, "int4 g128 quantkit.compile": qk_bytes})
        times = _timed_rounds(variants, args.rounds, args.calls)
        _table(times, "fp32 eager (F.linear)",
               f"4096x4096 linear, M = {m} (x @ W^T, weights 64 MiB fp32 / 32 MiB bf16 / 8.5 MiB int4 + scales)",
               nbytes)
        bf16 = "bf16 eager (F.linear)"
        for name in ("int4 g128 aten kernel (bf16 in/out)", "int4 g128 quantkit kernel (fp32 in/out)",
                     "int4 g128 quantkit.compile"):
            if name not in times:
                continue
            print(f"{name}: {_ratio(times, 'fp32 eager (F.linear)', name):.2f}x fp32 eager, "
                  f"{_ratio(times, bf16, name):.2f}x bf16 eager" + ("  (issue 14 targets at M = 1: >= 6x, >= 3x)"
                                                                   if m == 1 else ""))


def bench_llama(args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # TinyLlama-1.1B's widths (hidden 2048, intermediate 5632, 32 heads, 4 KV heads), 4 layers
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).eval()
    model.config.use_cache = False
    ids = torch.randint(0, cfg.vocab_size, (1, 1))
    t = time.perf_counter()
    gm = quantkit.capture(model, {"input_ids": ids})
    prepared = quantkit.prepare(gm, WeightOnlyQuantizer(bits=4, group_size=128))
    # RTN: the weights are what is measured; one batch of the captured (1-token) shape
    quantkit.calibrate(prepared, [{"input_ids": torch.randint(0, cfg.vocab_size, (1, 1))}], progress=False)
    converted = quantkit.convert(prepared)
    t_quant = time.perf_counter() - t
    t = time.perf_counter()
    # float_dtype="fp32": the ops around the int4 GEMMs stay float32, as in the fp32 model (the bf16
    # float-ops pass of quantkit.compile's "auto" fails on this graph's rotary-embedding dtype asserts)
    compiled = quantkit.compile(converted, float_dtype="fp32")
    with torch.no_grad():
        compiled(input_ids=ids)
    t_compile = time.perf_counter() - t
    print(f"\nLlama (hidden 2048, 4 layers, vocab 32000, {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M "
          f"params, random weights): quantize {t_quant:.0f} s, compile + first call {t_compile:.0f} s; lowering "
          f"{compiled._orig_mod.meta['quantkit_lowering']}")
    variants = {
        "fp32 eager (HF model)": lambda: model(input_ids=ids),
        "int4 g128 quantkit.compile": lambda: compiled(input_ids=ids),
    }
    times = _timed_rounds(variants, args.rounds, max(1, args.calls // 4))
    _table(times, "fp32 eager (HF model)", "Llama-architecture model, 1 token (no KV cache)")


def bench_minilm(args) -> None:
    from _minilm_split import heldout_split

    embedder, calib, held, ref, _, _ = heldout_split()
    gm = quantkit.capture(embedder, calib[0])
    rows = [
        ("int4 g128 asymmetric", dict(bits=4, group_size=128)),
        ("int4 g128 symmetric", dict(bits=4, group_size=128, symmetric=True)),
        ("int4 g32 asymmetric", dict(bits=4, group_size=32)),
        ("int4 g32 symmetric", dict(bits=4, group_size=32, symmetric=True)),
        ("NF4 g128", dict(bits=4, group_size=128, scheme="nf4")),
        ("NF4 g64", dict(bits=4, group_size=64, scheme="nf4")),
        ("int8 per channel symmetric", dict(bits=8, group_size=None, symmetric=True)),
    ]
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    print("\nall-MiniLM-L6-v2, every linear weight-only quantized: held-out mean cosine vs fp32 (time to quantize)")
    print("| weights | " + " | ".join(algorithms) + " |")
    print("|---|" + "---|" * len(algorithms))
    for name, kw in rows:
        cells = []
        for algorithm in algorithms:
            if algorithm != "rtn" and kw.get("scheme") == "nf4":
                cells.append("n/a")
                continue
            t = time.perf_counter()
            prepared = quantkit.prepare(gm, WeightOnlyQuantizer(algorithm=algorithm, **kw))
            quantkit.calibrate(prepared, calib, progress=False)
            q = quantkit.convert(prepared)
            seconds = time.perf_counter() - t
            with torch.no_grad():
                cos = torch.nn.functional.cosine_similarity(q(**held), ref, dim=-1)
            cells.append(f"{cos.mean():.4f} ({seconds:.0f} s)")
        print(f"| {name} | " + " | ".join(cells) + " |")


def bench_gptq(args) -> None:
    """GPTQ's per-layer math (``gptq_quantize``, int4 g128 asymmetric, act_order) on MiniLM's
    linear shapes and a 4096x4096 layer; a synthetic correlated Hessian (2k samples)."""
    from quantkit.accuracy._gptq import gptq_quantize
    from quantkit.accuracy._wscheme import WeightScheme

    print("\nGPTQ per layer (gptq_quantize, int4 g128 asymmetric, act_order, float64), median of rounds")
    print("| layer [out x in] | rounds | median s |")
    print("|---|---|---|")
    scheme = WeightScheme(-8, 7, False, 128)
    for n, k, rounds in ((384, 384, 5), (1536, 384, 5), (384, 1536, 3), (4096, 4096, 1)):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2 * k, k, generator=g) @ (torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k))
        h = (x.double().T @ x.double()) / x.shape[0]
        w = torch.randn(n, k, generator=g) * 0.05
        ts = []
        for _ in range(rounds):
            t = _CLOCK()
            gptq_quantize(w, h, scheme)
            ts.append(_CLOCK() - t)
        print(f"| {n} x {k} | {rounds} | {statistics.median(ts):.3f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--llama", action="store_true")
    ap.add_argument("--minilm", action="store_true")
    ap.add_argument("--gptq", action="store_true", help="GPTQ's per-layer time on MiniLM and 4096x4096 shapes")
    ap.add_argument("--diagnose", action="store_true",
                    help="--gemm: also aten's fp32-activation int4 path and the unlowered q/dq graph (slow)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this thread's CPU time (time.thread_time), immune to preemption on a shared "
                         "machine; meaningful with --threads 1 only")
    ap.add_argument("--algorithms", default="rtn", help="MiniLM columns, comma-separated: rtn, gptq, awq")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", type=lambda v: [int(t) for t in v.split(",")], default=[1, 8],
                    help="--gemm: rows M, comma-separated (default 1,8)")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if torch.get_num_threads() != 1:
            ap.error("--clock cpu measures one thread's CPU time: add --threads 1")
        global _CLOCK
        _CLOCK = time.thread_time
    every = not (args.gemm or args.llama or args.minilm or args.gptq)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    if every or args.gemm:
        bench_gemm(args)
    if every or args.llama:
        bench_llama(args)
    if every or args.minilm:
        bench_minilm(args)
    if every or args.gptq:
        bench_gptq(args)


if __name__ == "__main__":
    main()
