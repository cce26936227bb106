"""``quantkit inspect`` and ``quantkit eval``: read an artifact directory back.

An artifact's JSON files are untrusted input: every field is checked before use, and
eval never imports code an artifact names. The float model of a factory artifact is
rebuilt only from ``eval --model MODULE:FACTORY``; an HF model directory it records is
data (loaded with transformers' own classes, never with custom code).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import _hf
from ..export import _artifact
from ..generation import generate_with_stats
from ..metrics import perplexity, resolve_window
from ..lowering._bf16 import bf16_supported
from ..lowering._weight_only import kernel_choices
from . import _data as datasets, _inputs as inputs, _report as report
from ._markdown import render_table
from ._quantize import REPORT_JSON, TOKENIZER_DIR
from .._errors import QuantkitError
from .._text import printable

__all__ = ["run_inspect", "run_eval", "run_perplexity"]


def _damaged(path: Path, why: str) -> QuantkitError:
    return QuantkitError(f"{str(path)!r} is damaged: {why}; re-run quantkit quantize to rewrite the artifact")


def _read_artifact(directory: str, args, warn) -> tuple[Path, dict]:
    """The checked artifact at ``directory`` and its ``quantization.json``. With
    ``--allow-unverified`` one that cannot be verified is read too, and ``warn`` says so."""
    path = Path(directory)
    if not path.is_dir():
        raise QuantkitError(f"{directory!r} is not a directory; pass the --out directory of quantkit quantize")
    # both files, quantkit's format and format_version, model.pt2's SHA-256, nothing unsafe
    doc = _artifact.verify_artifact(path, allow_unverified=args.allow_unverified, flag="--allow-unverified")
    reason = _artifact.unverified_reason(doc)
    if reason is not None:
        warn(f"quantkit: warning: {str(path)!r} is not verified ({reason}); read because of --allow-unverified")
    for key, kind in (("recipe", dict), ("source", dict), ("versions", dict), ("tensors", list)):
        if key in doc and not isinstance(doc[key], kind):
            raise _damaged(path / _artifact.RECIPE_FILE, f"field {key!r} is {type(doc[key]).__name__}, "
                                                         f"not {'an object' if kind is dict else 'a list'}")
    if not all(isinstance(t, dict) for t in doc.get("tensors", [])):
        raise _damaged(path / _artifact.RECIPE_FILE, "'tensors' holds entries that are not objects")
    return path, doc


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
        raise _damaged(file, f"it holds {type(rep).__name__}, not an object")
    for key, kind in (("metric", dict), ("size", dict), ("layers", list)):
        if key in rep and not isinstance(rep[key], kind):
            raise _damaged(file, f"field {key!r} is {type(rep[key]).__name__}")
    if not all(isinstance(r, dict) for r in rep.get("layers", [])):
        raise _damaged(file, "'layers' holds entries that are not objects")
    return rep


def _printable(say):
    """``say`` with control characters and bidirectional overrides (from a hostile JSON file, a
    path name, an exception) shown as escapes (``quantkit._text.printable``): a newline too,
    so one field stays one line, unless ``block=True`` (a table, whose cells are escaped already)."""
    return lambda text="", *, block=False: say(printable(text, newlines=block))


def run_inspect(args, say, warn) -> int:
    """Print a summary of the artifact ``args.dir`` with ``say``; ``warn`` gets notes (stderr)."""
    say = _printable(say)
    path, doc = _read_artifact(args.dir, args, _printable(warn))
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

@dataclass(frozen=True)
class _Source:
    """quantization.json's ``source``, checked field by field."""

    model: inputs.ModelSpec
    data: datasets.DataSpec
    fingerprint: str
    samples: int
    heldout: list[int]
    seq_len: int
    batch_size: int
    allow_missing_weights: bool


