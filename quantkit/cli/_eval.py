"""``quantkit inspect`` and ``quantkit eval``: read an artifact directory back.

An artifact's JSON files are untrusted input: every field is checked before use, and
eval never imports code an artifact names. The float model of a factory artifact is
rebuilt only from ``eval --model MODULE:FACTORY``; an HF model directory it records is
data (loaded with transformers' own classes, never with custom code).

What is read of an artifact is ``_eval_source``'s; a causal LM given ``--data FILE.txt`` (and any
program with a KV cache) is measured by ``_eval_lm`` (perplexity, decode tokens/s).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..export import _artifact
from ..lowering._bf16 import bf16_supported
from ..lowering._weight_only import kernel_choices
from . import _data as datasets, _inputs as inputs, _report as report
from ._markdown import render_table
from ._quantize import REPORT_JSON, TOKENIZER_DIR
from .._errors import QuantkitError
from .._text import printable
from ._eval_lm import is_causal_lm, run_perplexity
from ._eval_source import Source, damaged, float_spec, load_program, read_artifact, read_source

__all__ = ["run_inspect", "run_eval", "run_perplexity"]  # run_perplexity: _eval_lm's


# --- inspect -----------------------------------------------------------------------------

def _scale_range(rec: dict) -> str:
    s = rec.get("scale") or []
    if not isinstance(s, list) or not all(isinstance(v, (int, float)) for v in s):
        return "?"
    if not s:
        return "run time"
    return f"{min(s):.3g}" if len(s) == 1 else f"{min(s):.3g}..{max(s):.3g} ({len(s)} ch)"


def _number(v) -> str:
    if v is None:
        return "inf"  # report.json writes an infinite SQNR (identical outputs) as null
    return f"{v:.4f}" if isinstance(v, (int, float)) and abs(v) < 1.5 else f"{v:.1f}" if isinstance(v, (int, float)) else "?"


def _read_report(path: Path) -> dict:
    file = path / REPORT_JSON
    if not file.is_file():
        return {}
    rep = _artifact.read_json(file)
    if not isinstance(rep, dict):
        raise damaged(file, f"it holds {type(rep).__name__}, not an object")
    for key, kind in (("metric", dict), ("size", dict), ("layers", list)):
        if key in rep and not isinstance(rep[key], kind):
            raise damaged(file, f"field {key!r} is {type(rep[key]).__name__}")
    if not all(isinstance(r, dict) for r in rep.get("layers", [])):
        raise damaged(file, "'layers' holds entries that are not objects")
    return rep


def _printable(say):
    """``say`` with control characters and bidirectional overrides (from a hostile JSON file, a
    path name, an exception) shown as escapes (``quantkit._text.printable``): a newline too,
    so one field stays one line, unless ``block=True`` (a table, whose cells are escaped already)."""
    return lambda text="", *, block=False: say(printable(text, newlines=block))


def run_inspect(args, say, warn) -> int:
    """Print a summary of the artifact ``args.dir`` with ``say``; ``warn`` gets notes (stderr)."""
    say = _printable(say)
    path, doc = read_artifact(args.dir, args, _printable(warn))
    rep = _read_report(path)
    recipe, source = doc.get("recipe", {}), doc.get("source", {})
    size = (path / _artifact.MODEL_FILE).stat().st_size
    tensors = doc.get("tensors", [])
    # dynamic activations are "dynamic" (per tensor) or "dynamic-per-token"
    kinds = {k: sum(1 for t in tensors if str(t.get("kind", "")).split("-per-")[0] == k)
             for k in ("weight", "activation", "dynamic")}
    say(f"{path}")
    say(f"  model:    {rep.get('model') or source.get('model', {})}")
    say("  recipe:   " + (", ".join(f"{k}={v}" for k, v in recipe.items()) if recipe else "(saved from Python)"))
    say("  made by:  " + ", ".join(f"{k} {v}" for k, v in doc.get("versions", {}).items()))
    line = f"  size:     {_artifact.MODEL_FILE} {size / 2**20:.1f} MiB"
    ratio = rep.get("size", {}).get("ratio")
    if isinstance(ratio, (int, float)):
        line += f" ({ratio:.3f}x the fp32 weights)"
    say(line)
    # weights by stored dtype (int8, int4, float8_e4m3fn, ...), from the records
    wdtypes: dict = {}
    for t in tensors:
        if str(t.get("kind", "")) == "weight":
            d = str(t.get("dtype") or "int8")
            wdtypes[d] = wdtypes.get(d, 0) + 1
    weights = ", ".join(f"{n} {d} weights" for d, n in wdtypes.items()) or "0 weights"
    say(f"  tensors:  {weights}, {kinds['activation']} static activations, "
        f"{kinds['dynamic']} dynamic activations")
    if "int4" in wdtypes or "uint4" in wdtypes:  # whether our CPU int4 kernel would run them here (checked, not built)
        from ..kernels import int4_cpu_status  # not at import: quantkit.kernels decorates Triton kernels

        say(f"  kernel:   {int4_cpu_status(build=False).describe()}")
    m = rep.get("metric")
    if m:
        say(f"  accuracy: {m.get('name')} mean {_number(m.get('mean_cosine'))}, min {_number(m.get('min_cosine'))}, "
            f"SQNR {_number(m.get('sqnr_db'))} dB on {m.get('samples')} held-out samples")
    fit = rep.get("weights_not_loaded")
    if isinstance(fit, dict):
        say(f"  WARNING:  quantized with --allow-missing-weights: the checkpoint does not fit "
            f"{fit.get('architecture')}; some tensors were randomly initialised")
    rows = []
    if rep.get("layers"):
        for r in rep["layers"]:
            rows.append({"layer": r.get("layer"), "op": r.get("op"), "weight": r.get("weight"),
                         "SQNR (dB)": _number(r.get("sqnr_db"))})
        cols = ["layer", "op", "weight", "SQNR (dB)"]
    else:
        for t in tensors:
            rows.append({"tensor": t.get("node"), "kind": t.get("kind"), "dtype": t.get("dtype"),
                         "scale": _scale_range(t)})
        cols = ["tensor", "kind", "dtype", "scale"]
    say("")
    say(render_table(rows, cols), block=True)
    return 0


# --- eval --------------------------------------------------------------------------------

def _eval_samples(source: Source, data_arg: str | None, example_ndims):
    if data_arg is not None:
        data = datasets.DataSpec.from_arg(data_arg)
        samples, origins = datasets.read_samples(data, example_ndims=example_ndims)
        return samples, origins, "given data"
    data = source.data
    if data.kind != "default" and not (Path(data.path).is_dir() if data.kind == "tensors" else Path(data.path).is_file()):
        raise QuantkitError(f"the calibration data this artifact was split from, {data.path!r}, does not exist "
                            "any more (or is not a " + ("directory" if data.kind == "tensors" else "file")
                            + "); pass --data PATH to evaluate on other data")
    samples, origins = datasets.read_samples(data, example_ndims=example_ndims)
    if len(samples) != source.samples or datasets.fingerprint(source.data) != source.fingerprint:
        raise QuantkitError("the calibration data changed since quantize, so its held-out split is lost; "
                            "pass --data PATH to evaluate on other data")
    return [samples[i] for i in source.heldout], [origins[i] for i in source.heldout], "held-out split"


class _FrozenFloat(torch.nn.Module):
    """``torch.compile`` of the float model run like ``quantkit.compile``'s int8 one: Inductor
    freezing on (weights folded as constants), no grad, inputs copied (a frozen graph may
    reuse an input's buffer)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.compiled = torch.compile(model)

    def forward(self, *args, **kwargs):
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            return self.compiled(*args, **kwargs)


class _FrozenBf16(_FrozenFloat):
    """The float model cast to bf16, compiled as :class:`_FrozenFloat`; float inputs are cast too.
    Timed only (it is what ``model.to(torch.bfloat16)`` plus ``torch.compile`` gives a user)."""

    def __init__(self, model: torch.nn.Module) -> None:
        import copy

        super().__init__(copy.deepcopy(model).to(torch.bfloat16))

    def forward(self, *args, **kwargs):
        def cast(v):
            return v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v

        return super().forward(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})


