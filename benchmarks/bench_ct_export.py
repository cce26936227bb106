"""compressed-tensors export of the bundled all-MiniLM-L6-v2: per scheme, how close transformers'
model of the checkpoint is to quantkit's quantized model and to float (held-out sentence
embeddings), what the export's own verification measured, and how long quantize + export took.

    python benchmarks/bench_ct_export.py [--schemes fp8,fp8-dynamic,w4a16-g32,w8a16] [--heldout 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def _quantizer(scheme: str):
    from quantkit.quantizers import FP8Quantizer, WeightOnlyQuantizer

    return {"fp8": lambda: FP8Quantizer(),
            "fp8-dynamic": lambda: FP8Quantizer(dynamic=True, granularity="per-token"),
            "w4a16-g32": lambda: WeightOnlyQuantizer(bits=4, group_size=32),
            "w4a16-g128": lambda: WeightOnlyQuantizer(bits=4, group_size=128),
            "w8a16": lambda: WeightOnlyQuantizer(bits=8, group_size=None, symmetric=True)}[scheme]()


def main() -> None:
    import transformers

    import quantkit
    from quantkit import _hf

    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default="fp8,fp8-dynamic,w4a16-g32,w8a16")
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--heldout", type=int, default=32)
    args = ap.parse_args()
    path = _hf.default_model_path()
    model, tok = _hf.load_hf_model(path, progress=False)
    texts = _hf.read_sentences(_hf.default_calibration_file())
    enc = lambda s: dict(tok(s, padding=True, truncation=True, max_length=64, return_tensors="pt"))  # noqa: E731
    calib, held = enc(texts[:args.calib]), enc(texts[-args.heldout:])
    with torch.no_grad():
        fp = _hf.embed(model(**held), held["attention_mask"])
    print("| scheme | format | vs quantkit min / mean cos | export vs float mean cos | quantkit vs float mean cos "
          "| tensors equal | loaded with | quantize + export s |")
    print("|---|---|---|---|---|---|---|---|")
    for scheme in args.schemes.split(","):
        t0 = time.perf_counter()
        gm = quantkit.capture(model, calib, dynamic_shapes=_hf.dynamic_shapes(calib))
        prepared = quantkit.prepare(gm, _quantizer(scheme))
        quantkit.calibrate(prepared, [calib], progress=False)
        qmodel = quantkit.convert(prepared)
        out = Path(tempfile.mkdtemp()) / scheme
        # transformers is the consumer here: every scheme (vLLM's CPU build refuses w8a16 and static fp8), fp32 tensors
        result = quantkit.export_compressed_tensors(qmodel, path, out, inputs=[held], engine="transformers",
                                                    float_dtype="float32")
        seconds = time.perf_counter() - t0
        v = result.verification
        kw = {"quantization_config": transformers.CompressedTensorsConfig(dequantize=True)} \
            if v["loaded_with"].startswith("CompressedTensorsConfig") else {}
        loaded = transformers.AutoModel.from_pretrained(str(out), dtype=torch.float32, **kw).eval()
        with torch.no_grad():
            q = _hf.embed(qmodel(**held), held["attention_mask"])
            got = _hf.embed(loaded(**held), held["attention_mask"])
        c, cf, qf = _hf.cosine(q, got), _hf.cosine(fp, got), _hf.cosine(fp, q)
        fmt = json.loads((out / "config.json").read_text())["quantization_config"]["format"]
        print(f"| {scheme} | {fmt} | {c.min():.7f} / {c.mean():.7f} | {cf.mean():.5f} | {qf.mean():.5f} | "
              f"{v['tensors_equal_in_files']} | {v['loaded_with']} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
