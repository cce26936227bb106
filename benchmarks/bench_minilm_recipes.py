"""all-MiniLM-L6-v2 through W8A8Quantizer recipes: held-out embedding cosine.

Calibrates on the first 128 bundled sentences and scores the last 100 (seq_len 64), the
split tests/test_minilm.py uses, and adds int8 weights alone (activations float) as the
floor any full-int8 recipe starts from.

    python benchmarks/bench_minilm_recipes.py [--roles] [--fallback]

``--roles`` adds static W8A8 applied to one role of linear at a time (in all six layers, the
rest float), to show where the error comes from; ``--fallback`` adds auto_fallback with a
worst-sentence metric tuned on sentences 128..299 (a few minutes).
"""

from __future__ import annotations

import argparse
import copy
import platform
import time

import torch
from _minilm_split import heldout_split  # run as a script: benchmarks/ is on sys.path

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


_ROLES = ("attention.self.query", "attention.self.key", "attention.self.value",
          "attention.output.dense", "intermediate.dense", "output.dense")


def _row(name, cos, sents, seconds) -> str:
    worst = sents[int(cos.argmin())]
    below = int((cos < 0.99).sum())
    return f"| {name} | {cos.mean():.5f} | {cos.min():.5f} | {below} | {worst!r} | {seconds:.1f} |"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--roles", action="store_true", help="also quantize one role of linear at a time")
    ap.add_argument("--fallback", action="store_true", help="also run auto_fallback on a worst-sentence metric")
    args = ap.parse_args(argv)
    embedder, calib, held, ref, tok, sents = heldout_split()
    gm = quantkit.capture(embedder, calib[0])
    per_token = QuantConfig(dynamic=True, granularity="per-token")
    recipes = {
        "static W8A8, min-max (W8A8Quantizer())": W8A8Quantizer(),
        "static W8A8, moving-average min-max": W8A8Quantizer(QuantConfig(act_observer="moving_average_minmax")),
        "static W8A8, mse histogram": W8A8Quantizer(QuantConfig(act_observer="mse")),
        "dynamic W8A8, per-tensor": W8A8Quantizer(dynamic=True),
        "dynamic W8A8, per-token": W8A8Quantizer(per_token),
        # SmoothQuant's activation-to-weight migration, then per-token activations
        "SmoothQuant α=0.5 + dynamic W8A8 per-token": (0.5, W8A8Quantizer(per_token)),
        "SmoothQuant α=auto (scored per token) + dynamic W8A8 per-token": ("auto", W8A8Quantizer(per_token)),
        "SmoothQuant α=0.5 + static W8A8 min-max": (0.5, W8A8Quantizer()),
        "SmoothQuant α=auto + static W8A8 min-max": ("auto", W8A8Quantizer()),
    }
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}")
    print("| recipe | mean cosine | min cosine | sentences < 0.99 (of 100) | worst sentence | time (s) |")
    print("|---|---|---|---|---|---|")
    for name, quantizer in list(recipes.items()) + [("int8 weights only (activations float)", None)]:
        t = time.perf_counter()
        if quantizer is None:
            qmodel = _weights_only(embedder)
        else:
            graph = gm
            if isinstance(quantizer, tuple):
                alpha, quantizer = quantizer
                graph = quantkit.smooth_quant(gm, calib, alpha=alpha, config=quantizer.global_config)
            prepared = quantkit.prepare(graph, quantizer)
            if not quantizer.global_config.dynamic:
                quantkit.calibrate(prepared, calib, progress=False)
            qmodel = quantkit.convert(prepared)
        with torch.no_grad():
            cos = _hf.cosine(ref, qmodel(**held))
        print(_row(name, cos, sents[-100:], time.perf_counter() - t), flush=True)
    if args.roles:
        for role in _ROLES:
            t = time.perf_counter()
            q = W8A8Quantizer().set_global(None)
            for i in range(6):
                q.set_module_name(f"encoder.encoder.layer.{i}.{role}", QuantConfig())
            prepared = quantkit.prepare(gm, q)
            quantkit.calibrate(prepared, calib, progress=False)
            with torch.no_grad():
                cos = _hf.cosine(ref, quantkit.convert(prepared)(**held))
            print(_row(f"static W8A8 on `{role}` only (6 linears)", cos, sents[-100:], time.perf_counter() - t),
                  flush=True)
    if args.fallback:
        t = time.perf_counter()
        tune = _hf.tokenize(tok, sents[128:300], seq_len=64, batch_size=86)
        qmodel, report = quantkit.auto_fallback(
            embedder, calib[0], calib, tune, lambda f, q: float(_hf.cosine(f, q).min()), budget=0.007)
        with torch.no_grad():
            cos = _hf.cosine(ref, qmodel(**held))
        print(_row(f"auto_fallback, worst-sentence budget 0.007 ({len(report.float_layers)} linears float, "
                   f"{100 * report.int8_gemm_fraction:.1f}% GEMM FLOPs int8)", cos, sents[-100:],
                   time.perf_counter() - t), flush=True)


if __name__ == "__main__":
    main()
