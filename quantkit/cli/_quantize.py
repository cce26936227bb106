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
from pathlib import Path

from ..export import _artifact
from ..pipeline._layers import FLOAT_WEIGHT_DTYPES
from ..quantizers._config import QuantConfig
from ..quantizers._fp8 import FP8Config
from ..quantizers._scheme import SchemeConfig, get_scheme
from ..quantizers._weight_only import WeightOnlyConfig
from . import _autotune, _export, _gguf, _markdown, _sequential
from . import _data as datasets, _inputs as inputs, _report as report, _torchrun as torchrun
from .._errors import QuantkitError
from ._weight_only import WeightOnlyRecipe, check_weight_algorithm
from ._fp8 import FP8Recipe
from ._quantize_lm import recipe_args
from ._registered import SchemeRecipe

__all__ = ["Recipe", "run_quantize", "REPORT_JSON", "REPORT_MD", "TOKENIZER_DIR"]

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
TOKENIZER_DIR = "tokenizer"


# --scheme NAME resolves through the scheme registry (quantkit.quantizers.get_scheme): a QuantConfig preset
# (w8a8, w8a8-dynamic, w8a8-per-token) sets the W8A8 fields below, a WeightOnlyConfig one (w4a16, w8a16, nf4)
# the weight-only recipe (cli/_weight_only.py), an FP8Config one (fp8, fp8-dynamic) the FP8 recipe
# (cli/_fp8.py); any other registered scheme runs as its config says (cli/_registered.py)


def _cli_recipe(config: SchemeConfig) -> bool:
    """Whether the command line's recipes express every field of the preset ``config``."""
    if isinstance(config, QuantConfig):
        return config == QuantConfig(activation=config.activation, act_observer=config.act_observer,
                                     weight_observer=config.weight_observer, dynamic=config.dynamic,
                                     granularity=config.granularity, ops=config.ops,
                                     weight_algorithm=config.weight_algorithm, weight_bits=config.weight_bits)
    if isinstance(config, WeightOnlyConfig):
        return not config.embeddings
    if isinstance(config, FP8Config):
        return config == FP8Config(dynamic=config.dynamic, granularity=config.granularity,
                                   act_observer=config.act_observer, ops=config.ops,
                                   weight_algorithm=config.weight_algorithm)
    return False


def observer_roles() -> dict[str, tuple[str, ...]]:
    """Registered observer name → the roles the CLI can use it in (``"activation"``, ``"weight"``).

    Read from what each observer declares in its default configuration: a dynamic observer
    (``is_dynamic``, e.g. ``placeholder``) records nothing and serves ``--dynamic`` only, so
    it fits neither flag; a per-channel one (``qscheme``) fits weights only, since
    activations are quantized per tensor.
    """
    from quantkit import observers
    from quantkit._qmath import is_per_channel

    roles = {}
    for name in observers.available():
        try:
            obs = observers.get(name)()
        except Exception:  # an observer that needs arguments cannot be named on a command line
            continue
        if getattr(obs, "is_dynamic", False):
            continue
        per_channel = is_per_channel(getattr(obs, "qscheme", None))
        roles[name] = ("weight",) if per_channel else ("activation", "weight")
    return roles


def _usable(role: str) -> list[str]:
    return [n for n, r in observer_roles().items() if role in r]