BF16_NAME = "float bf16 (compiled)"
NO_BF16 = ("no bf16 comparison: this CPU has no native BF16 (AVX-512 BF16 or AMX), so bf16 would be emulated "
           "(~100x slower than fp32), no fair baseline")


def _compiled_bf16(float_model, batches: list):
    """(the float model compiled in bf16, None), or (None, why not): only where the CPU has native BF16."""
    import io
    import contextlib

    from ..pipeline._inputs import call_model

    if not bf16_supported():
        return None, NO_BF16
    try:
        with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
            fast = _FrozenBf16(float_model)
            for b in batches[:1]:
                call_model(fast, b)
        return fast, None
    except Exception as exc:  # report, don't fail: the fp32 comparison stands
        text = " ".join(str(exc).split())
        return None, f"no bf16 comparison: compiling the float model in bf16 failed ({text[:150] or type(exc).__name__})"


def _compiled(float_model, qmodel, batches: list):
    """(compiled float, compiled int8, None), or (None, None, why) when compilation fails."""
    import io
    import contextlib

    import quantkit
    from ..pipeline._inputs import call_model

    try:
        with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
            fast_int8 = quantkit.compile(qmodel)
            fast_float = _FrozenFloat(float_model)
            for b in batches[:1]:
                call_model(fast_int8, b)
                call_model(fast_float, b)
        return fast_float, fast_int8, None
    except Exception as exc:  # report, don't fail: the reference numbers stand
        text = " ".join(str(exc).split())
        return None, None, f"compilation failed ({text[:150] or type(exc).__name__})"


