"""all-MiniLM-L6-v2 through W8A8Quantizer recipes: held-out embedding cosine.

Calibrates on the first 128 bundled sentences and scores the last 100 (seq_len 64), the
split tests/test_minilm.py uses, and adds int8 weights alone (activations float) as the
floor any full-int8 recipe starts from.

    python benchmarks/bench_minilm_recipes.py
"""

from __future__ import annotations

import copy
import platform
import time

import torch

import quantkit
from quantkit import _hf
from quantkit._qmath import choose_qparams, fake_quantize
from quantkit.quantizers import QuantConfig, W8A8Quantizer


def _weights_only(model: torch.nn.Module) -> torch.nn.Module:
    q = copy.deepcopy(model)
    for mod in q.modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight.data
            s, z = choose_qparams(w.amin(1), w.amax(1), qscheme=torch.per_channel_symmetric,
                                  dtype=torch.int8, quant_min=-128, quant_max=127)
            mod.weight.data = fake_quantize(w, s, z, -128, 127, torch.int8, axis=0)
    return q


def main() -> None:
    model, tok = _hf.load_hf_model(_hf.default_model_path())
    embedder = _hf.SentenceEmbedder(model).eval()
    sents = _hf.read_sentences(_hf.default_calibration_file())
    calib = _hf.tokenize(tok, sents[:128], seq_len=64, batch_size=32)
    held = _hf.tokenize(tok, sents[-100:], seq_len=64, batch_size=100)[0]
    with torch.no_grad():
        ref = embedder(**held)
    gm = quantkit.capture(embedder, calib[0])
    recipes = {
        "static W8A8, min-max (W8A8Quantizer())": W8A8Quantizer(),
        "static W8A8, moving-average min-max": W8A8Quantizer(QuantConfig(act_observer="moving_average_minmax")),
        "static W8A8, mse histogram": W8A8Quantizer(QuantConfig(act_observer="mse")),
        "dynamic W8A8, per-tensor": W8A8Quantizer(dynamic=True),
        "dynamic W8A8, per-token": W8A8Quantizer(QuantConfig(dynamic=True, granularity="per-token")),
    }
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}")
    print("| recipe | mean cosine | min cosine | worst sentence | time (s) |")
    print("|---|---|---|---|---|")
    for name, quantizer in list(recipes.items()) + [("int8 weights only (activations float)", None)]:
        t = time.perf_counter()
        if quantizer is None:
            qmodel = _weights_only(embedder)
        else:
            prepared = quantkit.prepare(gm, quantizer)
            if not quantizer.global_config.dynamic:
                quantkit.calibrate(prepared, calib, progress=False)
            qmodel = quantkit.convert(prepared)
        with torch.no_grad():
            cos = _hf.cosine(ref, qmodel(**held))
        worst = sents[-100:][int(cos.argmin())]
        print(f"| {name} | {cos.mean():.5f} | {cos.min():.5f} | {worst!r} | {time.perf_counter() - t:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
