"""Peak memory of ``quantkit.quantize`` on a model of >= 100 M parameters (issue 12).

Each measurement runs in a fresh subprocess, so that the peak resident set size
(``ru_maxrss``) belongs to that one step. The model is a randomly initialised BERT-base
(110 M parameters; weights do not change the memory pattern) built from its config, calibrated on
random token ids. Reported, as multiples of the model's fp32 weight bytes:

- ``quantize_extra``: peak RSS during quantize minus the RSS just before it (the float model
  already built): what quantizing costs on top of having the model;
- ``total``: peak RSS minus the RSS of the process before the model was built (torch imported):
  the model plus quantizing.

    python benchmarks/bench_memory.py [--layers 12] [--hidden 768] [--batches 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import gc, json, resource, sys, time
import torch, transformers
import quantkit

def rss():  # current resident set size in bytes
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

args = json.loads(sys.argv[1])
torch.manual_seed(0)
base = rss()
cfg = transformers.BertConfig(hidden_size=args["hidden"], num_hidden_layers=args["layers"],
                              num_attention_heads=args["hidden"] // 64, intermediate_size=4 * args["hidden"])
model = transformers.BertModel(cfg).eval()
params = sum(p.numel() for p in model.parameters())
weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
gen = torch.Generator().manual_seed(0)
batches = [{"input_ids": torch.randint(0, cfg.vocab_size, (4, 128), generator=gen),
            "attention_mask": torch.ones(4, 128, dtype=torch.long)} for _ in range(args["batches"])]
gc.collect()
before = rss()
peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
with torch.no_grad():
    qmodel = quantkit.quantize(model, batches[0], batches, progress=False)
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
int8 = sum(b.numel() for b in qmodel.buffers() if b.dtype == torch.int8)
qnodes = sum(1 for n in qmodel.graph.nodes if "quantize_per" in str(n.target) and "dequantize" not in str(n.target))
print(json.dumps({"int8_weights": int8, "quantize_nodes": qnodes, "params": params, "weight_bytes": weight_bytes, "base": base, "before": before,
                  "peak": peak, "peak_before_quantize": peak_before, "seconds": seconds}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--batches", type=int, default=4)
    a = ap.parse_args()
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(vars(a))], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stderr[-2000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    w = r["weight_bytes"]
    print(f"BERT hidden={a.hidden} layers={a.layers}: {r['params'] / 1e6:.1f} M parameters, "
          f"fp32 weights {w / 2**20:.0f} MiB; quantize {r['seconds']:.1f} s; "
          f"{r['int8_weights'] / 1e6:.1f} M int8 weight values, {r['quantize_nodes']} activation quantize ops")
    print(f"  peak RSS during quantize - RSS before it: {(r['peak'] - r['before']) / 2**20:.0f} MiB "
          f"= {(r['peak'] - r['before']) / w:.2f}x the fp32 weights (quantize_extra)")
    print(f"  peak RSS - RSS before the model was built: {(r['peak'] - r['base']) / 2**20:.0f} MiB "
          f"= {(r['peak'] - r['base']) / w:.2f}x the fp32 weights (total)")
    if r["peak_before_quantize"] >= r["peak"]:
        print("  (note: the peak was reached before quantize; the numbers above are upper bounds)")


if __name__ == "__main__":
    main()