def _check_eval_args(args) -> torch.device:
    for flag, v in (("--batch-size", args.batch_size), ("--num", args.num)):
        if v is not None and v < 1:
            raise inputs.UsageError(f"{flag} must be at least 1, got {v}")
    return inputs.check_device(args.device)


def run_eval(args, say, warn) -> int:
    """Compare the artifact ``args.dir`` with its float model; results go to ``say``, notes to ``warn``."""
    say, warn = _printable(say), _printable(warn)
    device = _check_eval_args(args)
    path, doc = read_artifact(args.dir, args, warn)
    if is_causal_lm(doc, args):
        return run_perplexity(path, doc, args, say, warn, device)
    for flag, v in (("--tokenizer", args.tokenizer), ("--window", args.window), ("--stride", args.stride),
                    ("--max-tokens", args.max_tokens)):
        if v is not None:
            raise inputs.UsageError(f"{flag} applies to causal LMs evaluated on a text file (--data FILE.txt) only")
    source = read_source(path, doc)
    spec = float_spec(args, source)
    spec.check()
    progress = not args.quiet
    ndims = [len(s) for s, _ in inputs.parse_example_input(spec.example_input)] if spec.kind == "factory" else None
    samples, origins, where = _eval_samples(source, args.data, ndims)
    bad = set(datasets.nonfinite(samples))
    if bad and not args.skip_nonfinite:
        first = origins[min(bad)]
        raise QuantkitError(f"eval sample {first} holds NaN or inf ({len(bad)} of {len(samples)} samples do); "
                            "fix the data, or pass --skip-nonfinite to leave such samples out")
    keep = [i for i in range(len(samples)) if i not in bad]
    if not keep:
        raise QuantkitError(f"every eval sample holds NaN or inf ({len(samples)}); nothing is left to evaluate")
    if args.num is not None:
        keep = keep[:args.num]
    samples, origins = [samples[i] for i in keep], [origins[i] for i in keep]

    loaded = inputs.load_model(spec, progress=progress, allow_mismatch=source.allow_missing_weights)
    if loaded.fit is not None and not loaded.fit.clean:
        warn(f"quantkit: warning: the float model was rebuilt with --allow-missing-weights (as quantized): "
             f"{loaded.fit.summary()}; those tensors are randomly initialised")
    loaded.model.to(device)
    tok_dir = path / TOKENIZER_DIR
    if loaded.tokenizer is None and tok_dir.is_dir() and samples and isinstance(samples[0], str):
        import transformers

        loaded.tokenizer = transformers.AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True,
                                                                      trust_remote_code=False)
    batch_size = args.batch_size or source.batch_size
    batches = datasets.make_batches(samples, loaded, seq_len=source.seq_len, batch_size=batch_size, what="eval",
                                  origins=origins)
    batches = [datasets.to_device(b, device) for b in batches]
    where_of = [origins[i:i + batch_size] for i in range(0, len(origins), batch_size)]
    qmodel = load_program(path, device, allow_unverified=args.allow_unverified)

    note = bf16_note = None
    timed = {"float (eager)": loaded.model, "int8 (q/dq reference)": qmodel}
    if args.compile:
        # one static shape: each model compiles once (dynamic shapes compile to slow CPU kernels)
        static = datasets.static_shapes(batches, pad_id=datasets.pad_id_of(loaded))
        fast_float, fast_int8, note = _compiled(loaded.model, qmodel, static)
        if fast_int8 is not None:
            timed = {"float (compiled)": fast_float, "int8 (compiled)": fast_int8}
            batches = static
            if device.type == "cpu":  # the baseline a CPU user has without quantkit, where it is native
                fast_bf16, bf16_note = _compiled_bf16(loaded.model, static)
                if fast_bf16 is not None:
                    timed[BF16_NAME] = fast_bf16
    int8_name = list(timed)[1]
    _, scores = report.compare_models(loaded.model, {int8_name: timed[int8_name]}, batches, origins=where_of,
                                      progress=progress, desc="eval")
    metric = scores[int8_name]
    timing = report.time_interleaved(timed, batches)  # bf16 interleaved with the other two
    speedup = timing[int8_name].pop("speedup")
    bf16 = timing.pop(BF16_NAME, None)
    result = {"data": where, "samples_nonfinite_skipped": len(bad), "device": str(device),
              "compiled": args.compile and note is None, "metric": metric, "latency": timing,
              "speedup": round(speedup, 3)}
    if bf16 is not None:
        bf16.pop("speedup")
        bf16["int8_speedup"] = round(bf16["median_ms_per_batch"] / timing[int8_name]["median_ms_per_batch"], 3)
        result["bf16"] = bf16
    elif bf16_note:
        result["bf16"] = {"note": bf16_note}
    if note:
        result["note"] = note
    # which kernel each int4 layer got, and why not ours (a refused or unbuildable kernel is said, never silent)
    kernels = kernel_choices(timed[int8_name]) if result["compiled"] else []
    if kernels:
        result["kernels"] = kernels
    if args.json:
        say(json.dumps(report.json_safe(result), indent=2, allow_nan=False), block=True)
        return 0
    say(f"{path}: {metric['name']} of {int8_name} against the float model on the {where} "
        f"({metric['samples']} samples" + (f", {len(bad)} non-finite left out)" if bad else ")"))
    row = {"mean cosine": metric["mean_cosine"], "min cosine": metric["min_cosine"], "SQNR (dB)": metric["sqnr_db"]}
    cols = ["mean cosine", "min cosine", "SQNR (dB)"]
    if "top1_agreement" in metric:
        row["top-1 agreement"] = metric["top1_agreement"]
        cols.append("top-1 agreement")
    say(render_table([row], cols), block=True)
    say("")
    kind = "torch.compile, Inductor freezing" if result["compiled"] else "eager PyTorch"
    say(f"latency on this machine ({device}, {torch.get_num_threads()} threads, {kind}; batches interleaved):")
    say(render_table([{"model": k, **v} for k, v in timing.items()],
                            ["model", "median_ms_per_batch", "samples_per_s", "batches"]), block=True)
    say(f"int8 speedup over float: {speedup:.2f}x")
    if bf16 is not None:
        say(f"float compiled in bf16: {bf16['median_ms_per_batch']:.3f} ms per batch; int8 speedup over it: "
            f"{bf16['int8_speedup']:.2f}x" + (" (slower than bf16)" if bf16["int8_speedup"] < 1 else ""))
    elif bf16_note:
        say(bf16_note)
    for line in kernels:
        say(line)
    if note:
        say(f"(compiled models not timed: {note}; timed the eager reference instead)")
    return 0
