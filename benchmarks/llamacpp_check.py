"""llama.cpp runs quantkit's GGUF export: SmolLM2-135M-Instruct, w4a16/w8a16 at group size 32.

For each recipe (RTN and GPTQ; symmetric int4 -> Q4_0, asymmetric -> Q4_1, symmetric int8 ->
Q8_0) quantkit quantizes the float model (``lm_head``, tied to the embedding, stays float in every
row, so both sides keep the same F32 token_embd that llama.cpp also uses as its output), writes it
with ``quantkit.export_gguf``, and llama-cpp-python (``Llama(logits_all=True, n_threads=2)``)
evaluates the held-out windows of the WEB Bible text. Per row:

- ``vs quantkit``: llama.cpp's logits against quantkit's program on the same tokens (max |diff|,
  relative Frobenius error, top-1 agreement). llama.cpp's CPU matmuls quantize activations to 8 bits
  for Q4/Q8 weights (ggml's vec_dot_q4_0_q8_0), so part of the difference is the engine's own;
  the ``F32`` row (the float export) is the engine's floor without that.
- perplexity from llama.cpp's logits, and from quantkit's.

``llama.cpp own Q4_0/Q4_1``: ``llama_model_quantize`` on quantkit's F32 export of the float model,
pure (every linear in that type) with token_embd kept F32: the same tensors quantized as quantkit's
rows, rounded by llama.cpp from float.

Run:  python benchmarks/llamacpp_check.py [--windows 8] [--window 256] [--calibration 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

import quantkit  # noqa: E402
from quantkit import _hf  # noqa: E402
from quantkit.quantizers import WeightOnlyQuantizer  # noqa: E402

RECIPES = [  # (name, WeightOnlyQuantizer kwargs, GGUF type)
    ("rtn w4 sym", dict(bits=4, symmetric=True, algorithm="rtn"), "Q4_0"),
    ("gptq w4 sym", dict(bits=4, symmetric=True, algorithm="gptq"), "Q4_0"),
    ("rtn w4 asym", dict(bits=4, symmetric=False, algorithm="rtn"), "Q4_1"),
    ("gptq w4 asym", dict(bits=4, symmetric=False, algorithm="gptq"), "Q4_1"),
    ("rtn w8 sym", dict(bits=8, symmetric=True, algorithm="rtn"), "Q8_0"),
]


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum").item()


@torch.no_grad()
def _quantkit_logits(model, held: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for row in held:
        ids = row.unsqueeze(0)
        res = model(input_ids=ids, attention_mask=torch.ones_like(ids))
        out.append((res["logits"] if isinstance(res, dict) else res.logits)[0].float())
    return out


def _llama_logits(path: Path, held: torch.Tensor, threads: int) -> list[torch.Tensor]:
    from llama_cpp import Llama

    llm = Llama(str(path), logits_all=True, n_threads=threads, n_ctx=held.shape[1], n_batch=held.shape[1],
                verbose=False)
    out = []
    for row in held:
        llm.reset()
        llm.eval(row.tolist())
        out.append(torch.from_numpy(np.array(llm.scores[: held.shape[1]], dtype=np.float32)))
    del llm
    return out


def _compare(got: list[torch.Tensor], ref: list[torch.Tensor], held: torch.Tensor) -> dict:
    g, r = torch.cat(got).double(), torch.cat(ref).double()
    ppl = lambda ls: math.exp(sum(_nll(x, ids) for x, ids in zip(ls, held)) / (held.numel() - held.shape[0]))  # noqa: E731
    return {"max_abs": float((g - r).abs().max()), "rel_err": float((g - r).norm() / r.norm()),
            "top1": float((g.argmax(-1) == r.argmax(-1)).double().mean()), "ppl_llamacpp": ppl(got),
            "ppl_quantkit": ppl(ref)}


def _decoded(model, qmodel, folder):
    """A copy of the float HF model whose quantized weights are what the GGUF blocks decode to."""
    import copy

    from quantkit.export._gguf import _meta_model, _read_program
    from quantkit.export._gguf_blocks import dequantize_blocks

    quantized, _, _ = _read_program(qmodel, _meta_model(Path(folder)), False)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for module, (w, kind) in quantized.items():
            out.get_submodule(module).weight.copy_(dequantize_blocks(w, kind))
    return out


def _llama_quantize(src: Path, dst: Path, kind: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.pure = True
    params.token_embedding_type = llama_cpp.GGML_TYPE_F32
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed ({rc})")


def _types(path: Path) -> dict:
    import gguf

    kinds: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    return kinds


def main(argv=None) -> int:
    from tests import _smollm2

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _smollm2.add_window_arguments(ap, "calibration windows (GPTQ)")
    ap.add_argument("--recipes", default="all", help="comma-separated recipe names")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    loaded = _smollm2.benchmark_windows(args)
    if loaded is None:
        return 0
    tok, model, held, cal = loaded
    folder = _smollm2.smollm2_dir()
    batches = [{"input_ids": r.unsqueeze(0), "attention_mask": torch.ones(1, r.numel(), dtype=torch.long)}
               for r in cal]
    print(f"SmolLM2-135M-Instruct; {held.shape[0]} held-out windows of {args.window} tokens, {len(batches)} "
          f"calibration windows; {args.threads} threads, load {os.getloadavg()[0]:.2f} (loaded machine)", flush=True)
    gm = quantkit.capture(model, batches[0], dynamic_shapes=_hf.dynamic_shapes(batches[0]))
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="llamacpp_check_"))

    t0 = time.perf_counter()
    f32 = tmp / "float-f32.gguf"
    quantkit.export_gguf(model, f32, model=folder)
    float_ref = _quantkit_logits(model, held)
    rows.append({"recipe": "float", "gguf": "F32", "source": "quantkit export",
                 **_compare(_llama_logits(f32, held, args.threads), float_ref, held),
                 "seconds": time.perf_counter() - t0})
    print(f"  float F32: {rows[-1]}", flush=True)
    for kind in ("Q4_0", "Q4_1"):
        t0 = time.perf_counter()
        own = tmp / f"llamacpp-{kind}.gguf"
        _llama_quantize(f32, own, kind)
        rows.append({"recipe": f"llama.cpp own {kind}", "gguf": kind, "source": "llama_model_quantize",
                     "types": _types(own), **_compare(_llama_logits(own, held, args.threads), float_ref, held),
                     "seconds": time.perf_counter() - t0})
        print(f"  {rows[-1]['recipe']}: {rows[-1]}", flush=True)

    wanted = None if args.recipes == "all" else {r.strip() for r in args.recipes.split(",")}
    for name, kwargs, kind in RECIPES:
        if wanted is not None and name not in wanted:
            continue
        t0 = time.perf_counter()
        quantizer = WeightOnlyQuantizer(group_size=32, **kwargs).set_module_name("lm_head", None)
        prepared = quantkit.prepare(gm, quantizer)
        quantkit.calibrate(prepared, batches, progress=False)
        qmodel = quantkit.convert(prepared)
        path = tmp / f"{name.replace(' ', '-')}.gguf"
        res = quantkit.export_gguf(qmodel, path, model=folder)
        assert set(res.tensors.values()) == {kind, "F32"}, res.tensors
        ref = _quantkit_logits(qmodel, held)
        row = {"recipe": name, "gguf": kind, "source": "quantkit export", "types": _types(path),
               "fp16_scale_error": res.fp16_scale_error,
               **_compare(_llama_logits(path, held, args.threads), ref, held),
               "seconds": time.perf_counter() - t0}
        # the same blocks decoded to float32 (fp16 scales, as GGUF holds them) and run by llama.cpp as
        # F32: the export's names, layout and permutation without ggml's 8-bit activations
        dq = tmp / f"{name.replace(' ', '-')}-decoded-f32.gguf"
        quantkit.export_gguf(_decoded(model, qmodel, folder), dq, model=folder)
        row["decoded_f32"] = _compare(_llama_logits(dq, held, args.threads), ref, held)
        own = next(r for r in rows if r["recipe"] == f"llama.cpp own {kind}") if kind != "Q8_0" else None
        if own is not None:
            row["ppl_vs_llamacpp_own"] = row["ppl_llamacpp"] / own["ppl_llamacpp"] - 1
        rows.append(row)
        print(f"  {name}: {row}", flush=True)

    print(f"\n{'recipe':<22} {'gguf':<5} {'max|d|':>8} {'rel err':>8} {'top-1':>6} {'ppl llama.cpp':>13} "
          f"{'ppl quantkit':>12} {'fp16 scale err':>14}")
    for r in rows:
        print(f"{r['recipe']:<22} {r['gguf']:<5} {r['max_abs']:>8.4f} {r['rel_err']:>8.5f} {r['top1']:>6.4f} "
              f"{r['ppl_llamacpp']:>13.4f} {r['ppl_quantkit']:>12.4f} {r.get('fp16_scale_error', 0):>14.2e}")
        if "decoded_f32" in r:
            d = r["decoded_f32"]
            print(f"{'  decoded as F32':<22} {'F32':<5} {d['max_abs']:>8.4f} {d['rel_err']:>8.5f} {d['top1']:>6.4f} "
                  f"{d['ppl_llamacpp']:>13.4f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
