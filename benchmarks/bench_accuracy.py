"""Accuracy tools on all-MiniLM-L6-v2: min-max, histogram observers, SmoothQuant, auto_fallback.

The 400 bundled sentences are split three ways, interleaved (the file is grouped by
topic): the even ones (200) calibrate, every fourth from the second (100) drives the
choices (best observer, SmoothQuant alpha, auto_fallback's evaluation), and every
fourth from the fourth (100) is held out and gives the table.
Each row reports the mean and min cosine between float and quantized sentence
embeddings (mean-pooled, normalised: ``quantkit._hf.embed``) on the held-out
sentences, and the fraction of GEMM FLOPs (linear layers + attention matmuls, at the
padded length) that run in int8.

Run:  python benchmarks/bench_accuracy.py [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time

import torch
from _minilm_split import SentenceEmbedder, interleaved_split  # run as a script: benchmarks/ is on sys.path

import quantkit
from quantkit import _hf, observers
from quantkit.pipeline._layers import find_layers, gemm_flops, int8_fraction
from quantkit.quantizers import QuantConfig, W8A8Quantizer

HISTOGRAM_OBSERVERS = ("histogram", "kl", "mse", "percentile")
BUDGET = 0.002  # absolute drop of mean sentence cosine


def _embeddings(model, batches) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(**b) for b in batches])


def _row(name, qmodel, float_test, test, flops, seconds, note=""):
    cos = _hf.cosine(float_test, _embeddings(qmodel, test))
    return {"config": name, "mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()),
            "int8_gemm_fraction": int8_fraction(flops, find_layers(qmodel)), "seconds": seconds, "note": note}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--batch-size", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)

    split = interleaved_split(args.batch_size)
    if len(split.sentences) < 400:
        raise SystemExit(f"expected 400 bundled sentences, found {len(split.sentences)}")
    calib, tune, test = split.batches(split.calibration), split.batches(split.tuning), split.batches(split.heldout)
    embedder = SentenceEmbedder(split.model).eval()
    example = calib[0]
    float_test = _embeddings(embedder, test)
    float_tune = [_embeddings(embedder, [b]) for b in tune]
    float_graph = quantkit.capture(embedder, example)
    flops = gemm_flops(float_graph, test[0])

    def quantize(m, act_observer):
        q = W8A8Quantizer(QuantConfig(act_observer=act_observer))
        src = copy.deepcopy(m) if isinstance(m, torch.fx.GraphModule) else m
        return quantkit.quantize(src, example, calib, q, progress=False)

    def tune_score(q):
        with torch.no_grad():
            return sum(quantkit.metrics.embedding_cosine(f, q(**b)) for f, b in zip(float_tune, tune)) / len(tune)

    rows, tuned = [], {}  # tuned: config -> (tuning score, float model, act observer)

    def add(row):
        rows.append(row)
        print(row, flush=True)

    t = time.perf_counter()
    minmax = quantize(embedder, "minmax")
    tuned["min-max"] = (tune_score(minmax), embedder, "minmax")
    add(_row("min-max (W8A8 static, per-channel weights)", minmax, float_test, test, flops, time.perf_counter() - t))

    # best histogram observer, chosen on the tuning split
    best_obs, best_tune = "minmax", tuned["min-max"][0]
    available = [o for o in HISTOGRAM_OBSERVERS if o in observers.available()]
    hist_rows = []
    for obs in available:
        t = time.perf_counter()
        q = quantize(embedder, obs)
        score = tune_score(q)
        hist_rows.append((score, _row(f"histogram: {obs}", q, float_test, test, flops, time.perf_counter() - t)))
        if score > best_tune:
            best_obs, best_tune = obs, score
    if hist_rows:
        add(max(hist_rows, key=lambda r: r[0])[1] | {"note": f"best of {', '.join(available)} on the tuning split"})
        tuned[f"histogram {best_obs}"] = (best_tune, embedder, best_obs)
    else:
        add({"config": "best histogram method", "note": "histogram observers not merged in this build"})

    for alpha in (0.5, "auto"):
        t = time.perf_counter()
        sm = quantkit.smooth_quant(embedder, calib, alpha=alpha)
        q = quantize(sm, best_obs)
        tuned[f"SmoothQuant alpha={alpha}"] = (tune_score(q), sm, best_obs)
        add(_row(f"+ SmoothQuant (alpha={alpha}, act observer {best_obs})", q, float_test, test, flops,
                 time.perf_counter() - t))
    base = max(tuned, key=lambda k: tuned[k][0])

    # on the best configuration (the row), and on plain min-max to show the search at work
    for name in dict.fromkeys([base, "min-max"]):
        _, base_model, base_obs = tuned[name]
        t = time.perf_counter()
        qmodel, report = quantkit.auto_fallback(
            base_model, example, calib, tune, "cosine", budget=BUDGET,
            quantizer=W8A8Quantizer(QuantConfig(act_observer=base_obs)), progress=True)
        kept = ", ".join(layer.module.removeprefix("model.encoder.") for layer in report.float_layers) or "none"
        add(_row(f"{'+' if name == base else 'min-max +'} auto_fallback (budget {BUDGET} mean cosine, on {name})",
                 qmodel, float_test, test, flops, time.perf_counter() - t,
                 note=f"float: {kept}; tuning-split drop {report.drop:.4g} "
                      f"(all-int8 {report.reference - report.quantized_score:.4g})"))
    print(report)
    print(report.sensitivity)

    print(f"\nall-MiniLM-L6-v2, {len(test) * args.batch_size} held-out sentences, seq_len {split.seq_len}, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads\n")
    print("| configuration | mean cosine | min cosine | GEMM FLOPs in int8 | notes |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "mean_cosine" not in r:
            print(f"| {r['config']} | – | – | – | {r['note']} |")
            continue
        print(f"| {r['config']} | {r['mean_cosine']:.5f} | {r['min_cosine']:.5f} | "
              f"{100 * r['int8_gemm_fraction']:.1f}% | {r['note']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "seq_len": split.seq_len, "fallback": report.to_dict()}, f, indent=1)


if __name__ == "__main__":
    main()
