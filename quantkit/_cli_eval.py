"""``quantkit inspect`` and ``quantkit eval``: read an artifact directory back."""

from __future__ import annotations

from pathlib import Path

import torch

from . import _artifact, _cli_inputs as inputs, _cli_report as report
from ._cli_quantize import REPORT_JSON
from ._errors import QuantkitError

__all__ = ["run_inspect", "run_eval"]


def _read_artifact(directory: str) -> tuple[Path, dict]:
    path = Path(directory)
    if not path.is_dir():
        raise QuantkitError(f"{directory!r} is not a directory; pass the --out directory of quantkit quantize")
    if not (path / _artifact.RECIPE_FILE).is_file() or not (path / _artifact.MODEL_FILE).is_file():
        raise QuantkitError(f"{directory!r} has no {_artifact.MODEL_FILE} and {_artifact.RECIPE_FILE}; "
                            "it is not a quantkit artifact")
    doc = _artifact.read_json(path / _artifact.RECIPE_FILE)
    if doc.get("format") != _artifact.FORMAT:
        raise QuantkitError(f"{str(path / _artifact.RECIPE_FILE)!r} is not a quantkit quantization.json")
    return path, doc


def _scale_range(rec: dict) -> str:
    s = rec.get("scale") or []
    if not s:
        return "run time"
    return f"{min(s):.3g}" if len(s) == 1 else f"{min(s):.3g}..{max(s):.3g} ({len(s)} ch)"


def run_inspect(args, say) -> int:
    path, doc = _read_artifact(args.dir)
    rep = _artifact.read_json(path / REPORT_JSON) if (path / REPORT_JSON).is_file() else {}
    recipe, source = doc.get("recipe", {}), doc.get("source", {})
    size = (path / _artifact.MODEL_FILE).stat().st_size
    tensors = doc.get("tensors", [])
    # dynamic activations are "dynamic" (per tensor) or "dynamic-per-token"
    kinds = {k: sum(1 for t in tensors if str(t.get("kind", "")).split("-per-")[0] == k)
             for k in ("weight", "activation", "dynamic")}
    say(f"{path}")
    say(f"  model:    {rep.get('model') or source.get('model', {})}")
    say(f"  recipe:   " + ", ".join(f"{k}={v}" for k, v in recipe.items()) if recipe else "  recipe:   (saved from Python)")
    say(f"  made by:  " + ", ".join(f"{k} {v}" for k, v in doc.get("versions", {}).items()))
    line = f"  size:     {_artifact.MODEL_FILE} {size / 2**20:.1f} MiB"
    if rep.get("size"):
        line += f" ({rep['size']['ratio']:.3f}x the fp32 weights)"
    say(line)
    say(f"  tensors:  {kinds['weight']} int8 weights, {kinds['activation']} static activations, "
        f"{kinds['dynamic']} dynamic activations")
    if rep.get("metric"):
        m = rep["metric"]
        say(f"  accuracy: {m['name']} mean {m['mean_cosine']:.4f}, min {m['min_cosine']:.4f}, "
            f"SQNR {m['sqnr_db']:.1f} dB on {m['samples']} held-out samples")
    sqnr = {r["layer"]: r for r in rep.get("layers", [])}
    rows = []
    if sqnr:
        for name, r in sqnr.items():
            rows.append({"layer": name, "op": r["op"], "weight": r["weight"], "SQNR (dB)": r["sqnr_db"]})
        cols = ["layer", "op", "weight", "SQNR (dB)"]
    else:
        for t in tensors:
            rows.append({"tensor": t["node"], "kind": t["kind"], "dtype": t["dtype"], "scale": _scale_range(t)})
        cols = ["tensor", "kind", "dtype", "scale"]
    say("")
    say(report.render_table(rows, cols))
    return 0


def _rebuild_float(doc: dict, progress: bool):
    spec = inputs.ModelSpec.from_json(doc.get("source", {}).get("model") or {})
    if spec.kind not in ("default", "hf", "factory"):
        raise QuantkitError("quantization.json does not say which float model this came from; "
                            "eval needs an artifact written by quantkit quantize")
    try:
        spec.check()
    except QuantkitError as exc:
        raise QuantkitError(f"cannot rebuild the float reference: {exc}") from None
    return spec, inputs.load_model(spec, progress=progress)