def _source(path: Path, doc: dict) -> _Source:
    src = doc.get("source")
    if not src:
        raise QuantkitError(f"{str(path)!r} was saved from Python and does not record its float model; "
                            "eval needs an artifact written by quantkit quantize")
    file = path / _artifact.RECIPE_FILE

    def field(key, kind, check=lambda v: True, default=None):
        v = src.get(key, default)
        if not isinstance(v, kind) or isinstance(v, bool) is not (kind is bool) or not check(v):
            raise _damaged(file, f"source.{key} is {v!r}")
        return v

    samples = field("samples", int, lambda v: v >= 1)
    data = src.get("data", {})
    if not isinstance(data, dict) or data.get("kind", "default") not in ("default", "text", "tensors") \
            or not isinstance(data.get("path", ""), str) or (data.get("kind") in ("text", "tensors") and "path" not in data):
        raise _damaged(file, f"source.data is {data!r}")
    heldout = field("heldout", list, lambda v: v and all(isinstance(i, int) and not isinstance(i, bool)
                                                        and 0 <= i < samples for i in v))
    return _Source(
        model=inputs.ModelSpec.from_json(src.get("model")),
        data=datasets.DataSpec.from_json(data),
        fingerprint=field("fingerprint", str),
        samples=samples,
        heldout=heldout,
        seq_len=field("seq_len", int, lambda v: v >= 2, 128),
        batch_size=field("batch_size", int, lambda v: v >= 1, 32),
        allow_missing_weights=field("allow_missing_weights", bool, default=False),
    )


def _float_spec(args, source: _Source) -> inputs.ModelSpec:
    """The float model to compare with: ``--model`` if given, else the recorded HF model.
    A factory is imported only when ``--model`` names it (never from the artifact)."""
    recorded = source.model
    if args.model is None:
        for flag, v in (("--weights", args.weights), ("--example-input", args.example_input), ("--task", args.task)):
            if v is not None:
                raise inputs.UsageError(f"{flag} applies with --model only")
        if recorded.kind == "factory":
            raise inputs.UsageError(
                f"this artifact's float model comes from the factory {recorded.factory!r}; eval does not import "
                f"code an artifact names: pass --model {recorded.factory} if you trust that code")
        return recorded
    if inputs.is_factory_name(args.model):
        same = recorded.kind == "factory"
        weights = args.weights or (recorded.weights if same else None)
        example = args.example_input or (recorded.example_input if same else None)
        return inputs.ModelSpec.from_args(args.model, weights, example, "auto")
    task = args.task or (recorded.task if recorded.is_hf else "auto")
    return inputs.ModelSpec.from_args(args.model, args.weights, args.example_input, task)


def _eval_samples(source: _Source, data_arg: str | None, example_ndims):
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


def _load_int8(path: Path, device: torch.device, *, allow_unverified: bool):
    """The artifact's int8 program as a module on ``device`` (artifacts are saved for CPU)."""
    with warnings.catch_warnings():  # _read_artifact has said it is not verified
        warnings.simplefilter("ignore", _artifact.UnverifiedWarning)
        # verified and read without unpickling (quantkit.export._safe_pt2)
        module = _artifact.load(path, allow_unverified=allow_unverified)
    if device.type == "cpu":
        return module
    from torch.export.passes import move_to_device_pass

    moved = move_to_device_pass(module.meta[_artifact.PROGRAM_META_KEY], device).module()
    moved.meta["quantkit_converted"] = True
    return moved


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
    path, doc = _read_artifact(args.dir, args, warn)
    if _is_causal_lm(doc, args):
        return run_perplexity(path, doc, args, say, warn, device)
    for flag, v in (("--tokenizer", args.tokenizer), ("--window", args.window), ("--stride", args.stride),
                    ("--max-tokens", args.max_tokens)):
        if v is not None:
            raise inputs.UsageError(f"{flag} applies to causal LMs evaluated on a text file (--data FILE.txt) only")
    source = _source(path, doc)
    spec = _float_spec(args, source)
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
    qmodel = _load_int8(path, device, allow_unverified=args.allow_unverified)

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


# --- eval of a causal LM: perplexity and decode speed ---------------------------------------

DECODE_PROMPT, DECODE_TOKENS = 32, 32  # the timed generation: prompt tokens, new tokens (greedy)


def _recorded_causal_lm(doc: dict, args) -> bool:
    """Whether the float model (``--model``, else the one quantization.json records) is an HF causal LM:
    an architecture transformers can generate with, not an encoder-decoder."""
    if args.model is not None:
        if inputs.is_factory_name(args.model):
            return False
        path, task = Path(args.model), args.task or "auto"
    else:
        model = (doc.get("source") or {}).get("model")
        if not isinstance(model, dict) or model.get("kind") != "hf" or not isinstance(model.get("path"), str):
            return False
        path, task = Path(model["path"]), model.get("task", "auto")
    if task == "causal-lm":
        return True
    if task != "auto" or not (path / "config.json").is_file():
        return False
    try:
        cls, _ = _hf.model_class(path, "auto")
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (QuantkitError, OSError, ValueError):
        return False  # the comparison path reports a broken float model in its own words
    return cls.can_generate() and not config.get("is_encoder_decoder", False)


