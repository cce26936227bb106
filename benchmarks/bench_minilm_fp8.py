"""all-MiniLM-L6-v2 through FP8Quantizer recipes beside static/per-token int8: held-out cosine.

The protocol of ``bench_minilm_recipes.py`` (and tests/test_minilm.py): calibrate on the first
128 bundled sentences, score the last 100 (seq_len 64) by the cosine of the sentence embedding
against the float model's.

    python benchmarks/bench_minilm_fp8.py [--kv | --floors | --gptq]

``--kv`` runs the KV-cache formats instead (``kv_cache=...`` on top of FP8 static, and dynamic per
token on the Llama) on MiniLM and on a tiny random Llama (transformers ``LlamaConfig``, 2 layers, rotary), where the
metric is the cosine of the last hidden states per real token, on 32 held-out random sequences.
``--floors`` runs only E4M3 fake quant written by hand on the float model (weights alone, inputs alone,
both; and weights with a per-channel MSE clipping search): where the FP8 error comes from.
``--gptq`` runs FP8 static and dynamic per token with GPTQ-rounded E4M3 weights
(``FP8Quantizer(weight_algorithm="gptq")``), and the GPTQ weights alone (the calibrated prepared
model: rounded weights, float activations).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from _minilm_split import heldout_split  # run as a script: benchmarks/ is on sys.path

import quantkit
from quantkit import _hf
from quantkit.quantizers import FP8Quantizer, QuantConfig, W8A8Quantizer


def _row(name, cos, seconds) -> str:
    return f"| {name} | {cos.mean():.5f} | {cos.min():.5f} | {int((cos < 0.99).sum())} | {seconds:.1f} |"


def _run(gm, quantizer, calib, held, alpha=None, weights_alone=None):
    graph = gm if alpha is None else quantkit.smooth_quant(gm, calib, alpha=alpha)
    prepared = quantkit.prepare(graph, quantizer)
    quantkit.calibrate(prepared, calib, progress=False)
    if weights_alone is not None:  # the prepared model computes with the rounded weights, float activations
        with torch.no_grad():
            weights_alone.append(prepared(**held) if isinstance(held, dict) else prepared(held))
    qmodel = quantkit.convert(prepared)
    with torch.no_grad():
        return qmodel(**held) if isinstance(held, dict) else qmodel(held)


def _minilm():
    """The bench protocol (``_minilm_split.heldout_split``): the embedder, 128 calibration sentences
    (first), 100 held out (last), the float embeddings of the held-out ones."""
    split = heldout_split()
    return split.embedder, split.calib, split.held, split.ref


def gptq() -> None:
    """FP8 static / dynamic per token with GPTQ-rounded E4M3 weights, and those weights alone."""
    embedder, calib, held, ref = _minilm()
    gm = quantkit.capture(embedder, calib[0])
    print("all-MiniLM-L6-v2, 100 held-out sentences, GPTQ-rounded E4M3 weights (act_order, 1% dampening)")
    print("| recipe | mean cosine | min cosine | sentences < 0.99 | time (s) |")
    print("|---|---|---|---|---|")
    for name, q in (("FP8 static + GPTQ weights", FP8Quantizer(weight_algorithm="gptq")),
                    ("FP8 dynamic per-token + GPTQ weights",
                     FP8Quantizer(dynamic=True, granularity="per-token", weight_algorithm="gptq"))):
        t = time.perf_counter()
        alone: list = []
        out = _run(gm, q, calib, held, weights_alone=alone)
        seconds = time.perf_counter() - t
        print(_row(name, _hf.cosine(ref, out), seconds), flush=True)
        print(_row(f"({name}: the GPTQ E4M3 weights alone, float activations)", _hf.cosine(ref, alone[0]), 0.0),
              flush=True)


def minilm(kv: bool) -> None:
    embedder, calib, held, ref = _minilm()
    gm = quantkit.capture(embedder, calib[0])
    recipes = {
        "int8 static W8A8 (W8A8Quantizer())": W8A8Quantizer(),
        "int8 dynamic per-token (W8A8Quantizer(QuantConfig(dynamic=True, granularity='per-token')))":
            W8A8Quantizer(QuantConfig(dynamic=True, granularity="per-token")),
        "FP8 static, min-max (FP8Quantizer())": FP8Quantizer(),
        "FP8 static, mse on the E4M3 grid (FP8Quantizer(act_observer='mse'))": FP8Quantizer(act_observer="mse"),
        "FP8 static, weights per tensor (FP8Quantizer(weight_granularity='per-tensor'))":
            FP8Quantizer(weight_granularity="per-tensor"),
        "FP8 dynamic per-token (FP8Quantizer(dynamic=True, granularity='per-token'))":
            FP8Quantizer(dynamic=True, granularity="per-token"),
        "SmoothQuant α=0.5 + FP8 static": (0.5, FP8Quantizer()),
    }
    if kv:  # beside "FP8 static, min-max" of the main table
        recipes = {f"FP8 static + kv_cache={fmt!r}": FP8Quantizer(kv_cache=fmt)
                   for fmt in ("fp8_e4m3", "fp8_e5m2", "int8")}
        recipes["FP8 static + kv_cache='int8', per-head"] = FP8Quantizer(kv_cache="int8", kv_granularity="per-head")
    print(f"all-MiniLM-L6-v2, 100 held-out sentences; machine: {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}")
    print("| recipe | mean cosine | min cosine | sentences < 0.99 | time (s) |")
    print("|---|---|---|---|---|")
    for name, quantizer in recipes.items():
        t = time.perf_counter()
        alpha = None
        if isinstance(quantizer, tuple):
            alpha, quantizer = quantizer
        out = _run(gm, quantizer, calib, held, alpha)
        print(_row(name, _hf.cosine(ref, out), time.perf_counter() - t), flush=True)


def floors() -> None:
    """Where the error comes from: E4M3 fake quant written by hand on the float model (no quantkit
    pipeline; nn.Linear weights per output channel, linear inputs per token or with calibration amax)."""
    import copy

    from quantkit._qmath import dequantize_float8, float8_scale, quantize_float8

    embedder, calib, held, ref = _minilm()

    def fq(x, amax):
        s = float8_scale(amax)
        return dequantize_float8(quantize_float8(x, s), s)

    def clipped(w):
        """Per output channel, the clipping ``amax * (1 - j/100)``, j in 0..30, with the least
        squared weight error on the E4M3 grid."""
        amax = w.abs().amax(1, keepdim=True)
        best, best_err = fq(w, amax), None
        for j in range(31):
            cand = fq(w, amax * (1 - j / 100))
            err = (cand - w).pow(2).sum(1, keepdim=True)
            best = cand if best_err is None else torch.where(err < best_err, cand, best)
            best_err = err if best_err is None else torch.minimum(err, best_err)
        return best

    def variant(weights, acts: str | None, select=lambda name: True):
        m = copy.deepcopy(embedder)
        lins = [mod for name, mod in m.named_modules() if isinstance(mod, torch.nn.Linear) and select(name)]
        if weights == "clip":
            for lin in lins:
                lin.weight.data = clipped(lin.weight.data)
        elif weights:
            for lin in lins:
                lin.weight.data = fq(lin.weight.data, lin.weight.data.abs().amax(1, keepdim=True))
        if acts == "per-token":
            for lin in lins:
                lin.register_forward_pre_hook(lambda mod, a: (fq(a[0], a[0].abs().amax(-1, keepdim=True)),))
        elif acts == "static":
            amax = {}
            hooks = [lin.register_forward_pre_hook(
                lambda mod, a: amax.__setitem__(mod, max(amax.get(mod, 0.0), float(a[0].abs().max()))))
                for lin in lins]
            with torch.no_grad():
                for b in calib:
                    m(**b)
            for h in hooks:
                h.remove()
            for lin in lins:
                lin.register_forward_pre_hook(lambda mod, a: (fq(a[0], torch.tensor(amax[mod])),))
        with torch.no_grad():
            return _hf.cosine(ref, m(**held))

    print("\nE4M3 fake quant by hand (bench protocol)")
    print("| what is E4M3 | mean cosine | min cosine | sentences < 0.99 | time (s) |")
    print("|---|---|---|---|---|")
    for name, w, a in (("weights only", True, None),
                       ("weights only, per-channel MSE clipping search", "clip", None),
                       ("linear inputs per token only", False, "per-token"),
                       ("weights + inputs per token", True, "per-token"),
                       ("weights + inputs, calibration amax", True, "static")):
        t = time.perf_counter()
        print(_row(name, variant(w, a), time.perf_counter() - t), flush=True)

    # the error budget per part: E4M3 weights + per-token inputs on one group of linears, the rest float
    print("\nE4M3 weights + per-token inputs on one group of linears only (the others float)")
    print("| linears in E4M3 | mean cosine | min cosine | sentences < 0.99 | time (s) |")
    print("|---|---|---|---|---|")
    groups = {"attention q/k/v (18)": lambda n: ".attention.self." in n,
              "attention output (6)": lambda n: n.endswith("attention.output.dense"),
              "FFN up, intermediate (6)": lambda n: n.endswith("intermediate.dense"),
              "FFN down, output (6)": lambda n: n.endswith(".output.dense") and "attention" not in n}
    groups.update({f"block {i} (6)": (lambda i: lambda n: f".layer.{i}." in n)(i) for i in range(6)})
    for name, select in groups.items():
        t = time.perf_counter()
        print(_row(name, variant(True, "per-token", select), time.perf_counter() - t), flush=True)


def tiny_llama() -> None:
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaModel(cfg).eval()
    model.config.use_cache = False
    ids = torch.randint(0, 512, (96, 32), generator=torch.Generator().manual_seed(1))
    calib = [{"input_ids": ids[i:i + 16]} for i in range(0, 64, 16)]
    held = {"input_ids": ids[64:]}

    class Last(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids).last_hidden_state

    wrapped = Last(model).eval()
    with torch.no_grad():
        ref = wrapped(**held)
    gm = quantkit.capture(wrapped, calib[0])
    print("\ntiny random Llama (2 layers, hidden 128, 4 heads / 2 KV heads, rotary), 32 held-out sequences "
          "of 32 tokens: cosine of the last hidden state per token")
    print("| recipe | mean cosine | min cosine | tokens < 0.99 | time (s) |")
    print("|---|---|---|---|---|")
    recipes = {"FP8 static": FP8Quantizer(), "FP8 dynamic per-token": FP8Quantizer(dynamic=True, granularity="per-token")}
    for fmt in ("fp8_e4m3", "fp8_e5m2", "int8"):
        recipes[f"FP8 static + kv_cache={fmt!r}"] = FP8Quantizer(kv_cache=fmt)
        recipes[f"FP8 dynamic per-token + kv_cache={fmt!r}"] = FP8Quantizer(
            dynamic=True, granularity="per-token", kv_cache=fmt)
    recipes["FP8 static + kv_cache='int8', per-head"] = FP8Quantizer(kv_cache="int8", kv_granularity="per-head")
    for name, quantizer in recipes.items():
        t = time.perf_counter()
        out = _run(gm, quantizer, calib, held)
        cos = torch.nn.functional.cosine_similarity(ref.reshape(-1, ref.shape[-1]).double(),
                                                    out.reshape(-1, out.shape[-1]).double(), dim=-1)
        print(_row(name, cos, time.perf_counter() - t), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", action="store_true", help="KV-cache formats on MiniLM and a tiny random Llama")
    ap.add_argument("--floors", action="store_true", help="only the hand-written E4M3 fake-quant decomposition")
    ap.add_argument("--gptq", action="store_true", help="FP8 static and dynamic with GPTQ-rounded weights")
    args = ap.parse_args(argv)
    if args.gptq:
        gptq()
        return
    if args.floors:
        floors()
        return
    if args.kv:
        tiny_llama()
    minilm(args.kv)


if __name__ == "__main__":
    main()