def _eval_samples(doc: dict, data_arg: str | None, example_ndims):
    source = doc["source"]
    if data_arg is not None:
        data = inputs.DataSpec.from_arg(data_arg)
        return inputs.read_samples(data, example_ndims=example_ndims), "given data"
    data = inputs.DataSpec.from_json(source.get("data", {}))
    samples = inputs.read_samples(data, example_ndims=example_ndims)
    if len(samples) != source.get("samples") or inputs.fingerprint(data) != source.get("fingerprint"):
        raise QuantkitError("the calibration data changed since quantize, so its held-out split is lost; "
                            "pass --data PATH to evaluate on other data")
    return [samples[i] for i in source["heldout"]], "held-out split"


def _compiled(qmodel, batch):
    """quantkit.compile (Inductor lowering) where it exists; None when absent or failing."""
    import quantkit

    compile_fn = getattr(quantkit, "compile", None)
    if compile_fn is None:
        return None, "quantkit.compile is not available"
    try:
        compiled = compile_fn(qmodel)
        from ._inputs import call_model

        with torch.no_grad():
            call_model(compiled, batch)
        return compiled, None
    except Exception as exc:  # report, don't fail: the reference int8 numbers stand
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]


def _hf_cosine(a, b):
    from ._hf import cosine

    return cosine(a, b)


def run_eval(args, say) -> int:
    for flag, v in (("--batch-size", args.batch_size), ("--num", args.num)):
        if v is not None and v < 1:
            raise inputs.UsageError(f"{flag} must be at least 1, got {v}")
    path, doc = _read_artifact(args.dir)
    if not doc.get("source"):
        raise QuantkitError(f"{args.dir!r} was saved from Python and does not record its float model; "
                            "eval needs an artifact written by quantkit quantize")
    progress = not args.quiet
    spec = inputs.ModelSpec.from_json(doc["source"]["model"])
    ndims = [len(s) for s, _ in inputs.parse_example_input(spec.example_input)] if spec.kind == "factory" else None
    samples, where = _eval_samples(doc, args.data, ndims)
    if args.num is not None:
        samples = samples[:args.num]
    _, loaded = _rebuild_float(doc, progress)
    tok_dir = path / "tokenizer"
    if loaded.tokenizer is None and tok_dir.is_dir():
        import transformers

        loaded.tokenizer = transformers.AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    batches = inputs.make_batches(samples, loaded, seq_len=doc["source"].get("seq_len", 128),
                                  batch_size=args.batch_size or doc["source"].get("batch_size", 32), what="eval")
    from quantkit import load

    qmodel = load(path)
    encoder = report.is_encoder_batch(batches[0])
    timing: dict[str, dict] = {"float": {}, "int8 (q/dq reference)": {}}
    ref = report.outputs_of(loaded.model, batches, progress=progress, desc="float model", timing=timing["float"])
    approx = report.outputs_of(qmodel, batches, progress=progress, desc="int8 model",
                               timing=timing["int8 (q/dq reference)"])
    metric = report.compare(ref, approx, encoder=encoder)
    note = None
    if args.compile:
        compiled, note = _compiled(qmodel, batches[0])
        if compiled is not None:
            timing["int8 compiled"] = {}
            lowered = report.outputs_of(compiled, batches, progress=progress, desc="compiled int8",
                                        timing=timing["int8 compiled"])
            metric["compiled_mean_cosine"] = float(_hf_cosine(ref, lowered).mean())
    if args.json:
        import json

        say(json.dumps({"data": where, "metric": metric, "latency": timing}, indent=2))
        return 0
    say(f"{path}: {metric['name']} against the float model on the {where} ({metric['samples']} samples)")
    say(report.render_table([{"mean cosine": metric["mean_cosine"], "min cosine": metric["min_cosine"],
                              "SQNR (dB)": metric["sqnr_db"]}], ["mean cosine", "min cosine", "SQNR (dB)"]))
    say("")
    say(f"latency on this machine ({torch.get_num_threads()} threads, eager PyTorch):")
    say(report.render_table([{"model": k, **v} for k, v in timing.items()],
                            ["model", "median_ms_per_batch", "samples_per_s"]))
    if note:
        say(f"(compiled int8 not timed: {note})")
    return 0