@dataclass(frozen=True)
class Recipe:
    """The quantization choices of one ``quantize`` run, as written to quantization.json.

    ``activation``, ``dynamic``, ``granularity``, ``ops``, ``observer`` and ``weight_observer``
    are the fields of :class:`quantkit.quantizers.QuantConfig`; ``scheme`` names the
    combination (a registered preset). ``weight_only``, ``fp8`` and ``registered`` hold the
    recipe of a weight-only, FP8 or other registered ``--scheme`` instead.
    """

    activation: str | None = None
    dynamic: bool = False
    granularity: str = "per-tensor"
    ops: tuple[str, ...] | None = None
    observer: str = "minmax"
    weight_observer: str = "per_channel_minmax"
    skip: tuple[str, ...] = ()
    smoothquant: float | str | None = None
    accuracy_budget: float | None = None
    metric: str = "cosine"
    weight_only: WeightOnlyRecipe | None = None  # --scheme w4a16 | w8a16 | nf4
    fp8: FP8Recipe | None = None  # --scheme fp8 | fp8-dynamic [--kv-cache]
    weight_algorithm: str = "rtn"  # --algorithm for the W8A8 schemes (QuantConfig.weight_algorithm)
    registered: SchemeRecipe | None = None  # another registered --scheme, run as its config says
    # what the --skip layers' float weights are stored in: "fp32", "bf16" (half the bytes) or "int8"
    # (per channel, a quarter: the auto fallback's float layers first try these; pipeline/_float_fallback);
    # with bf16 or int8 the layers also read their inputs unrounded
    float_weights: str = "fp32"
    weight_bits: int = 8  # --weight-bits (QuantConfig.weight_bits): 7 keeps oneDNN exact on AVX2

    @staticmethod
    def from_args(args) -> "Recipe":
        """Resolve ``--scheme`` through the registry against the explicit flags; conflicting
        combinations are usage errors."""
        dynamic, granularity = args.dynamic, args.granularity
        preset = get_scheme(args.scheme) if args.scheme is not None else None
        if preset is not None and not _cli_recipe(preset):
            return Recipe(skip=tuple(args.skip or ()), registered=SchemeRecipe.from_args(args, preset))
        fp8 = FP8Recipe.from_args(recipe_args(args, preset), preset)  # others' --kv-cache: _quantize_lm's
        if fp8 is not None:
            return Recipe(skip=tuple(args.skip or ()), smoothquant=args.smoothquant,
                          accuracy_budget=args.accuracy_budget, metric=args.metric, fp8=fp8)
        weight_only = WeightOnlyRecipe.from_args(args, preset)
        if weight_only is not None:
            return Recipe(observer=args.observer or "minmax", weight_observer=args.weight_observer,
                          skip=tuple(args.skip or ()), smoothquant=args.smoothquant,
                          accuracy_budget=args.accuracy_budget, metric=args.metric, weight_only=weight_only)
        observer, weight_observer, activation = args.observer, args.weight_observer, args.activation
        ops = None
        algorithm = getattr(args, "algorithm", None)
        weight_bits = getattr(args, "weight_bits", None)
        if preset is not None:  # a QuantConfig preset: its fields, unless a flag says otherwise
            if dynamic and not preset.dynamic:
                raise inputs.UsageError(f"--dynamic conflicts with --scheme {args.scheme} (static activations); "
                                        "drop one of them")
            if granularity is not None and granularity != preset.granularity.value:
                raise inputs.UsageError(f"--granularity {granularity} conflicts with --scheme {args.scheme} "
                                        f"({preset.granularity.value}); drop one of them")
            dynamic, granularity = preset.dynamic, preset.granularity.value
            default = QuantConfig(dynamic=preset.dynamic, granularity=preset.granularity)
            if activation is None and preset.activation != default.activation:
                activation = preset.activation.value
            if observer is None and not dynamic and preset.act_observer != default.act_observer:
                observer = preset.act_observer
            if weight_observer == default.weight_observer:
                weight_observer = preset.weight_observer
            if preset.ops != default.ops:
                ops = tuple(sorted(preset.ops))
            algorithm = algorithm or preset.weight_algorithm
            weight_bits = weight_bits or preset.weight_bits
        dynamic, granularity = bool(dynamic), granularity or "per-tensor"
        if granularity == "per-token" and not dynamic:
            raise inputs.UsageError("--granularity per-token needs --dynamic (per-token scales are chosen at run "
                                    "time); add --dynamic or use --scheme w8a8-per-token")
        if dynamic and args.observer is not None:
            raise inputs.UsageError("--observer has no effect with dynamic activations (ranges are chosen at run "
                                    "time); drop it")
        if args.ops is not None:
            ops = tuple(sorted({o.strip() for o in args.ops.split(",") if o.strip()}))
            if not ops:
                raise inputs.UsageError("--ops needs at least one op family, e.g. --ops linear")
        return Recipe(activation=activation, dynamic=dynamic, granularity=granularity, ops=ops,
                      observer=observer or "minmax", weight_observer=weight_observer,
                      skip=tuple(args.skip or ()), smoothquant=args.smoothquant,
                      accuracy_budget=args.accuracy_budget, metric=args.metric,
                      weight_algorithm=algorithm or "rtn", weight_bits=weight_bits or 8)

    def __post_init__(self) -> None:
        from quantkit.accuracy._metrics import resolve_metric
        from quantkit.accuracy._smoothquant import parse_alpha
        from quantkit.quantizers import QUANTIZABLE_OPS

        for flag, name, role in (("--observer", self.observer, "activation"),
                                 ("--weight-observer", self.weight_observer, "weight")):
            usable = _usable(role)
            if name.strip().lower().replace("-", "_") not in usable:
                from quantkit import observers

                known = name.strip().lower().replace("-", "_") in observers.available()
                why = f"observer {name!r} cannot measure {role}s" if known else f"unknown observer {name!r}"
                raise inputs.UsageError(f"{why} for {flag}; available: {', '.join(usable)}")
        if self.ops is not None:
            unknown = sorted(set(self.ops) - QUANTIZABLE_OPS)
            if unknown:
                raise inputs.UsageError(f"unknown op families {unknown} for --ops; choose from "
                                        f"{', '.join(sorted(QUANTIZABLE_OPS))} (comma-separated)")
        check_weight_algorithm(self.weight_algorithm, self.weight_only)
        if self.float_weights not in FLOAT_WEIGHT_DTYPES:
            raise inputs.UsageError(f"unknown float weight dtype {self.float_weights!r}; use fp32, bf16 or int8")
        try:
            self.config()
        except ValueError as exc:
            raise inputs.UsageError(_flag_wording(str(exc).splitlines()[0])) from None
        try:
            if self.smoothquant is not None:
                object.__setattr__(self, "smoothquant", parse_alpha(str(self.smoothquant)))
            if self.accuracy_budget is not None and not self.accuracy_budget >= 0:
                raise ValueError(f"--accuracy-budget must be a non-negative drop, got {self.accuracy_budget}")
            if self.accuracy_budget is not None:
                resolve_metric(self.metric)
        except (ValueError, TypeError) as exc:
            raise inputs.UsageError(str(exc).splitlines()[0]) from None

    @property
    def scheme(self) -> str | None:
        """The preset this recipe's activation settings amount to (for the W8A8 recipes: w8a8,
        w8a8-dynamic or w8a8-per-token, whichever flags gave them)."""
        if self.registered is not None:
            return self.registered.scheme
        if self.weight_only is not None:
            return self.weight_only.scheme
        if self.fp8 is not None:
            return self.fp8.scheme
        if not self.dynamic:
            return "w8a8"
        return "w8a8-per-token" if self.granularity == "per-token" else "w8a8-dynamic"

    def scheme_config(self) -> SchemeConfig:
        """The ``SchemeConfig`` this recipe quantizes with (quantization.json's ``config``)."""
        if self.registered is not None:
            return self.registered.config
        if self.weight_only is not None:
            return self.weight_only.config()
        if self.fp8 is not None:
            return self.fp8.config()
        return self.config()

    def to_json(self) -> dict:
        if self.registered is not None:
            return {**self.registered.to_json(), "skip": list(self.skip), "smoothquant": None,
                    "accuracy_budget": None, "metric": None}
        if self.fp8 is not None:
            return {**self.fp8.to_json(), "skip": list(self.skip), "smoothquant": self.smoothquant,
                    "accuracy_budget": self.accuracy_budget,
                    "metric": self.metric if self.accuracy_budget is not None else None}
        if self.weight_only is not None:
            return {**self.weight_only.to_json(), "skip": list(self.skip), "smoothquant": self.smoothquant,
                    "accuracy_budget": self.accuracy_budget,
                    "metric": self.metric if self.accuracy_budget is not None else None}
        cfg = self.config()
        return {"scheme": self.scheme, "activation": cfg.activation.value, "dynamic": cfg.dynamic,
                "granularity": cfg.granularity.value, "ops": sorted(cfg.ops),
                "observer": None if self.dynamic else self.observer,
                "weight_observer": self.weight_observer, "weight_algorithm": self.weight_algorithm,
                "skip": list(self.skip), "smoothquant": self.smoothquant, "accuracy_budget": self.accuracy_budget,
                "metric": self.metric if self.accuracy_budget is not None else None,
                # only when not the default: recipes recorded before the field stay as they were
                **({"float_weights": self.float_weights} if self.float_weights != "fp32" else {}),
                **({"weight_bits": self.weight_bits} if self.weight_bits != 8 else {})}

    def config(self) -> QuantConfig:
        """The W8A8 ``QuantConfig`` of this recipe."""
        kw = {} if self.ops is None else {"ops": frozenset(self.ops)}
        if self.weight_algorithm != "rtn":
            kw["weight_algorithm"] = self.weight_algorithm  # checked in __post_init__ (weight_algorithm_kwargs)
        return QuantConfig(activation=self.activation, act_observer=self.observer,
                           weight_observer=self.weight_observer, dynamic=self.dynamic,
                           granularity=self.granularity, weight_bits=self.weight_bits, **kw)

    def quantizer(self, module_names: list[str]):
        """W8A8 for the chosen op families plus weight-only int8 embeddings; ``skip`` patterns stay float."""
        from torchao.quantization.pt2e.quantizer import ComposableQuantizer

        from quantkit.quantizers import EmbeddingQuantizer, W8A8Quantizer

        if self.registered is not None:
            return self.registered.quantizer(self.skipped(module_names))
        if self.weight_only is not None:
            return self.weight_only.quantizer(self.skipped(module_names))
        if self.fp8 is not None:
            return self.fp8.quantizer(self.skipped(module_names))
        w8a8 = W8A8Quantizer(self.config())
        embeddings = EmbeddingQuantizer()
        for name in self.skipped(module_names):
            w8a8.set_module_name(name, None)
            embeddings.set_module_name(name, None)
        return ComposableQuantizer([embeddings, w8a8])

    def finish(self, qmodel, module_names: list[str]) -> dict[str, int]:
        """With ``float_weights="bf16"`` or ``"int8"``: store the float weights of the --skip layers of
        the converted ``qmodel`` in that dtype and let them read their inputs unrounded
        (``finish_float_layers``), in place; what ``Variants(float_weights=...)`` scored. ``{}`` otherwise."""
        if self.float_weights == "fp32" or not self.skip:
            return {}
        from quantkit.pipeline._float_fallback import finish_float_layers, float_gemms
        from quantkit.pipeline._layers import layer_of

        skipped = self.skipped(module_names)
        names = [n.name for n in float_gemms(qmodel)
                 if any(m == s or m.startswith(s + ".") for m in (layer_of(n).module,) for s in skipped)]
        return finish_float_layers(qmodel, names, self.float_weights) if names else {}

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


