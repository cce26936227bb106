"""``quantkit quantize``: checkpoint on disk → int8 artifact directory.

The flow: check the command line and inputs (cheap) → load the float model and data →
capture → prepare → calibrate → convert → measure against float → write the directory.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from . import _artifact, _cli_inputs as inputs, _cli_report as report
from ._errors import QuantkitError

__all__ = ["Scheme", "Recipe", "run_quantize", "REPORT_JSON", "REPORT_MD", "TOKENIZER_DIR"]

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
TOKENIZER_DIR = "tokenizer"


class Scheme(str, Enum):
    """Quantization schemes the CLI offers."""

    W8A8 = "w8a8"  # static int8 weights (per channel) and uint8 activations (per tensor)
    W8A8_DYNAMIC = "w8a8-dynamic"  # int8 weights, activations quantized per batch at run time
    W8A8_PER_TOKEN = "w8a8-per-token"  # int8 weights, activations quantized per token at run time

    @property
    def dynamic(self) -> bool:
        return self is not Scheme.W8A8


@dataclass(frozen=True)
class Recipe:
    """The quantization choices of one ``quantize`` run, as written to quantization.json."""

    scheme: Scheme = Scheme.W8A8
    observer: str = "minmax"
    weight_observer: str = "per_channel_minmax"
    skip: tuple[str, ...] = ()
    smoothquant: float | str | None = None
    accuracy_budget: float | None = None
    metric: str = "cosine"

    def __post_init__(self) -> None:
        from quantkit import observers
        from quantkit._metrics import resolve_metric
        from quantkit._smoothquant import parse_alpha

        object.__setattr__(self, "scheme", Scheme(self.scheme))
        for flag, name in (("--observer", self.observer), ("--weight-observer", self.weight_observer)):
            try:
                observers.get(name)
            except ValueError:
                raise inputs.UsageError(
                    f"unknown observer {name!r} for {flag}; available: {', '.join(observers.available())}"
                ) from None
        try:
            if self.smoothquant is not None:
                object.__setattr__(self, "smoothquant", parse_alpha(str(self.smoothquant)))
            if self.accuracy_budget is not None and not self.accuracy_budget >= 0:
                raise ValueError(f"--accuracy-budget must be a non-negative drop, got {self.accuracy_budget}")
            if self.accuracy_budget is not None:
                resolve_metric(self.metric)
        except (ValueError, TypeError) as exc:
            raise inputs.UsageError(str(exc).splitlines()[0]) from None

    def to_json(self) -> dict:
        return {"scheme": self.scheme.value, "observer": None if self.scheme.dynamic else self.observer,
                "weight_observer": self.weight_observer, "skip": list(self.skip),
                "smoothquant": self.smoothquant, "accuracy_budget": self.accuracy_budget,
                "metric": self.metric if self.accuracy_budget is not None else None}

    def config(self):
        """The W8A8 ``QuantConfig`` of this recipe."""
        from quantkit.quantizers import QuantConfig

        return QuantConfig(act_observer=self.observer, weight_observer=self.weight_observer,
                           dynamic=self.scheme.dynamic,
                           granularity="per-token" if self.scheme is Scheme.W8A8_PER_TOKEN else "per-tensor")

    def quantizer(self, module_names: list[str]):
        """W8A8 for linear/conv/matmul plus weight-only int8 embeddings; ``skip`` patterns stay float."""
        from torchao.quantization.pt2e.quantizer import ComposableQuantizer

        from quantkit.quantizers import EmbeddingQuantizer, W8A8Quantizer

        w8a8 = W8A8Quantizer(self.config())
        embeddings = EmbeddingQuantizer()
        for name in self.skipped(module_names):
            w8a8.set_module_name(name, None)
            embeddings.set_module_name(name, None)
        return ComposableQuantizer([embeddings, w8a8])

    def skipped(self, module_names: list[str]) -> list[str]:
        """Module names matching any ``--skip`` pattern (fnmatch); a pattern matching nothing is an error."""
        out = []
        for pattern in self.skip:
            hits = [n for n in module_names if n and fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise QuantkitError(f"--skip {pattern!r} matches no module; module names look like "
                                    f"{', '.join(n for n in module_names[1:4] if n)}")
            out.extend(h for h in hits if h not in out)
        return out


class _Clock:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.start = time.perf_counter()

    def lap(self, stage: str, since: float) -> float:
        now = time.perf_counter()
        self.times[stage] = round(now - since, 2)
        return now


def _check(args, recipe: Recipe):
    """Everything that can be checked without loading the model or the data."""
    spec = inputs.ModelSpec.from_args(args.model, args.weights, args.example_input)
    data = inputs.DataSpec.from_arg(args.calib)
    for flag, v, lo in (("--num-calib", args.num_calib, 1), ("--seq-len", args.seq_len, 2), ("--batch-size", args.batch_size, 1)):
        if v is not None and v < lo:
            raise inputs.UsageError(f"{flag} must be at least {lo}, got {v}")
    if recipe.scheme.dynamic and args.observer is not None:
        raise inputs.UsageError(f"--observer has no effect with --scheme {recipe.scheme.value} (activation ranges "
                                "are chosen at run time); drop it")
    inputs.check_not_input(Path(args.out), spec.input_paths() + ([Path(data.path)] if data.path else []))
    out = _artifact.check_out_dir(args.out, overwrite=args.force, flag="--force", exists_error=inputs.UsageError)
    spec.check()
    if data.kind == "default" and not spec.is_hf:
        raise inputs.UsageError("a factory model needs --calib DIR (a directory of .pt/.npy/.safetensors tensors)")
    return spec, data, out


def run_quantize(args, say) -> int:
    recipe = Recipe(scheme=args.scheme, observer=args.observer or "minmax",
                    weight_observer=args.weight_observer, skip=tuple(args.skip or ()),
                    smoothquant=args.smoothquant, accuracy_budget=args.accuracy_budget, metric=args.metric)
    spec, data, out = _check(args, recipe)
    progress = not args.quiet
    clock = _Clock()

    # data before the model: a bad text file fails in a second
    example_ndims = None
    if spec.kind == "factory":
        example_ndims = [len(s) for s, _ in inputs.parse_example_input(spec.example_input)]
    samples = inputs.read_samples(data, example_ndims=example_ndims)
    split = inputs.split_samples(len(samples), num_calib=args.num_calib)
    t = clock.start
    loaded = inputs.load_model(spec, progress=progress)
    module_names = [n for n, _ in loaded.model.named_modules()]
    quantizer = recipe.quantizer(module_names)
    kw = dict(seq_len=args.seq_len, batch_size=args.batch_size)
    calib = inputs.make_batches([samples[i] for i in split.calib], loaded, what="calibration", **kw)
    heldout = inputs.make_batches([samples[i] for i in split.heldout], loaded, what="held-out", **kw)
    t = clock.lap("load", t)

    import quantkit

    # torch.export prints the partial graph to stderr when it fails; CaptureError says why in one line
    with contextlib.redirect_stderr(io.StringIO()):
        if spec.is_hf:
            from . import _hf

            gm = quantkit.capture(loaded.model, calib[0], dynamic_shapes=_hf.dynamic_shapes(calib[0]))
        else:
            gm = quantkit.capture(loaded.model, loaded.example)
    t = clock.lap("capture", t)
    if recipe.smoothquant is not None:
        gm = quantkit.smooth_quant(gm, calib, alpha=recipe.smoothquant, config=recipe.config())
        t = clock.lap("smoothquant", t)
    fallback = None
    if recipe.accuracy_budget is not None:
        # the budget is measured on the calibration samples; the report's held-out metric stays independent
        qmodel, fallback = quantkit.auto_fallback(gm, calib[0], calib, calib, recipe.metric,
                                                  recipe.accuracy_budget, quantizer=quantizer, progress=progress)
        t = clock.lap("auto_fallback", t)
        if not qmodel.meta.get("quantkit_converted"):
            raise QuantkitError(f"--accuracy-budget {recipe.accuracy_budget:g} keeps every layer float "
                                f"(all-int8 drop {fallback.reference - fallback.quantized_score:.3g}); "
                                "raise the budget or quantize without it")
    else:
        prepared = quantkit.prepare(gm, quantizer)
        quantkit.calibrate(prepared, calib, progress=progress)
        t = clock.lap("calibrate", t)
        qmodel = quantkit.convert(prepared)
        t = clock.lap("convert", t)

    encoder = report.is_encoder_batch(heldout[0])
    ref = report.outputs_of(loaded.model, heldout, progress=progress, desc="float model")
    approx = report.outputs_of(qmodel, heldout, progress=progress, desc="int8 model")
    metric = report.compare(ref, approx, encoder=encoder)
    records = qmodel.meta.get("quantkit_qparams", [])
    layers = report.layer_sqnr(loaded.model, qmodel, heldout[0], records)
    t = clock.lap("evaluate", t)

    with contextlib.redirect_stderr(io.StringIO()):
        program = _artifact.export_converted(qmodel)
    source = {"model": spec.to_json(), "data": data.to_json(), "fingerprint": inputs.fingerprint(data),
              "samples": len(samples), "heldout": split.heldout, "seq_len": args.seq_len,
              "batch_size": args.batch_size}
    doc = _artifact.recipe_document(qmodel, recipe=recipe.to_json(), source=source)
    with _artifact.atomic_dir(out, overwrite=args.force, flag="--force") as tmp:
        model_file = _artifact.write_program(program, tmp)
        _artifact.write_json(tmp / _artifact.RECIPE_FILE, doc)
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
        t = clock.lap("save", t)
        clock.times["total"] = round(time.perf_counter() - clock.start, 2)
        int8_bytes = model_file.stat().st_size
        rep = {
            "model": _describe(spec),
            "recipe": recipe.to_json(),
            "data": {"source": data.to_json(), "calibration_samples": len(split.calib),
                     "heldout_samples": len(split.heldout),
                     "heldout_is_calibration": split.heldout == split.calib},
            "metric": metric,
            "size": {"float_bytes": loaded.weight_bytes, "int8_bytes": int8_bytes,
                     "ratio": round(int8_bytes / max(loaded.weight_bytes, 1), 4)},
            "time_s": clock.times,
            "layers": layers,
            "versions": doc["versions"],
        }
        if fallback is not None:
            rep["fallback"] = {"kept_float": [layer.label for layer in fallback.float_layers],
                               "drop": fallback.drop, "budget": fallback.budget, "met": fallback.met,
                               "int8_gemm_fraction": fallback.int8_gemm_fraction}
        _artifact.write_json(tmp / REPORT_JSON, rep)
        (tmp / REPORT_MD).write_text(report.render_report(rep), encoding="utf-8")
    say(f"wrote {out}: {metric['name']} mean {metric['mean_cosine']:.4f} (min {metric['min_cosine']:.4f}) "
        f"on {metric['samples']} held-out samples, size {rep['size']['ratio']:.3f}x fp32, "
        f"{clock.times['total']:.0f} s")
    return 0


def _describe(spec: inputs.ModelSpec) -> str:
    if spec.kind == "default":
        return "all-MiniLM-L6-v2 (bundled default)"
    return spec.factory if spec.kind == "factory" else spec.path
