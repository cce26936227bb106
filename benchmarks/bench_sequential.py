"""Peak memory and time of quantize_pretrained: block by block (--max-memory) vs in memory.

A Llama-architecture causal LM with random weights (>= 2 GB of fp32 by default) is written
as model.safetensors into a temporary directory (by a child process, so that this one stays
small); then each variant runs in a fresh child process and reports its own peak resident
memory, the Python + torch + quantkit baseline included: ``VmHWM`` of /proc/self/status (the
high-water mark of the process image since exec), with ``resource.getrusage(RUSAGE_SELF).ru_maxrss``
beside it (Linux carries ``ru_maxrss`` over exec from the parent's image, so it is at least the
parent's size at fork):

- ``baseline``: ``import torch, transformers, quantkit`` and the calibration batches only;
- ``in-memory``: ``quantize_pretrained(..., sequential=False)`` (loads the float model,
  ``quantkit.quantize``, writes the artifact);
- ``sequential``: ``quantize_pretrained(..., max_memory=SIZE, sequential=True)`` (block by
  block; the budget also bounds the activations kept in memory).

Both write W8A8 artifacts (static uint8 activations, int8 per-channel weights) and the
script checks that they hold the same tensors. Prints a table; ``--json`` for JSON.

    python benchmarks/bench_sequential.py                       # 2.2 GB model, --max-memory 1GiB
    python benchmarks/bench_sequential.py --layers 2 --hidden 512 --vocab 8000   # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch, transformers, quantkit
from quantkit.quantizers import W8A8Quantizer
variant, model_dir, out, max_memory, n_batches, batch, seq = sys.argv[1:8]
g = torch.Generator().manual_seed(0)
vocab = json.load(open(model_dir + "/config.json"))["vocab_size"]
batches = [{"input_ids": torch.randint(0, vocab, (int(batch), int(seq)), generator=g),
            "attention_mask": torch.ones(int(batch), int(seq), dtype=torch.long)} for _ in range(int(n_batches))]
imported = time.perf_counter()
if variant != "baseline":
    kw = dict(sequential=False) if variant == "in-memory" else dict(max_memory=max_memory, sequential=True)
    quantkit.quantize_pretrained(model_dir, batches, W8A8Quantizer(), out=out, progress=False, **kw)
done = time.perf_counter()
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(json.dumps({"variant": variant, "seconds": round(done - imported, 2), "import_seconds": round(imported - t0, 2),
                  "peak_rss_bytes": int(status["VmHWM"].split()[0]) * 1024,
                  "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def write_model(directory: Path, *, hidden: int, intermediate: int, layers: int, heads: int, vocab: int) -> int:
    """A random Llama checkpoint (save_pretrained layout: config.json + model.safetensors); returns its bytes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                   max_position_embeddings=512, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=g) * 0.02  # std 0.02: Llama's initializer_range
    directory.mkdir(parents=True)
    cfg.save_pretrained(directory)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run_child(variant: str, model_dir: Path, out: Path, args) -> dict:
    cmd = [sys.executable, "-c", CHILD, variant, str(model_dir), str(out), args.max_memory, str(args.batches),
           str(args.batch_size), str(args.seq_len)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def same_tensors(a: Path, b: Path) -> bool:
    import torch

    import quantkit

    sa, sb = quantkit.load(a).state_dict(), quantkit.load(b).state_dict()
    return sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-memory", default="1GiB")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--variants", default="baseline,in-memory,sequential",
                   help="comma-separated subset of baseline, in-memory, sequential")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write", metavar="DIR", help=argparse.SUPPRESS)  # child: write the checkpoint, print its bytes
    args = p.parse_args()
    if args.write:
        print(write_model(Path(args.write), hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                          heads=args.heads, vocab=args.vocab))
        return
    with tempfile.TemporaryDirectory(prefix="bench-sequential-") as tmp:
        tmp = Path(tmp)
        t = time.perf_counter()
        cmd = [sys.executable, __file__, "--write", str(tmp / "model")] + [
            f"--{k}={getattr(args, k)}" for k in ("hidden", "intermediate", "layers", "heads", "vocab")]
        size = int(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[-1])
        written = time.perf_counter() - t
        variants = [v.strip() for v in args.variants.split(",")]
        rows = [run_child(v, tmp / "model", tmp / v, args) for v in variants]
        both = "in-memory" in variants and "sequential" in variants
        equal = same_tensors(tmp / "in-memory", tmp / "sequential") if both else None
        artifact = (tmp / "sequential" / "model.pt2").stat().st_size if "sequential" in variants else 0
    by = {r["variant"]: r for r in rows}
    result = {"weights_fp32_bytes": size, "max_memory": args.max_memory, "checkpoint_write_seconds": round(written, 1),
              "calibration": f"{args.batches} batches of {args.batch_size}x{args.seq_len} tokens",
              "artifact_bytes": artifact, "same_tensors": equal, "rows": rows,
              "time_ratio": round(by["sequential"]["seconds"] / by["in-memory"]["seconds"], 2) if both else None}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    gib = 2 ** 30
    print(f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {size / 1e9:.2f} GB fp32 weights; "
          f"W8A8; calibration {result['calibration']}; --max-memory {args.max_memory}")
    print("| variant | peak RSS (GiB) | wall time of the call (s) |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['peak_rss_bytes'] / gib:.2f} | {r['seconds']:.1f} |")
    if both:
        print(f"sequential / in-memory time: {result['time_ratio']:.2f}x; artifacts hold the same tensors: {equal}; "
              f"model.pt2 {artifact / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