# QuantConfig's messages name its arguments; the CLI user knows the flags
_FLAG_WORDS = (("pass dynamic=True", "add --dynamic"), ("activation=", "--activation "),
               ("'symmetric-int8'", "--activation symmetric-int8"), ("granularity", "--granularity"))


def _flag_wording(message: str) -> str:
    for api, flag in _FLAG_WORDS:
        message = message.replace(api, flag)
    return message


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
    device = inputs.check_device(args.device)
    spec = inputs.ModelSpec.from_args(args.model, args.weights, args.example_input, args.task)
    data = datasets.DataSpec.from_arg(args.calib)
    for flag, v, lo in (("--num-calib", args.num_calib, 1), ("--seq-len", args.seq_len, 2), ("--batch-size", args.batch_size, 1)):
        if v is not None and v < lo:
            raise inputs.UsageError(f"{flag} must be at least {lo}, got {v}")
    out = Path(args.out)
    inputs.check_not_input(out, spec.input_paths() + [data.file] + ([data.file.parent] if data.kind == "default" else []))
    out = _export.check(args, spec, out, lambda o: _artifact.check_out_dir(  # --format decides what DIR may be
        o, overwrite=args.force, flag="--force", exists_error=inputs.UsageError))
    inputs.check_out_location(out)
    spec.check()
    if data.kind == "default" and not spec.is_hf:
        raise inputs.UsageError("a factory model needs --calib DIR (a directory of .pt/.npy/.safetensors tensors)")
    return spec, data, out, device