def _is_causal_lm(doc: dict, args) -> bool:
    """eval measures perplexity for a program with a KV cache (always), and for a causal LM given
    a text file (``--data FILE``): one whose float model (recorded, or ``--model``) is an HF causal
    LM, or one saved from Python (no float model recorded) given ``--tokenizer``. A causal LM
    without ``--data`` is compared with its float model, as any other model."""
    if isinstance(doc.get("kv_cache"), dict):
        return True
    if args.data is None or Path(args.data).is_dir():
        return False
    if not doc.get("source") and args.model is None:
        return args.tokenizer is not None
    return _recorded_causal_lm(doc, args)


def _read_text(arg: str | None) -> tuple[Path, str]:
    """The text of ``--data``: an existing, non-empty UTF-8 file (one line of error otherwise)."""
    if arg is None:
        raise inputs.UsageError("this artifact is a causal LM with a KV cache: pass --data FILE.txt (held-out "
                                "text) to measure its perplexity")
    path = Path(arg)
    if not path.exists():
        raise QuantkitError(f"--data {arg!r} does not exist; pass a UTF-8 text file of held-out text")
    if not path.is_file():
        raise QuantkitError(f"--data {arg!r} is not a file; perplexity is measured on one UTF-8 text file")
    raw = path.read_bytes()
    if b"\0" in raw:
        raise QuantkitError(f"--data {arg!r} is binary (it holds NUL bytes), not text; pass a UTF-8 text file")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise QuantkitError(f"--data {arg!r} is not UTF-8 text (byte {exc.start}); pass a UTF-8 text file") from None
    if not text.strip():
        raise QuantkitError(f"--data {arg!r} is empty; pass a file of held-out text")
    return path, text


def _tokenizer(path: Path, doc: dict, args):
    """``--tokenizer``, else the artifact's ``tokenizer/``, else the recorded HF model's own."""
    import transformers

    candidates = [Path(args.tokenizer)] if args.tokenizer else [path / TOKENIZER_DIR]
    model = (doc.get("source") or {}).get("model")
    if not args.tokenizer and isinstance(model, dict) and model.get("kind") == "hf" and isinstance(model.get("path"), str):
        candidates.append(Path(model["path"]))
    for folder in candidates:
        if folder.is_dir() and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                                   "vocab.txt", "tokenizer.model")):
            try:
                return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                                  trust_remote_code=False)
            except Exception as exc:  # a damaged tokenizer folder: one line
                raise QuantkitError(f"the tokenizer in {str(folder)!r} does not load ({' '.join(str(exc).split())[:150]}); "
                                    "pass --tokenizer DIR (an HF tokenizer directory)") from None
        if args.tokenizer:
            raise QuantkitError(f"--tokenizer {args.tokenizer!r} is not a tokenizer directory (no tokenizer.json "
                                "or tokenizer_config.json); pass the HF model or tokenizer directory")
    raise QuantkitError(f"{str(path)!r} holds no tokenizer (no {TOKENIZER_DIR}/ folder) and records no HF model "
                        "that has one; pass --tokenizer DIR (an HF tokenizer directory)")


def _float_lm(path: Path, doc: dict, args):
    """(the float model to compare with, None) or (None, why not)."""
    if doc.get("source"):
        source = _source(path, doc)
        spec, allow = _float_spec(args, source), source.allow_missing_weights
    elif args.model is not None:
        spec, allow = inputs.ModelSpec.from_args(args.model, args.weights, args.example_input, args.task or "auto"), False
    else:
        return None, "no float model to compare with (the artifact was saved from Python): pass --model DIR"
    spec.check()
    return inputs.load_model(spec, progress=False, allow_mismatch=allow).model.eval(), None


