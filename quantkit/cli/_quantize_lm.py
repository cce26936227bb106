"""``quantkit quantize MODEL --max-cache-len N``: a causal LM's generating artifact.

The HF causal LM is captured with a static KV cache of N positions (``quantkit.capture(...,
max_cache_len=N)``, batch 1), calibrated on each calibration sample as a full sequence at
``cache_position = arange(L)`` (its padding dropped) and converted; DIR gets ``model.pt2``,
``quantization.json`` (the cache's record, so ``quantize`` and ``load`` agree on its length) and the
tokenizer in DIR/tokenizer, so that ``quantkit generate DIR --prompt ...`` runs it as it is and
``quantkit eval DIR --data FILE.txt`` reports its perplexity.

With ``--kv-cache FORMAT`` the cache itself is stored in that format (int8, fp8_e4m3 or fp8_e5m2,
whatever the scheme: w8a8, w4a16, w8a16, nf4 or FP8), with scales calibrated on the same samples
(``pipeline._kv_cache.calibrate_kv_scales``, per tensor or ``--kv-granularity per-head``); the graph
then carries no extra q/dq on K and V (the store is the quantization). Without ``--max-cache-len``,
``--kv-cache`` is the FP8 quantizer's q/dq on K and V, so the other schemes refuse it there
(:func:`recipe_args`).

The summary line gives the held-out perplexity of the program and of the float model on the
held-out samples (each a fresh sequence), and their top-1 agreement.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import math

import torch
from torch.export.passes import move_to_device_pass

import quantkit

from .._errors import QuantkitError
from ..quantizers._fp8 import FP8Config
from ..export import _artifact
from ..pipeline._kv_cache import calibrate_kv_scales
from ..pipeline._kv_capture import KV_CACHE_META_KEY, lm_calibration_batches
from . import _export
from . import _data as datasets, _inputs as inputs, _report as report

__all__ = ["run_quantize_lm", "check_lm_args", "recipe_args"]


def check_lm_args(args, recipe, spec) -> int:
    """``--max-cache-len`` and the flags it cannot go with; returns N.

    Without recipe flags (which would mean ``--recipe auto``) the default recipe (w8a8) is used.

    Raises:
        UsageError: N < 1, a factory model, ``--seq-len`` longer than N, or a flag whose pipeline
            runs full-sequence programs (``--recipe``, ``--smoothquant``, ``--accuracy-budget``,
            ``--format`` other than pt2).
    """
    n = args.max_cache_len
    if n < 1:
        raise inputs.UsageError(f"--max-cache-len must be at least 1, got {n}")
    if not spec.is_hf:
        raise inputs.UsageError("--max-cache-len captures a Hugging Face causal LM; pass an HF model folder")
    if args.seq_len is not None and args.seq_len > n:
        raise inputs.UsageError(f"--seq-len {args.seq_len} is longer than --max-cache-len {n}: calibration runs "
                                f"whole samples through the cache; pass --seq-len {n} or less")
    # an explicit --recipe only: without recipe flags, --max-cache-len quantizes with the default w8a8 recipe
    refused = [flag for flag, on in (("--recipe", getattr(args, "recipe", None) is not None),
                                     ("--smoothquant", recipe.smoothquant is not None),
                                     ("--accuracy-budget", recipe.accuracy_budget is not None),
                                     ("--format", _export.parse_formats(args.format) != (_export.PT2,)))
               if on]
    if refused:
        raise inputs.UsageError(f"--max-cache-len cannot be combined with {', '.join(refused)} yet; drop "
                                f"{'it' if len(refused) == 1 else 'them'} or --max-cache-len")
    return n


def recipe_args(args, preset):
    """The arguments the FP8 recipe parser sees: ``args`` itself, or, for a stored ``--kv-cache`` of a
    scheme that is not FP8 (``preset`` not an ``FP8Config``; None is the default w8a8), a copy without
    ``--kv-cache``/``--kv-granularity``, which :func:`run_quantize_lm` reads instead.

    Raises:
        UsageError: ``--kv-cache`` with such a scheme but without ``--max-cache-len`` (one line: the
            full-sequence path has the FP8 quantizer's K/V q/dq only).
    """
    if getattr(args, "kv_cache", None) is None or isinstance(preset, FP8Config):
        return args
    scheme = getattr(args, "scheme", None) or "w8a8"
    if getattr(args, "max_cache_len", None) is None:
        raise inputs.UsageError(f"--kv-cache with --scheme {scheme} stores the KV cache of a generating artifact: add "
                                "--max-cache-len N, or use --scheme fp8 or fp8-dynamic (K/V q/dq in the graph)")
    return argparse.Namespace(**{**vars(args), "kv_cache": None, "kv_granularity": None})


def _is_causal_lm(model) -> bool:
    head = getattr(model, "get_output_embeddings", None)
    config = getattr(model, "config", None)
    return callable(head) and head() is not None and not getattr(config, "is_encoder_decoder", False)


def _kv_recipe(args, recipe) -> tuple[str | None, str, object]:
    """``(format, granularity, recipe)``: the stored cache --kv-cache asks for, and the recipe whose
    quantizer leaves K and V alone (the cache stores them quantized instead)."""
    fp8 = recipe.fp8
    if fp8 is None:  # the int8/int4 schemes' --kv-cache is the store's only (recipe_args kept it from the recipe)
        return getattr(args, "kv_cache", None), getattr(args, "kv_granularity", None) or "per-tensor", recipe
    if fp8.kv_cache is None:
        return None, "per-tensor", recipe
    return fp8.kv_cache, fp8.kv_granularity, dataclasses.replace(recipe, fp8=dataclasses.replace(fp8, kv_cache=None))


def _drop_unread_cache_buffers(qmodel) -> None:
    """The KV-cache record of ``qmodel`` lists the buffers it holds, in place.

    A per-tensor cache's scales are read as constants (a Python scale in the graph), so prepare's
    copy drops their buffers; the capture's record still names them, and ``load`` would then refuse
    the artifact as damaged. (The record is the capture's, ``pipeline._kv_capture``; it could list
    only the buffers its graph reads.)
    """
    info = qmodel.meta.get(KV_CACHE_META_KEY)
    if isinstance(info, dict):
        held = {n for n, _ in qmodel.named_buffers()}
        qmodel.meta[KV_CACHE_META_KEY] = {**info, "buffers": [n for n in info.get("buffers", []) if n in held]}


@torch.no_grad()
def _heldout(model, program, batches) -> dict:
    """Perplexity of the program and of the float model on the held-out rows, and top-1 agreement."""
    nll_q = nll_f = 0.0
    agree = count = positions_seen = 0
    for ids, positions in batches:
        if ids.shape[1] < 2:
            continue
        q = program(ids, positions).float()
        f = model(input_ids=ids, use_cache=False).logits.float()
        target = ids[:, 1:]
        nll_q += float(torch.nn.functional.cross_entropy(q[:, :-1].flatten(0, 1), target.flatten(), reduction="sum"))
        nll_f += float(torch.nn.functional.cross_entropy(f[:, :-1].flatten(0, 1), target.flatten(), reduction="sum"))
        agree += int((q.argmax(-1) == f.argmax(-1)).sum())
        positions_seen += q.shape[0] * q.shape[1]
        count += target.numel()
    if count == 0:
        return {"name": "perplexity", "tokens": 0}
    return {"name": "perplexity", "tokens": count, "perplexity": math.exp(nll_q / count),
            "float_perplexity": math.exp(nll_f / count), "top1_agreement": agree / positions_seen}


def run_quantize_lm(args, recipe, spec, data, out, loaded, calib, heldout, module_names, *, samples: int,
                    heldout_indices, tokenizer_dir: str, say) -> int:
    """Quantize ``loaded.model`` into a generating artifact in ``out`` (see the module doc).

    ``calib`` / ``heldout`` are the run's tokenized batches (dicts with input_ids and
    attention_mask); the other arguments are ``run_quantize``'s.

    Raises:
        QuantkitError: the model is not a causal LM (one line); CaptureError / CalibrationError
            from the capture and calibration.
    """
    n = check_lm_args(args, recipe, spec)
    model = loaded.model
    if not _is_causal_lm(model):
        raise QuantkitError(f"--max-cache-len needs a causal LM with an lm_head; {args.model!r} "
                            f"loads as {type(model).__name__}: pass a causal LM (or --task causal-lm)")
    if loaded.tokenizer is None:
        raise QuantkitError("--max-cache-len writes an artifact that generates text, which needs the model's "
                            "tokenizer; add its tokenizer files to the model folder")
    progress = not args.quiet
    batches = lm_calibration_batches(calib, batch_size=1, max_cache_len=n)
    held = lm_calibration_batches(heldout, batch_size=1, max_cache_len=n) if heldout else []
    kv_cache, granularity, graph_recipe = _kv_recipe(args, recipe)
    scales = None
    if kv_cache is not None:
        scales = calibrate_kv_scales(model, [ids for ids, _ in batches], kv_cache=kv_cache, granularity=granularity)
    # torch.export prints the partial graph to stderr when it fails; CaptureError says why in one line
    with contextlib.redirect_stderr(io.StringIO()):
        gm = quantkit.capture(model, batches[0][0], max_cache_len=n, kv_cache=kv_cache, kv_scales=scales)
    prepared = quantkit.prepare(gm, graph_recipe.quantizer(module_names))
    quantkit.calibrate(prepared, batches, progress=progress)
    qmodel = quantkit.convert(prepared)
    _drop_unread_cache_buffers(qmodel)
    recipe.finish(qmodel, module_names)  # the fallback's float layers: bf16 weights
    if not qmodel.meta.get("quantkit_qparams"):
        raise QuantkitError(f"nothing is quantized: the model has no {'/'.join(recipe.config().ops)} op outside "
                            "the --skip patterns; check --ops and --skip")
    metric = _heldout(model, qmodel, held)
    with contextlib.redirect_stderr(io.StringIO()):
        program = _artifact.export_converted(qmodel)
        if next(model.parameters()).device.type != "cpu":  # artifacts are CPU programs, as run_quantize's
            program = move_to_device_pass(program, "cpu")
    source = {"model": spec.to_json(), "data": data.to_json(), "fingerprint": datasets.fingerprint(data),
              "samples": samples, "heldout": heldout_indices, "seq_len": args.seq_len, "batch_size": 1,
              "output": "token-logits", "max_cache_len": n,
              "allow_missing_weights": bool(args.allow_missing_weights)}
    doc = _artifact.recipe_document(qmodel, recipe=recipe.to_json(), source=source, config=recipe.scheme_config())
    doc["heldout_metric"] = metric
    if kv_cache is not None and recipe.fp8 is None:  # as the FP8 recipes record theirs
        doc["recipe"] = {**doc["recipe"], "kv_cache": kv_cache, "kv_granularity": granularity}
    with _artifact.atomic_dir(out, overwrite=args.force, flag="--force") as tmp:
        _artifact.write_program(program, tmp)
        _artifact.write_json(tmp / _artifact.RECIPE_FILE, report.json_safe(doc))
        loaded.tokenizer.save_pretrained(str(tmp / tokenizer_dir))
    cache = f"{kv_cache} {granularity}" if kv_cache else "float"
    line = f"wrote {out}: KV cache of {n} positions ({cache})"
    if metric.get("tokens"):
        q, f = metric["perplexity"], metric["float_perplexity"]
        line += (f"; held-out perplexity {q:.4f} vs float {f:.4f} ({100 * (q / f - 1):+.2f}%), top-1 agreement "
                 f"{metric['top1_agreement']:.4f} ({metric['tokens']} tokens)")
    say(line)
    return 0