def _check_captured(recipe: Recipe, gm, module_names: list[str]) -> None:
    """What the captured graph tells before calibration: a --kv-cache with no attention to put it on."""
    if recipe.fp8 is not None:
        recipe.fp8.check_kv_cache(gm, recipe.skipped(module_names))


def run_quantize(args, say) -> int:
    recipe = Recipe.from_args(args)
    autos = _autotune.requested(args)  # None: a hand-written recipe
    spec, data, out, device = _check(args, recipe)
    if _sequential.wanted(args, spec):  # --max-memory the model does not fit, --sequential, --resume
        _export.refuse_sequential(args)
        return _sequential.run_sequential(args, recipe, spec, data, out, say)
    device = torchrun.rank_device(device)
    progress = not args.quiet
    clock = _Clock()

    # data before the model: a bad text file fails in a second
    example_ndims = None
    if spec.kind == "factory":
        example_ndims = [len(s) for s, _ in inputs.parse_example_input(spec.example_input)]
    samples, origins = datasets.read_samples(data, example_ndims=example_ndims)
    split = datasets.split_samples(len(samples), num_calib=args.num_calib)
    split, skipped = datasets.nonfinite_split(samples, origins, split, args.skip_nonfinite, "calibration")
    t = clock.start
    loaded = inputs.load_model(spec, progress=progress, allow_mismatch=args.allow_missing_weights)
    if loaded.fit is not None and not loaded.fit.clean:  # printed even with --quiet: the numbers depend on it
        print(f"warning: --allow-missing-weights: the checkpoint does not fit {loaded.fit.architecture}: "
            f"{loaded.fit.summary()}; those tensors are randomly initialised")
    loaded.model.to(device)
    module_names = [n for n, _ in loaded.model.named_modules()]
    recipe = _export.lm_head_float(args, recipe, module_names)  # compressed-tensors: lm_head float unless asked
    quantizer = recipe.quantizer(module_names)
    kw = dict(seq_len=args.seq_len, batch_size=args.batch_size, device=device)
    calib, _ = datasets.device_batches(samples, origins, split.calib, loaded, what="calibration", **kw)
    heldout, heldout_origins = datasets.device_batches(samples, origins, split.heldout, loaded, what="held-out", **kw)
    t = clock.lap("load", t)

    import quantkit

    if getattr(args, "max_cache_len", None) is not None:  # a generating artifact: capture with a static KV cache
        from . import _quantize_lm

        return _quantize_lm.run_quantize_lm(args, recipe, spec, data, out, loaded, calib, heldout, module_names,
                                            samples=len(samples), heldout_indices=split.heldout,
                                            tokenizer_dir=TOKENIZER_DIR, say=say)
    # torch.export prints the partial graph to stderr when it fails; CaptureError says why in one line
    with contextlib.redirect_stderr(io.StringIO()):
        if spec.is_hf:
            from .. import _hf

            gm = quantkit.capture(loaded.model, calib[0], dynamic_shapes=_hf.dynamic_shapes(calib[0]))
        else:
            gm = quantkit.capture(loaded.model, tuple(x.to(device) for x in loaded.example))
    t = clock.lap("capture", t)
    _check_captured(recipe, gm, module_names)
    tuned = donor = smoothed = None
    if autos is not None:  # --recipe auto|NAME: choose the recipe, then build it below as if flagged
        recipe, tuned, donor, smoothed = _autotune.choose(args, recipe, loaded, gm, calib, heldout,
                                                          heldout_origins, module_names, progress, autos)
        quantizer = recipe.quantizer(module_names)
        _check_captured(recipe, gm, module_names)
        t = clock.lap("autotune", t)
    if recipe.smoothquant is not None:
        # the search's SmoothQuant graph of the chosen recipe where it made one (the same call)
        gm = smoothed if smoothed is not None else \
            quantkit.smooth_quant(gm, calib, alpha=recipe.smoothquant, config=recipe.config(),
                                  fold_only=_export.folds_only(args))
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
        # the search's calibration of these batches, copied where every observer matches (one process)
        if donor is None or not donor.calibrate_like(prepared):
            torchrun.calibrate(prepared, calib, progress=progress)  # under torchrun: this rank's shard, then synced
        t = clock.lap("calibrate", t)
        qmodel = quantkit.convert(prepared)
        recipe.finish(qmodel, module_names)  # the fallback's float layers: bf16 weights
        t = clock.lap("convert", t)
    if not torchrun.is_main():  # under torchrun, rank 0 alone evaluates, writes and prints
        return 0
    if not qmodel.meta.get("quantkit_qparams"):
        raise QuantkitError(f"nothing is quantized: the model has no {'/'.join(recipe.config().ops)} op outside "
                            "the --skip patterns (and no embedding); check --ops and --skip")

    kind, scores = report.compare_models(loaded.model, {"int8": qmodel}, heldout, origins=heldout_origins,
                                         progress=progress, desc="held-out")
    metric = scores["int8"]
    records = qmodel.meta.get("quantkit_qparams", [])
    layers = report.layer_sqnr(loaded.model, qmodel, heldout[0], records)
    t = clock.lap("evaluate", t)
    ct_export = None
    if _export.parse_formats(args.format) == (_export.CT,):  # DIR is the HF checkpoint alone
        ct_export = _export.write(out, qmodel=qmodel, spec=spec, loaded=loaded, batches=heldout,
                                      skip_unsupported=args.skip_unsupported, atomic=True, args=args,
                                      record=report.json_safe({"recipe": recipe.to_json(), "metric": metric}))
        say(f"wrote {out}: {metric['name']} mean {metric['mean_cosine']:.4f} (min {metric['min_cosine']:.4f}) vs float; "
            f"{_export.describe(ct_export)}")
        if tuned is not None:
            say("  " + _autotune.summary_line(tuned))
        return _autotune.exit_code(args, tuned)

    if _export.parse_formats(args.format) == (_export.GGUF,):  # OUT is the .gguf file alone
        gguf_export = _gguf.write(out, qmodel=qmodel, model_dir=_export._model_dir(spec), args=args)
        say(f"wrote {out}: {metric['name']} mean {metric['mean_cosine']:.4f} (min {metric['min_cosine']:.4f}) vs float; "
            f"{_gguf.describe(gguf_export)}")
        return _autotune.exit_code(args, tuned)
    gguf_export = None

    with contextlib.redirect_stderr(io.StringIO()):
        program = _artifact.export_converted(qmodel)
        if device.type != "cpu":  # artifacts are CPU programs: they load anywhere (eval --device moves them)
            from torch.export.passes import move_to_device_pass

            program = move_to_device_pass(program, "cpu")
    source = {"model": spec.to_json(), "data": data.to_json(), "fingerprint": datasets.fingerprint(data),
              "samples": len(samples), "heldout": split.heldout, "seq_len": args.seq_len,
              "batch_size": args.batch_size, "output": kind,
              "allow_missing_weights": bool(args.allow_missing_weights)}
    doc = _artifact.recipe_document(qmodel, recipe=recipe.to_json(), source=source, config=recipe.scheme_config())
    if tuned is not None and tuned.get("trials"):
        # how the recipe was chosen: every candidate's (score, latency, size), the Pareto front, the tie margin
        doc["search"] = {"metric": tuned["metric"], "target": tuned["target"], "chosen": tuned["chosen"],
                         "reason": tuned["reason"], "verdict": tuned.get("verdict"),
                         "noise": (tuned.get("speed") or {}).get("noise"),
                         "latency_sources": tuned.get("latency_sources", {}),
                         "candidates": [{k: t.get(k) for k in ("recipe", "status", "score", "latency_ms",
                                                               "size_bytes", "pareto")} for t in tuned["trials"]]}
    with _artifact.atomic_dir(out, overwrite=args.force, flag="--force") as tmp:
        model_file = _artifact.write_program(program, tmp)
        # sealed as written: atomic_dir's seal then finds the digest in place and rewrites nothing
        doc["model_sha256"] = _artifact.file_sha256(model_file)
        _artifact.write_json(tmp / _artifact.RECIPE_FILE, report.json_safe(doc))
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
        if _export.CT in _export.parse_formats(args.format):  # the HF checkpoint beside model.pt2
            ct_export = _export.write(tmp / _export.SUBDIR, qmodel=qmodel, spec=spec, loaded=loaded,
                                          batches=heldout, skip_unsupported=args.skip_unsupported, atomic=False,
                                          args=args)
        if _export.GGUF in _export.parse_formats(args.format):  # the GGUF file beside model.pt2
            gguf_export = _gguf.write(tmp / _gguf.FILE, qmodel=qmodel, model_dir=_export._model_dir(spec), args=args)
        t = clock.lap("save", t)
        clock.times["total"] = round(time.perf_counter() - clock.start, 2)
        int8_bytes = model_file.stat().st_size
        rep = {
            "model": _describe(spec, loaded),
            "recipe": recipe.to_json(),
            "data": {"source": data.to_json(), "calibration_samples": len(split.calib),
                     "heldout_samples": len(split.heldout),
                     "heldout_is_calibration": split.heldout == split.calib,
                     "nonfinite_skipped": len(skipped), "nonfinite_examples": skipped[:5]},
            "metric": metric,
            "size": {"float_bytes": loaded.weight_bytes, "int8_bytes": int8_bytes,
                     "ratio": round(int8_bytes / max(loaded.weight_bytes, 1), 4)},
            "device": str(device),
            "time_s": clock.times,
            "layers": layers,
            "versions": doc["versions"],
        }
        if loaded.fit is not None and not loaded.fit.clean:
            rep["weights_not_loaded"] = loaded.fit.to_json()
        if tuned is not None:
            rep["autotune"] = tuned
        if fallback is not None:
            rep["fallback"] = {"kept_float": [layer.label for layer in fallback.float_layers],
                               "drop": fallback.drop, "budget": fallback.budget, "met": fallback.met,
                               "int8_gemm_fraction": fallback.int8_gemm_fraction}
        if ct_export is not None:
            rep["compressed_tensors"] = _export.summary(ct_export)
        if gguf_export is not None:
            rep["gguf"] = _gguf.summary(gguf_export)
        if any(str(r.get("dtype")) in ("int4", "uint4") for r in records):
            # whether quantkit's CPU int4 kernel runs these weights here, and why not (checked, not built)
            from ..kernels import int4_cpu_status  # not at import: quantkit.kernels decorates Triton kernels

            rep["kernels"] = {"int4_cpu": int4_cpu_status(build=False).to_dict()}
        _artifact.write_json(tmp / REPORT_JSON, report.json_safe(rep))
        (tmp / REPORT_MD).write_text(_markdown.render_report(rep), encoding="utf-8")
    extra = f", top-1 agreement {metric['top1_agreement']:.4f}" if "top1_agreement" in metric else ""
    note = f"; {len(skipped)} non-finite samples left out" if skipped else ""
    say(f"wrote {out}: {metric['name']} mean {metric['mean_cosine']:.4f} (min {metric['min_cosine']:.4f}){extra} "
        f"on {metric['samples']} held-out samples, size {rep['size']['ratio']:.3f}x fp32, "
        f"{clock.times['total']:.0f} s{note}")
    if ct_export is not None:
        say(f"  {out / _export.SUBDIR}: {_export.describe(ct_export)}")
    if gguf_export is not None:
        say(f"  {out / _gguf.FILE}: {_gguf.describe(gguf_export)}")
    if tuned is not None:
        say("  " + _autotune.summary_line(tuned))
    return _autotune.exit_code(args, tuned)


def _describe(spec: inputs.ModelSpec, loaded: inputs.LoadedModel) -> str:
    if spec.kind == "default":
        return "all-MiniLM-L6-v2 (bundled default)"
    if spec.kind == "factory":
        return spec.factory
    return f"{spec.path} ({type(loaded.model).__name__})"
