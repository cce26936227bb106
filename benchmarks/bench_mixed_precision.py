"""Mixed precision that stays fast (issue 28, item 3): a fallback with k of N GEMMs float against all-int8.

Target: a fallback recipe with k of its N quantized GEMMs kept float costs no more than about
(1 + k/N) x the all-int8 compiled latency, and its artifact stays <= 0.30x the fp32 checkpoint.

Variants, all compiled with ``quantkit.compile`` (defaults) and timed side by side in one process,
interleaved round by round in a new order each round (as bench_models.py):

- ``all int8``: every layer int8;
- ``k float, fp32 weights``: ``Variants.build(keep)`` as the fallback builds it today;
- ``k float, bf16 weights``: the same graph after ``finish_float_layers`` (no stray q/dq, weights
  stored in bf16; on a CPU with AVX-512 BF16 / AMX the lowering runs those GEMMs in bf16);
- ``fp32 compiled`` and ``bf16 compiled``: the float model (the bf16 one is the alternative a CPU
  user has; never time it on a CPU without native bf16, where bf16 matmuls are emulated).

The kept layers are ``--keep`` linears spread evenly over the graph (a fixed, reproducible choice, not
the fallback's sensitivity ranking: the cost question does not depend on which layers they are).
Sizes are the bytes of the converted graph's tensors (int8 weights, qparams, float layers) over the
float model's parameters.

    python benchmarks/bench_mixed_precision.py [--models block,minilm] [--keep 2] [--reps N] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import platform
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))

import quantkit  # noqa: E402
from bench_models import _bf16, _first, _fresh, _minilm  # noqa: E402  (run as a script: benchmarks/ on sys.path)
from quantkit import _hf  # noqa: E402
from quantkit._qmath import sqnr  # noqa: E402
from quantkit.kernels._cpu_isa import cpu_has  # noqa: E402
from quantkit.lowering._bf16 import bf16_supported  # noqa: E402
from quantkit.lowering._onednn import exact_on_this_cpu  # noqa: E402
from quantkit.pipeline._float_fallback import finish_float_layers  # noqa: E402
from quantkit.pipeline._variants import Variants  # noqa: E402
from tests.models import TransformerBlock  # noqa: E402


def _block():
    """The test block at a size where GEMMs dominate: d=256, 32 sequences of 128 tokens."""
    torch.manual_seed(0)
    x = (torch.randn(32, 128, 256),)
    return TransformerBlock(d=256).eval(), x, [(torch.randn(32, 128, 256),) for _ in range(2)] + [x]


MODELS = {"block": _block, "minilm": _minilm}


def _spread(names: list[str], k: int) -> list[str]:
    """``k`` of ``names`` evenly spaced (the middle of each of k equal slices)."""
    k = max(0, min(k, len(names)))
    return [names[int((i + 0.5) * len(names) / k)] for i in range(k)]


def _nbytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = (t.untyped_storage().data_ptr(), t.nbytes)
        if key not in seen:
            seen.add(key)
            total += t.nbytes
    return total


def _compile(gm):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantkit.compile(gm)


def bench(name: str, keep_k: int, reps: int) -> list[str]:
    model, inputs, calib = MODELS[name]()
    variants = Variants(copy.deepcopy(model), inputs, calib, None)
    gemms = [layer for layer in variants.layers if layer.op != "add"]
    linears = [layer.name for layer in gemms if layer.op == "linear"]
    keep = _spread(linears, keep_k)
    mixed_fp32 = variants.build(keep)
    mixed_bf16 = copy.deepcopy(mixed_fp32)
    done = finish_float_layers(mixed_bf16, keep)
    graphs = {"all int8": variants.build(()), f"{len(keep)} float, fp32 weights": mixed_fp32,
              f"{len(keep)} float, bf16 weights": mixed_bf16}
    runs = {"fp32 compiled": torch.compile(copy.deepcopy(model))}
    if bf16_supported():
        runs["bf16 compiled"] = _bf16(model)
    notes = [f"kept float: {', '.join(keep)} ({len(keep)} of {len(gemms)} int8 GEMMs); finish_float_layers: {done}"]
    for label, gm in graphs.items():
        runs[label] = _compile(gm)
    float_bytes = _nbytes(model)
    with torch.no_grad():
        ref = _first(model(*_fresh(inputs))).float()
        quality, times = {}, {k: [] for k in runs}
        for k, f in runs.items():  # warm up: compiles happen here
            out = _first(f(*_fresh(inputs))).float()
            quality[k] = f"{sqnr(ref, out):.1f}"
            if name == "minilm":
                quality[k] += f" / cos {_hf.cosine(ref, out).mean():.4f}"
            lowering = getattr(getattr(f, "_orig_mod", None), "meta", {}).get("quantkit_lowering")
            if lowering:
                notes.append(f"{k}: " + ", ".join(f"{c} {v}" for c, v in lowering.items() if v))
        order = list(runs)
        for r in range(reps):
            random.Random(r).shuffle(order)
            for k in order:
                args = _fresh(inputs)
                t = time.perf_counter()
                runs[k](*args)
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    int8 = med["all int8"]
    target = 1 + len(keep) / len(gemms)
    rows = []
    for k, t in med.items():
        size = f"{_nbytes(graphs[k]) / float_bytes:.3f}x" if k in graphs else ""
        rows.append(f"| {name} | {k} | {t * 1e3:.2f} | {t / int8:.2f}x | {size} | {quality[k]} |")
    rows.append(f"| {name} | target | (1 + k/N) = {target:.2f}x of all int8 | | <= 0.30x | |")
    return rows + [f"| {name} | note | {n} | | | |" for n in notes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="block,minilm")
    ap.add_argument("--keep", type=int, default=2, help="linears kept float (default 2)")
    ap.add_argument("--reps", type=int, default=0, help="timed rounds (default: block 50, minilm 5)")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = [f for f in ("avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if cpu_has(f)]
    print(f"CPU: {platform.processor() or platform.machine()}, flags: {', '.join(flags) or 'no VNNI / BF16'}; "
          f"{torch.get_num_threads()} threads; torch {torch.__version__}")
    if not exact_on_this_cpu():
        print("note: no VNNI/AMX here: quantkit.compile keeps the reference q/dq graph (not the int8 kernels)")
    if not bf16_supported():
        print("note: no native bf16 here: the bf16 float model is not timed; float layers run in fp32")
    print("| model | variant | median ms | vs all int8 | tensors / fp32 | SQNR dB (/ cos) |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        reps = args.reps or {"block": 50, "minilm": 5}[name]
        for row in bench(name, args.keep, reps):
            print(row, flush=True)


if __name__ == "__main__":
    main()
