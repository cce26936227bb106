"""Issue 28, item 1: per-token + SmoothQuant int8 compiled, side by side with the float and torchao baselines.

all-MiniLM-L6-v2 at 32 sentences x 128 tokens (``bench_models._minilm``: calibrated on the first
batches of the bundled sentences, timed and scored on the last full batch), in one process,
interleaved round by round in a new random order each round (``bench_models``'s protocol):

- fp32 compiled and bf16 compiled (the float model, Inductor freezing): the baselines;
- torchao's int8 dynamic (``quantize_(model, Int8DynamicActivationInt8WeightConfig())``), compiled
  with freezing: per-token int8 activations, per-channel int8 weights, the same Inductor pattern;
- quantkit, SmoothQuant (``--alpha``, default ``auto`` scored per token) then per-token W8A8:
  its reference q/dq graph compiled (``cpu_kernels="reference"``, what ran before issue 28), and
  ``quantkit.compile`` with ``"auto"`` and forced ``"onednn"`` (per-token linears as
  ``aten._int_mm`` -> ``onednn.qlinear_pointwise``, ``lowering/_per_token.py``), fp32 float ops,
  and with ``float_dtype="bf16"`` where the CPU has native BF16.

Each row gives the median latency, the speed against fp32 and bf16 compiled, the mean / min
embedding cosine against the float model, and for quantkit rows the min cosine against quantkit's
own reference q/dq graph (the issue asks >= 0.9999), run eagerly and compiled: per-token
quantization is discontinuous, so Inductor's float rounding alone (the reference graph compiled)
moves a few integers by one level, and MiniLM's outlier rows amplify that (measured here: 0.9983
min cosine between the eager and the compiled reference graph); the second column isolates what
the int8 lowering changes. The CPU's flags head the output, with the
line ``"auto"`` gives when it keeps the reference graph. Only a VNNI/AMX CPU shows the issue's
numbers: without VNNI oneDNN's int8 GEMMs saturate int16 pair sums (the forced row is then fast
but inexact: see its cosine) and bf16 is emulated (~100x slower: bf16 rows are skipped unless
``--bf16``).

    python benchmarks/bench_fast_accurate.py [--reps N] [--threads N] [--alpha auto|0.5] [--bf16]
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench_models import _bf16, _first, _fresh, _minilm  # noqa: E402  (the MiniLM 32x128 setup, once)

import quantkit  # noqa: E402
from quantkit import _hf  # noqa: E402
from quantkit.kernels._cpu_isa import cpu_has  # noqa: E402
from quantkit.lowering._bf16 import bf16_supported  # noqa: E402
from quantkit.lowering._onednn import why_reference  # noqa: E402
from quantkit.quantizers import QuantConfig, W8A8Quantizer  # noqa: E402

PER_TOKEN = QuantConfig(dynamic=True, granularity="per-token")
_REFERENCE = "quantkit per-token+SQ, reference q/dq graph compiled"
_FLAGS = ("avx2", "avx512", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def _frozen(compiled):
    def run(*args):
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            return compiled(*args)

    return run


def _fp32(model):
    return _frozen(torch.compile(copy.deepcopy(model)))


def _torchao_int8_dynamic(model):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    q = copy.deepcopy(model)
    quantize_(q, Int8DynamicActivationInt8WeightConfig())
    return _frozen(torch.compile(q))


def _converted(model, inputs, calib, alpha):
    graph = quantkit.smooth_quant(model, calib, alpha=alpha, example_inputs=inputs, config=PER_TOKEN)
    return quantkit.convert(quantkit.prepare(graph, W8A8Quantizer(PER_TOKEN)))  # dynamic: nothing to calibrate


def _quantkit(converted, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # forced oneDNN without VNNI warns that it saturates; the cosine shows it
        return quantkit.compile(converted, **kw)


def _unfused(converted, **kw):
    """``quantkit.compile`` without the ``per_token_quant_fuse`` pass (its kernel reported missing while
    the passes run, which happens inside ``compile``): what the per-token recipe ran before that pass."""
    from unittest import mock

    from quantkit.kernels import _per_token_quant_cpu

    with mock.patch.object(_per_token_quant_cpu, "available", lambda: False):
        return _quantkit(converted, **kw)


def _cpu_line() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    flags = [f for f in _FLAGS if cpu_has(f)]
    return (f"machine: {name}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}, flags: {', '.join(flags) or 'none'}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (default 5)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) first")
    ap.add_argument("--alpha", default="auto", help="SmoothQuant alpha: 'auto' (scored per token) or a number")
    ap.add_argument("--bf16", action="store_true", help="time the bf16 rows even without native BF16 (emulated: slow)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    alpha = args.alpha if args.alpha == "auto" else float(args.alpha)
    print(_cpu_line())
    model, inputs, calib = _minilm()
    t = time.perf_counter()
    converted = _converted(model, inputs, calib, alpha)
    print(f"SmoothQuant (alpha={alpha}) + per-token W8A8 quantized in {time.perf_counter() - t:.1f} s")
    print(f'quantkit.compile "auto" here: {why_reference(converted) or "oneDNN int8 (exact on this CPU)"}')
    bf16 = bf16_supported() or args.bf16
    builders = {
        "fp32 compiled": lambda: _fp32(model),
        "torchao int8 dynamic (Int8DynamicActivationInt8WeightConfig) compiled": lambda: _torchao_int8_dynamic(model),
        _REFERENCE: lambda: _quantkit(converted, cpu_kernels="reference"),
        "quantkit per-token+SQ compiled (auto)": lambda: _quantkit(converted),
        "quantkit per-token+SQ compiled (onednn, float ops fp32)":
            lambda: _quantkit(converted, cpu_kernels="onednn", float_dtype="fp32"),
        "quantkit per-token+SQ compiled (onednn, float ops fp32, no prologue fusion)":
            lambda: _unfused(converted, cpu_kernels="onednn", float_dtype="fp32"),
    }
    if bf16:
        builders["bf16 compiled"] = lambda: _bf16(model)
        builders["quantkit per-token+SQ compiled (onednn, float ops bf16)"] = \
            lambda: _quantkit(converted, cpu_kernels="onednn", float_dtype="bf16")
        builders["quantkit per-token+SQ compiled (onednn, float ops bf16, no prologue fusion)"] = \
            lambda: _unfused(converted, cpu_kernels="onednn", float_dtype="bf16")
    else:
        print("bf16 rows skipped: no native BF16 on this CPU (emulated bf16 is ~100x slower; --bf16 times it anyway)")
    variants, notes = {}, []
    for label, build in builders.items():
        try:
            variants[label] = build()
        except Exception as e:  # record and go on (e.g. a torchao version without the config)
            notes.append(f"{label}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        lowering = getattr(getattr(variants.get(label), "_orig_mod", None), "meta", {}).get("quantkit_lowering")
        if lowering:
            notes.append(f"{label}: " + ", ".join(f"{k} {v}" for k, v in lowering.items() if v))
    with torch.no_grad():
        ref = _first(model(*_fresh(inputs))).float()
        qdq = _first(converted(*_fresh(inputs))).float()
        quality, outs, times = {}, {}, {k: [] for k in variants}
        for k, f in list(variants.items()):  # warm up: compiles happen here
            try:
                out = _first(f(*_fresh(inputs))).float()
            except Exception as e:
                notes.append(f"{k}: failed at its first call: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                del variants[k], times[k]
                continue
            cos = _hf.cosine(ref, out)
            outs[k] = out
            quality[k] = f"{cos.mean():.5f} / {cos.min():.5f}"
        compiled_ref = outs.get(_REFERENCE)
        for k, out in outs.items():
            if not k.startswith("quantkit"):
                quality[k] += " | |"
                continue
            quality[k] += f" | {_hf.cosine(qdq, out).min():.6f} | "
            quality[k] += f"{_hf.cosine(compiled_ref, out).min():.6f}" if compiled_ref is not None else "n/a"
        order = list(variants)
        for r in range(args.reps):
            random.Random(r).shuffle(order)  # a new order every round (see bench_models.bench)
            for k in order:
                a = _fresh(inputs)
                t = time.perf_counter()
                variants[k](*a)
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    fp32, bf = med.get("fp32 compiled"), med.get("bf16 compiled")
    print(f"\nMiniLM 32x128, median of {args.reps} interleaved rounds")
    print("| variant | median ms | vs fp32 compiled | vs bf16 compiled | cosine vs float, mean / min | "
          "min cosine vs its reference q/dq (eager) | min cosine vs the reference q/dq compiled |")
    print("|---|---|---|---|---|---|---|")
    for k, v in med.items():
        vs_bf16 = f"{bf / v:.2f}x" if bf else "n/a"
        print(f"| {k} | {v * 1e3:.1f} | {fp32 / v:.2f}x | {vs_bf16} | {quality[k]} |")
    for n in notes:
        print(f"note: {n}")


if __name__ == "__main__":
    main()