def _decode_speed(program, ids: torch.Tensor, info: dict, compile_: bool) -> tuple[dict | None, str | None]:
    """Greedy prefill and decode tokens/s of a KV program (``generation.generate_with_stats``, after its
    warm-up: compilation is not timed): (numbers, None), or (None, why not)."""
    prompt_len = max(1, min(DECODE_PROMPT, info["max_cache_len"] // 2, ids.shape[1]))
    new = min(DECODE_TOKENS, info["max_cache_len"] - prompt_len + 1)
    if new < 2:
        return None, f"decode tokens/s not measured: the KV cache of {info['max_cache_len']} positions is too short"
    prompt = ids[:, :prompt_len].expand(int(info["batch_size"]), -1).contiguous()
    _, stats = generate_with_stats(program, prompt, new, compile=compile_, warmup=True)  # greedy, no eos
    return {"prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens, "batch_size": stats.batch_size,
            "compiled": compile_, "compile_s": round(stats.compile_s, 2),
            "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 1),
            "decode_tokens_per_s": round(stats.decode_tokens_per_s, 1)}, None


def run_perplexity(path: Path, doc: dict, args, say, warn, device: torch.device) -> int:
    """``quantkit eval DIR --data FILE.txt`` of a causal LM: the program's perplexity on the file (and the
    float model's, when it can be rebuilt), and decode tokens/s when the program has a KV cache."""
    kv = doc.get("kv_cache") if isinstance(doc.get("kv_cache"), dict) else None
    if args.num is not None:
        raise inputs.UsageError("--num counts samples; a causal LM's perplexity takes --max-tokens N")
    for flag, v in (("--window", args.window), ("--stride", args.stride), ("--max-tokens", args.max_tokens)):
        if v is not None and v < (2 if flag != "--stride" else 1):
            raise inputs.UsageError(f"{flag} must be at least {2 if flag != '--stride' else 1}, got {v}")
    data, text = _read_text(args.data)
    tokenizer = _tokenizer(path, doc, args)
    # one stream, longer than the tokenizer's model_max_length: windows cut it (its warning is no error here)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = tokenizer(text, return_tensors="pt", verbose=False).input_ids
    if args.max_tokens is not None:
        ids = ids[:, :args.max_tokens]
    if ids.shape[1] < 2:
        raise QuantkitError(f"--data {args.data!r} gives {ids.shape[1]} token; perplexity needs at least 2")
    program = _load_int8(path, device, allow_unverified=args.allow_unverified)
    batch_size = args.batch_size or 1
    # the default window: the program's own length (a full-sequence program), else 256 within a KV cache
    window = args.window or resolve_window(program)
    if args.stride is not None and args.stride > window:
        raise inputs.UsageError(f"--stride must be at most the window ({window}), got {args.stride}")
    result = {"data": str(data), "tokens": int(ids.shape[1]), "window": window, "stride": args.stride or window,
              "device": str(device)}
    result["perplexity"] = perplexity(program, ids, window=window, stride=args.stride, batch_size=batch_size)
    float_model, why = _float_lm(path, doc, args)
    if float_model is not None:
        float_model.to(device)
        result["float_perplexity"] = perplexity(float_model, ids, window=window, stride=args.stride,
                                                batch_size=batch_size)
        del float_model
    else:
        result["float_note"] = why
    speed, note = (None, "decode tokens/s not measured: the program has no KV cache (capture it with "
                         "max_cache_len=N to generate)") if kv is None else _decode_speed(program, ids, kv, args.compile)
    if speed is not None:
        result["decode"] = speed
    else:
        result["decode_note"] = note
    if args.json:
        say(json.dumps(report.json_safe(result), indent=2, allow_nan=False), block=True)
        return 0
    say(f"{path}: perplexity on {str(data)!r} ({result['tokens']} tokens, window {window}, "
        f"stride {result['stride']})")
    line = f"  quantized: {result['perplexity']:.4f}"
    if "float_perplexity" in result:
        f = result["float_perplexity"]
        line += f"   float: {f:.4f}   ({100 * (result['perplexity'] / f - 1):+.2f}%)"
    say(line)
    if "float_note" in result:
        say(f"  ({result['float_note']})")
    if speed is not None:
        say(f"decode: {speed['decode_tokens_per_s']:.1f} tokens/s, prefill {speed['prefill_tokens_per_s']:.1f} tokens/s "
            f"({speed['prompt_tokens']}-token prompt, {speed['new_tokens']} new, batch {speed['batch_size']}, "
            f"{'compiled' if speed['compiled'] else 'eager'}, {device}, {torch.get_num_threads()} threads)")
    else:
        say(note)
    return 0
