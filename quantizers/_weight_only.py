"""WeightOnlyQuantizer: int4 / int8 group-wise or NF4 weights, float activations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec, Quantizer

from quantkit._errors import QuantkitError
from quantkit.observers import GroupwiseWeightObserver
from quantkit._graph import ANNOTATION_KEY, scoped_config, type_name

from ._scheme import SchemeConfig, register_scheme
from ._w8a8 import _has_elements

__all__ = ["WeightOnlyQuantizer", "WeightOnlyConfig", "GroupSizeError", "WEIGHT_ONLY_SCHEMES",
           "WEIGHT_ONLY_ALGORITHMS", "module_of"]

_LINEAR = {torch.ops.aten.linear.default}
_EMBEDDING = {torch.ops.aten.embedding.default}

WEIGHT_ONLY_SCHEMES = {"int4": 4, "nf4": 4, "int8": 8}  # scheme -> bits
WEIGHT_ONLY_ALGORITHMS = ("rtn", "gptq", "awq", "awq+gptq")  # awq+gptq: AWQ scales, GPTQ rounding
GPTQ_ROUNDED = ("gptq", "awq+gptq")  # the algorithms whose rounding clip_search refines
AWQ_SCALED = ("awq", "awq+gptq")  # the algorithms that scale inputs (awq_fold_only)


@dataclass(frozen=True)
class WeightOnlyConfig(SchemeConfig):
    """Weight-only settings of one part of the model (see :class:`WeightOnlyQuantizer`, whose
    arguments these fields are; ``quantizer()`` builds it). Presets ``w4a16``, ``w8a16`` and ``nf4``
    are registered below."""

    VERSION = 1

    bits: int = 4
    group_size: Optional[int] = 128
    scheme: Optional[str] = None
    symmetric: bool = False
    algorithm: str = "rtn"
    embeddings: bool = False
    double_quant: bool = False
    clip_search: Optional[bool] = None
    awq_fold_only: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or isinstance(self.bits, bool):
            raise ValueError(f"bits must be 4 or 8, got {self.bits!r}")
        scheme = self.scheme if self.scheme is not None else {4: "int4", 8: "int8"}[self.bits]
        if scheme not in WEIGHT_ONLY_SCHEMES:
            raise ValueError(f"unknown weight-only scheme {self.scheme!r}; use one of {list(WEIGHT_ONLY_SCHEMES)}")
        if WEIGHT_ONLY_SCHEMES[scheme] != self.bits:
            raise ValueError(f"scheme {scheme!r} is {WEIGHT_ONLY_SCHEMES[scheme]}-bit, got bits={self.bits}; "
                             "drop one of them")
        object.__setattr__(self, "scheme", scheme)
        gs = self.group_size
        if gs is not None and (isinstance(gs, bool) or not isinstance(gs, int) or gs < 2):
            raise ValueError(f"group_size must be an int >= 2 (or None for one group per output row), got {gs!r}")
        if self.algorithm not in WEIGHT_ONLY_ALGORITHMS:
            raise ValueError(f"unknown weight algorithm {self.algorithm!r}; use one of {list(WEIGHT_ONLY_ALGORITHMS)}")
        if not isinstance(self.symmetric, bool) or not isinstance(self.embeddings, bool):
            raise ValueError("symmetric and embeddings must be True or False")
        if not isinstance(self.double_quant, bool):
            raise ValueError(f"double_quant must be True or False, got {self.double_quant!r}")
        if self.double_quant and scheme != "nf4":
            raise ValueError(f"double_quant quantizes NF4's absmax scales; scheme {scheme!r} has none: "
                             "use scheme='nf4' or drop double_quant")
        if self.clip_search is None:  # measured on SmolLM2-135M: GPTQ int4 g64 +14.5% -> +7.5% ppl (BENCHMARKS)
            object.__setattr__(self, "clip_search", self.algorithm in GPTQ_ROUNDED)
        if not isinstance(self.clip_search, bool):
            raise ValueError(f"clip_search must be True, False or None (on for GPTQ), got {self.clip_search!r}")
        if self.clip_search and self.algorithm not in GPTQ_ROUNDED:
            raise ValueError(f"clip_search chooses the group ranges GPTQ rounds to; algorithm={self.algorithm!r} "
                             "has none: use algorithm='gptq' or 'awq+gptq', or drop clip_search")
        if not isinstance(self.awq_fold_only, bool):
            raise ValueError(f"awq_fold_only must be True or False, got {self.awq_fold_only!r}")
        if self.awq_fold_only and self.algorithm not in AWQ_SCALED:
            raise ValueError(f"awq_fold_only limits where AWQ scales inputs; algorithm={self.algorithm!r} scales "
                             "none: use algorithm='awq' or 'awq+gptq', or drop awq_fold_only")

    def quantizer(self) -> "WeightOnlyQuantizer":
        """``WeightOnlyQuantizer`` with these settings for the whole model."""
        return WeightOnlyQuantizer(self.bits, self.group_size, self.scheme, self.symmetric, self.algorithm,
                                   embeddings=self.embeddings, double_quant=self.double_quant,
                                   clip_search=self.clip_search, awq_fold_only=self.awq_fold_only)


class GroupSizeError(QuantkitError):
    """Layers with fewer input features than one group of the group size.

    A group size that does not divide a layer's input features is not an error: the last group
    holds the remainder (576 = 4 x 128 + 64). A group size larger than the whole row is (pass
    ``group_size=None`` for one group per row). Exports whose format cannot hold a remainder
    group (compressed-tensors, GGUF) refuse it themselves, naming the group sizes that divide.

    Attributes:
        layers: ``(weight name, input features)`` of every such layer, in graph order
            (``"fc.weight"``: the layer is the module ``"fc"``).
        group_size: the group size they are narrower than (or, with ``algorithm``, do not divide).
        in_features: the input features of every layer annotated with that group size, the
            fitting ones too (a group size that divides them all fits the whole model).
        algorithm: None, or the rounding algorithm (``"gptq"``, ``"awq"``, ...) that needs whole
            groups: then ``layers`` are those the group size does not divide (GPTQ and AWQ round
            and search whole groups; round to nearest takes a remainder group).
    """

    def __init__(self, layers: tuple[tuple[str, int], ...], group_size: int,
                 in_features: tuple[int, ...] = (), algorithm: Optional[str] = None) -> None:
        self.layers, self.group_size, self.algorithm = tuple(layers), group_size, algorithm
        self.in_features = tuple(sorted(set(in_features) | {k for _, k in self.layers}))
        weight, k = self.layers[0]
        n = len(self.layers) - 1
        more = f" (nor do {n} more layer{'s' if n > 1 else ''})" if n else ""
        if algorithm is not None:
            super().__init__(f"layer '{weight}' has {k} input features, not a multiple of group_size={group_size}"
                             f"{more}, and algorithm={algorithm!r} rounds whole groups; choose a group size that "
                             f"divides it, algorithm='rtn' (a last group of the remainder), or keep the layer float "
                             f"with set_module_name('{module_of(weight)}', None)")
            return
        super().__init__(f"layer '{weight}' has {k} input features, fewer than group_size={group_size}{more}; "
                         f"choose a group size of at most {min(k for _, k in self.layers)} (or None: one group "
                         f"per row) or keep the layer float with set_module_name('{module_of(weight)}', None)")


class WeightOnlyQuantizer(Quantizer):
    """Low-bit weights, float activations: int4/int8 group-wise affine or symmetric, or NF4.

    Annotates the weight of every ``linear`` (and, with ``embeddings=True``, every embedding
    table) with a group-wise weight observer (``quantkit.observers.GroupwiseWeightObserver``);
    activations stay float. ``quantkit.convert`` then stores the weights as integers (int4 packed
    two per byte) behind ``quantized_decomposed.dequantize_per_channel_group`` (NF4: 4-bit codes,
    the NF4 table and per-group absmax scales behind ``quantkit.dequantize_nf4``), and
    ``quantkit.compile`` runs int4/int8 linears as CPU weight-only kernels.

    Args:
        bits: 4 or 8.
        group_size: input features sharing one scale; where it does not divide a layer's input
            features the last group holds the remainder (576 = 4 x 128 + 64); it must not exceed
            them (:class:`GroupSizeError`). None: one group per output row (per channel).
        scheme: ``"int4"``, ``"nf4"`` (4-bit) or ``"int8"``; default: ``"int4"`` for 4 bits,
            ``"int8"`` for 8.
        symmetric: symmetric integer qparams (zero point 0) instead of affine (NF4 is absmax).
        algorithm: rounding: ``"rtn"`` (round to nearest), ``"gptq"`` or ``"awq"`` (recorded on the
            observers as ``weight_algorithm`` for the rounding passes; round to nearest without them).
        embeddings: also quantize embedding tables (groups along the embedding dimension).
        double_quant: NF4 only: QLoRA's double quantization, the absmax scales stored as 8-bit
            floats in blocks of 256 with one fp32 scale per block (4.127 instead of 4.5 bits per
            weight at groups of 64).
        clip_search: with ``algorithm="gptq"`` or ``"awq+gptq"``: each group's range is searched
            (shrinks of its min/max, 1 down to 0.5) for the least error of the layer's *output* under
            the calibration Hessian, instead of the group's min/max (``GPTQConfig.clip_search``;
            declared on the observers as ``gptq_clip_search``). None (default): on for those two
            algorithms (on SmolLM2-135M int4 g64 it took GPTQ from +14.5% to +7.5% perplexity over
            float, asymmetric, and +24.9% to +12.8% symmetric, for 98.8 instead of 90.3 s); False: the
            groups' min/max, as the GPTQ paper.
        awq_fold_only: with ``algorithm="awq"`` or ``"awq+gptq"``: scale only the linears whose
            ``1/s`` folds into the op before them (a norm, a linear's rows, a gated MLP's ``up``);
            the others (grouped-query attention's ``o_proj``) keep their inputs unscaled instead of
            reading them through an inserted ``mul`` (AutoAWQ's and llm-compressor's behaviour).
            GGUF and compressed-tensors have no tensor for such a ``mul``: the CLI sets this for
            ``--format gguf`` and ``compressed-tensors``. Declared on the observers as ``awq_fold_only``.

    Example:
        >>> q = WeightOnlyQuantizer(bits=4, group_size=128).set_module_name("lm_head", None)
        >>> q = WeightOnlyQuantizer(scheme="nf4", group_size=64, double_quant=True)
    """

    def __init__(self, bits: int = 4, group_size: Optional[int] = 128, scheme: Optional[str] = None,
                 symmetric: bool = False, algorithm: str = "rtn", *, embeddings: bool = False,
                 double_quant: bool = False, clip_search: Optional[bool] = None,
                 awq_fold_only: bool = False) -> None:
        super().__init__()
        self.global_config: Optional[WeightOnlyConfig] = WeightOnlyConfig(
            bits=bits, group_size=group_size, scheme=scheme, symmetric=symmetric, algorithm=algorithm,
            embeddings=embeddings, double_quant=double_quant, clip_search=clip_search, awq_fold_only=awq_fold_only)
        self.module_type_config: dict[str, Optional[WeightOnlyConfig]] = {}
        self.module_name_config: dict[str, Optional[WeightOnlyConfig]] = {}

    # --- configuration ------------------------------------------------------------------
    @staticmethod
    def _check(config) -> Optional[WeightOnlyConfig]:
        if isinstance(config, WeightOnlyQuantizer):
            return config.global_config
        if config is not None and not isinstance(config, WeightOnlyConfig):
            raise TypeError(f"expected a WeightOnlyConfig, a WeightOnlyQuantizer or None, got {type(config).__name__}")
        return config

    def set_global(self, config: Union[WeightOnlyConfig, "WeightOnlyQuantizer", None]) -> "WeightOnlyQuantizer":
        """Settings for everything not matched by a module name or type; None keeps it float."""
        self.global_config = self._check(config)
        return self

    def set_module_type(self, module_type: type, config) -> "WeightOnlyQuantizer":
        """Settings for weights inside modules of ``module_type`` (a WeightOnlyConfig, another
        WeightOnlyQuantizer's, or None to keep them float)."""
        if not isinstance(module_type, type):
            raise TypeError(f"module_type must be a class such as torch.nn.Linear, got {module_type!r}")
        self.module_type_config[type_name(module_type)] = self._check(config)
        return self

    def set_module_name(self, module_name: str, config) -> "WeightOnlyQuantizer":
        """Settings for weights inside the submodule ``module_name`` (and its children); None keeps them float."""
        if not isinstance(module_name, str):
            raise TypeError(f"module_name must be a string, got {type(module_name).__name__}")
        self.module_name_config[module_name] = self._check(config)
        return self

    def config_for(self, node: Node) -> Optional[WeightOnlyConfig]:
        """The settings that apply to ``node``: module name, then module type, then global."""
        return scoped_config(node, self.module_name_config, self.module_type_config, self.global_config)

    # --- specs ------------------------------------------------------------------------
    @staticmethod
    def weight_spec(config: WeightOnlyConfig, in_features: int) -> QuantizationSpec:
        """The spec of one ``[N, K]`` weight (``in_features`` = K resolves ``group_size=None``)."""
        group_size = config.group_size or in_features
        ctor = GroupwiseWeightObserver.with_args(
            group_size=group_size, scheme=config.scheme, symmetric=config.symmetric,
            weight_algorithm=config.algorithm, double_quant=config.double_quant,
            **({"gptq_clip_search": True} if config.clip_search else {}),
            **({"awq_fold_only": True} if config.awq_fold_only else {}))
        obs = ctor()
        return QuantizationSpec(
            dtype=obs.dtype, quant_min=obs.quant_min, quant_max=obs.quant_max, qscheme=obs.qscheme,
            ch_axis=0, is_dynamic=False, observer_or_fake_quant_ctr=ctor,
        )

    # --- annotation -------------------------------------------------------------------
    def annotate(self, model: GraphModule) -> GraphModule:
        """Annotate every weight the config covers; raises :class:`GroupSizeError` naming every
        layer with fewer input features than the group size (one that does not divide them leaves
        a last group of the remainder)."""
        misfits: dict[int, list[tuple[str, int]]] = {}
        unrounded: dict[tuple[int, str], list[tuple[str, int]]] = {}  # (group size, algorithm) -> layers
        widths: dict[int, set[int]] = {}  # group size -> input features of the layers it applies to
        for node in model.graph.nodes:
            if node.op != "call_function" or ANNOTATION_KEY in node.meta:
                continue
            if node.target in _LINEAR:
                weight = node.args[1]
            elif node.target in _EMBEDDING:
                weight = node.args[0]
            else:
                continue
            config = self.config_for(node)
            if config is None or (node.target in _EMBEDDING and not config.embeddings):
                continue
            if not isinstance(weight, Node) or weight.op != "get_attr":
                continue
            val = weight.meta.get("val")
            if not (isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() == 2
                    and _has_elements(val)):  # a zero-width layer has nothing to quantize: it stays float
                continue
            k = int(val.shape[1])
            widths.setdefault(config.group_size, set()).add(k)
            if config.group_size is not None and k < config.group_size:
                misfits.setdefault(config.group_size, []).append((str(weight.target), k))
                continue
            if config.group_size is not None and k % config.group_size and config.algorithm != "rtn":
                unrounded.setdefault((config.group_size, config.algorithm), []).append((str(weight.target), k))
                continue
            node.meta[ANNOTATION_KEY] = QuantizationAnnotation(
                input_qspec_map={weight: self.weight_spec(config, k)}, _annotated=True)
        if misfits:
            group_size, layers = next(iter(misfits.items()))
            raise GroupSizeError(tuple(layers), group_size, tuple(widths[group_size]))
        if unrounded:
            (group_size, algorithm), layers = next(iter(unrounded.items()))
            raise GroupSizeError(tuple(layers), group_size, tuple(widths[group_size]), algorithm)
        return model

    def validate(self, model: GraphModule) -> None:
        pass

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        return model


def module_of(target: str) -> str:
    """The module a ``get_attr`` parameter target belongs to (``"fc.weight"`` -> ``"fc"``)."""
    return str(target).rpartition(".")[0] or str(target)


# the command line's defaults (issue 14): int4 groups of 128 asymmetric (0.962 mean cosine on MiniLM vs
# 0.941 symmetric); NF4 groups of 64 (QLoRA's block size); int8 one scale per output channel (0.9996)
register_scheme("w4a16", WeightOnlyConfig(bits=4, group_size=128, scheme="int4", symmetric=False),
                description="int4 weights, asymmetric, groups of 128 input features; float activations")
register_scheme("w8a16", WeightOnlyConfig(bits=8, group_size=None, scheme="int8", symmetric=True),
                description="int8 weights, symmetric, per output channel; float activations")
register_scheme("nf4", WeightOnlyConfig(bits=4, group_size=64, scheme="nf4", symmetric=True),
                description="NF4 codes with per-group absmax scales, groups of 64; float activations")
