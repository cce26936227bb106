"""``quantkit quantize --scheme w4a16 | w8a16 | nf4``: the weight-only recipes of the command line."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from .._errors import QuantkitError
from ..quantizers._weight_only import AWQ_SCALED, GPTQ_ROUNDED, WeightOnlyConfig
from . import _inputs as inputs
from ._export import folds_only
from ._registered import presets_of

__all__ = ["WeightOnlyRecipe", "check_weight_algorithm", "describe_weight_only"]


@dataclass(frozen=True)
class WeightOnlyRecipe:
    """The weight-only choices of one ``quantize`` run: a registered ``WeightOnlyConfig`` preset
    (``w4a16``, ``w8a16``, ``nf4``: ``quantkit.quantizers.get_scheme``) refined by ``--group-size``
    and ``--algorithm`` (see ``quantizers.WeightOnlyQuantizer``)."""

    scheme: str
    group_size: int | None
    algorithm: str = "rtn"
    weights: str = "int4"  # WeightOnlyConfig.scheme: int4, int8 or nf4
    symmetric: bool = False
    double_quant: bool = False  # --double-quant (nf4 only)
    clip_search: bool = False  # --clip-search / --no-clip-search (gptq, awq+gptq: default on)
    awq_fold_only: bool = False  # AWQ for --format gguf / compressed-tensors: no inserted muls

    @staticmethod
    def from_args(args, config=None) -> "WeightOnlyRecipe | None":
        """The weight-only recipe of ``--scheme`` (its registered ``config``), or None; flags that only
        mean something for the W8A8 recipes (or only for weight-only ones) are usage errors."""
        scheme, group_size = args.scheme, getattr(args, "group_size", None)
        double_quant = bool(getattr(args, "double_quant", None))
        clip_search = getattr(args, "clip_search", None)  # None: the default for the algorithm
        if not isinstance(config, WeightOnlyConfig):
            if clip_search is not None:
                raise inputs.UsageError(f"--{'' if clip_search else 'no-'}clip-search sets the group range search of "
                                        f"weight-only GPTQ; add --scheme {presets_of(WeightOnlyConfig)} --algorithm "
                                        "gptq, or drop it")
            if group_size is not None:
                raise inputs.UsageError(f"--group-size applies to the weight-only schemes; add --scheme "
                                        f"{presets_of(WeightOnlyConfig)}, or drop it")
            if double_quant:
                raise inputs.UsageError("--double-quant quantizes NF4's scales; add --scheme nf4, or drop it")
            return None
        if double_quant and config.scheme != "nf4":
            raise inputs.UsageError(f"--double-quant quantizes NF4's scales; --scheme {scheme} has none: use "
                                    "--scheme nf4, or drop it")
        activation_flags = (("--weight-bits", getattr(args, "weight_bits", None)),
                            ("--dynamic", args.dynamic), ("--granularity", args.granularity),
                            ("--activation", args.activation), ("--ops", args.ops), ("--observer", args.observer),
                            ("--smoothquant", args.smoothquant), ("--accuracy-budget", args.accuracy_budget))
        for flag, value in activation_flags:
            if value is not None and value is not False:
                raise inputs.UsageError(f"{flag} has no effect with --scheme {scheme} (weight-only: activations "
                                        "stay float; the scheme sets the weight width); drop it")
        if args.weight_observer != "per_channel_minmax":
            raise inputs.UsageError(f"--weight-observer has no effect with --scheme {scheme} (group-wise min/max, "
                                    "or absmax for nf4); drop it")
        if group_size is not None and group_size < 2:
            raise inputs.UsageError(f"--group-size must be at least 2, got {group_size}")
        algorithm = getattr(args, "algorithm", None) or config.algorithm
        if clip_search is None:
            clip_search = algorithm in GPTQ_ROUNDED
        if clip_search and algorithm not in GPTQ_ROUNDED:
            raise inputs.UsageError(f"--clip-search searches the group ranges GPTQ rounds to; --algorithm {algorithm} "
                                    "has none: add --algorithm gptq or awq+gptq, or drop it")
        # GGUF and compressed-tensors hold no tensor for an input scale that folds nowhere
        fold_only = algorithm in AWQ_SCALED and folds_only(args)
        return WeightOnlyRecipe(scheme, group_size if group_size is not None else config.group_size,
                                algorithm, config.scheme, config.symmetric,
                                double_quant or config.double_quant, clip_search,
                                fold_only or config.awq_fold_only)

    def config(self) -> WeightOnlyConfig:
        """This recipe's ``WeightOnlyConfig`` (what quantization.json's ``config`` records)."""
        return WeightOnlyConfig(**self.kwargs())

    def kwargs(self) -> dict:
        """``WeightOnlyQuantizer`` arguments."""
        kw = dict(bits=8 if self.weights == "int8" else 4, group_size=self.group_size, scheme=self.weights,
                  symmetric=self.symmetric, algorithm=self.algorithm)
        return {**kw, **({"double_quant": True} if self.double_quant else {}),
                **({"clip_search": self.clip_search} if self.algorithm in GPTQ_ROUNDED else {}),
                **({"awq_fold_only": True} if self.awq_fold_only else {})}

    def quantizer(self, skipped: list[str]):
        """Weight-only linears plus int8 embeddings (as the W8A8 recipes); ``skipped`` modules stay float."""
        from torchao.quantization.pt2e.quantizer import ComposableQuantizer

        from quantkit.quantizers import EmbeddingQuantizer, WeightOnlyQuantizer

        weights = WeightOnlyQuantizer(**self.kwargs())
        embeddings = EmbeddingQuantizer()
        for name in skipped:
            weights.set_module_name(name, None)
            embeddings.set_module_name(name, None)
        return _worded(ComposableQuantizer)([embeddings, weights])

    def to_json(self) -> dict:
        kw = self.kwargs()
        return {"scheme": self.scheme, "weight_only": True, "bits": kw["bits"], "weights": kw["scheme"],
                "group_size": self.group_size, "symmetric": kw["symmetric"], "algorithm": self.algorithm,
                "activation": None, "ops": ["linear"], "embeddings": "int8 per row",
                **({"double_quant": True} if self.double_quant else {}),
                **({"clip_search": self.clip_search} if self.algorithm in GPTQ_ROUNDED else {}),
                **({"awq_fold_only": True} if self.awq_fold_only else {})}


def _group_size_message(exc) -> str:
    """A ``GroupSizeError`` (a layer narrower than one group) in the command line's words
    (``--group-size``, ``--skip``), suggesting the largest power-of-two group size below it that
    divides every layer's input features (no remainder group: every export holds it)."""
    from quantkit.quantizers._weight_only import module_of

    weight, k = exc.layers[0]
    group_size = exc.group_size
    n = len(exc.layers) - 1
    more = f" (nor do {n} more layer{'s' if n > 1 else ''})" if n else ""
    fits = next((g for g in (128, 64, 32, 16, 8, 4, 2) if g < group_size and all(f % g == 0 for f in exc.in_features)),
                None)
    choose = f"pass --group-size {fits}" if fits else "pass a --group-size that divides it"
    if getattr(exc, "algorithm", None) is not None:  # GPTQ / AWQ need whole groups
        return (f"layer {module_of(weight)!r} has {k} input features, not a multiple of --group-size {group_size}"
                f"{more}, and --algorithm {exc.algorithm} rounds whole groups; {choose}, --algorithm rtn (a last "
                f"group of the remainder), or keep the layer float with --skip {module_of(weight)}")
    return (f"layer {module_of(weight)!r} has {k} input features, fewer than --group-size {group_size}{more}; "
            f"{choose}, or keep the layer float with --skip {module_of(weight)}")


