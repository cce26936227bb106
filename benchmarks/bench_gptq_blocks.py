"""GPTQ calibration time on all-MiniLM-L6-v2: each block run once (cached block inputs) vs the prefix re-run.

In-memory GPTQ (``quantkit.calibrate`` with weights asking for GPTQ) used to collect each
transformer block's Hessians with one pass over the model's prefix (O(L²) block forwards);
it now runs on the chain of blocks of ``pipeline._partition`` with each block's inputs cached
(O(L)), the same machinery the block-by-block path uses. This times both on the same prepared
graph, interleaved (``--repeats`` rounds of blocks then prefix), and checks their int weights
are identical. Columns: seconds of the GPTQ rounding alone (``run_gptq``), split into the
per-layer algorithm (``gptq_quantize``) and the rest (data passes), and of the whole
``prepare + calibrate + convert`` (capture excluded); the load average is printed beside them
(speed numbers on a shared machine are noisy).

Run:  python benchmarks/bench_gptq_blocks.py [--calib 128] [--scheme int4|w8a8] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from _minilm_split import SentenceEmbedder, interleaved_split  # run as a script: benchmarks/ is on sys.path

import quantkit
from quantkit.accuracy.rounding import _gptq, _gptq_blocks
from quantkit.quantizers import QuantConfig, W8A8Quantizer, WeightOnlyQuantizer


def _quantizer(scheme: str):
    if scheme == "int4":
        return WeightOnlyQuantizer(bits=4, group_size=128, algorithm="gptq")
    return W8A8Quantizer(QuantConfig(weight_algorithm="gptq"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib", type=int, default=128, help="calibration sentences")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--scheme", choices=["int4", "w8a8"], default="int4",
                        help="int4: WeightOnlyQuantizer(bits=4, group_size=128, algorithm='gptq'); "
                             "w8a8: W8A8Quantizer(QuantConfig(weight_algorithm='gptq'))")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    split = interleaved_split(args.batch_size)
    calib = split.batches(split.calibration[:args.calib])
    graph = quantkit.capture(SentenceEmbedder(split.model).eval(), calib[0])
    blocks_gptq = _gptq.run_gptq
    timing: dict[str, float] = {}
    real_quantize = _gptq_blocks.gptq_quantize

    def quantize_timed(*a, **k):  # the per-layer algorithm (column loop), apart from the data passes
        t0 = time.perf_counter()
        try:
            return real_quantize(*a, **k)
        finally:
            timing["layers"] = timing.get("layers", 0.0) + time.perf_counter() - t0

    _gptq_blocks.gptq_quantize = quantize_timed

    def timed(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timing["gptq"] = time.perf_counter() - t0
        return run

    print(f"MiniLM, {args.calib} sentences in batches of {args.batch_size} (seq {split.seq_len}), GPTQ {args.scheme}, "
          f"{torch.get_num_threads()} threads")
    print("| run | GPTQ rounding s | of which gptq_quantize s | data passes s | prepare+calibrate+convert s "
          "| load avg (1 min) |")
    print("|---|---|---|---|---|---|")
    states = {}
    for r in range(args.repeats):
        for name, fn in (("blocks (each block once)", blocks_gptq), ("prefix re-run", _gptq.run_gptq_prefix)):
            _gptq.run_gptq = timed(fn)
            timing["layers"] = 0.0
            t0 = time.perf_counter()
            qm = quantkit.quantize(graph, calib[0], calib, _quantizer(args.scheme), progress=False)
            total = time.perf_counter() - t0
            states[name] = {k: v for k, v in qm.state_dict().items() if not v.is_floating_point()}
            print(f"| {name} | {timing['gptq']:.1f} | {timing['layers']:.1f} | {timing['gptq'] - timing['layers']:.1f} "
                  f"| {total:.1f} | {os.getloadavg()[0]:.1f} |", flush=True)
    _gptq.run_gptq = blocks_gptq
    a, b = states.values()
    same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    print(f"integer tensors identical: {same} ({len(a)} tensors)")


if __name__ == "__main__":
    main()
