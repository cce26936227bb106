"""Weight-only int4 / NF4 on all-MiniLM-L6-v2: round-to-nearest (RTN) against GPTQ and AWQ.

The 400 bundled sentences are split as in ``bench_accuracy.py``: the even ones calibrate (the
first ``--calib`` of them, 128 by default), every fourth from the fourth (100) is held out. Each
row reports the held-out mean and min cosine between float and quantized sentence embeddings,
the fraction of RTN's gap ``1 - cos`` the algorithm closes, and the seconds ``quantize`` took
(capture + calibration + rounding + convert; noisy on a shared machine).

Run:  python benchmarks/bench_weight_only_accuracy.py [--calib 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _minilm_split import SentenceEmbedder, interleaved_split  # run as a script: benchmarks/ is on sys.path

import quantkit
from quantkit import _hf
from quantkit.quantizers import WeightOnlyQuantizer

CONFIGS = [  # (name, WeightOnlyQuantizer kwargs)
    ("int4 g128 asym", dict(bits=4, group_size=128, symmetric=False)),
    ("int4 g128 sym", dict(bits=4, group_size=128, symmetric=True)),
    ("int4 g32 asym", dict(bits=4, group_size=32, symmetric=False)),
    ("nf4 g64", dict(bits=4, group_size=64, scheme="nf4")),
]


def _embeddings(model, batches) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(**b) for b in batches])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib", type=int, default=128, help="calibration sentences")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--configs", default="all", help="comma-separated config names (default all)")
    parser.add_argument("--algorithms", default="rtn,gptq,awq")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    split = interleaved_split(args.batch_size)
    calib, test = split.batches(split.calibration[:args.calib]), split.batches(split.heldout)
    embedder = SentenceEmbedder(split.model).eval()
    float_test = _embeddings(embedder, test)
    graph = quantkit.capture(embedder, calib[0])
    wanted = None if args.configs == "all" else {c.strip() for c in args.configs.split(",")}
    rows = []
    for name, kwargs in CONFIGS:
        if wanted is not None and name not in wanted:
            continue
        rtn_gap = None
        for algo in args.algorithms.split(","):
            t0 = time.perf_counter()
            qm = quantkit.quantize(graph, calib[0], calib, WeightOnlyQuantizer(algorithm=algo, **kwargs),
                                   progress=False)
            seconds = time.perf_counter() - t0
            cos = _hf.cosine(float_test, _embeddings(qm, test))
            gap = 1 - float(cos.mean())
            if algo == "rtn":
                rtn_gap = gap
            closed = None if rtn_gap in (None, 0) or algo == "rtn" else 1 - gap / rtn_gap
            row = {"config": name, "algorithm": algo, "mean_cosine": round(float(cos.mean()), 5),
                   "min_cosine": round(float(cos.min()), 5),
                   "gap_closed": None if closed is None else round(closed, 3), "seconds": round(seconds, 1)}
            rows.append(row)
            print(row, flush=True)
    print("\n| config | algorithm | mean cos | min cos | RTN gap closed | quantize s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        closed = "" if r["gap_closed"] is None else f"{100 * r['gap_closed']:.0f}%"
        print(f"| {r['config']} | {r['algorithm']} | {r['mean_cosine']:.4f} | {r['min_cosine']:.4f} | {closed} "
              f"| {r['seconds']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