@functools.cache
def _worded(cls):
    """``cls`` (a quantizer class) whose ``annotate`` words :class:`GroupSizeError` with the
    command line's flags instead of the API's (``set_module_name``, ``group_size=``)."""
    from quantkit.quantizers import GroupSizeError

    class _CommandLine(cls):
        def annotate(self, model):
            try:
                return super().annotate(model)
            except GroupSizeError as exc:
                raise QuantkitError(_group_size_message(exc)) from None

    _CommandLine.__name__ = _CommandLine.__qualname__ = cls.__name__
    return _CommandLine


def check_weight_algorithm(algorithm: str, weight_only: WeightOnlyRecipe | None) -> None:
    """``--algorithm`` with a W8A8 scheme needs ``QuantConfig(weight_algorithm=...)``."""
    if weight_only is not None or algorithm == "rtn":
        return
    from quantkit.quantizers import QuantConfig

    if "weight_algorithm" not in {f.name for f in dataclasses.fields(QuantConfig)}:
        raise inputs.UsageError(f"--algorithm {algorithm} needs a weight-only scheme here; add --scheme "
                                f"{presets_of(WeightOnlyConfig)}")


def describe_weight_only(r: dict) -> str:
    """One sentence naming a weight-only recipe (report.md, inspect)."""
    group = f"groups of {r.get('group_size')}" if r.get("group_size") else "per channel"
    kind = "symmetric" if r.get("symmetric") else "asymmetric"
    weights = "NF4" if r.get("weights") == "nf4" else f"{r.get('bits')}-bit {kind}"
    if r.get("double_quant"):
        weights += " (double-quantized scales)"
    rounding = f"{r.get('algorithm')} rounding" + (", ranges searched by output error" if r.get("clip_search") else "")
    if r.get("awq_fold_only"):
        rounding += ", AWQ scales only where they fold into the op before (the export has no input-scale tensor)"
    return (f"scheme `{r.get('scheme')}`: {weights} weights ({group}, {rounding}), "
            "float activations, ops linear, int8 embeddings")
