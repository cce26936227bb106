"""Group-wise weight observer: one scale (and zero point) per group of input features."""

from __future__ import annotations

import torch

from quantkit._qdq import PER_GROUP
from quantkit._qmath import DEFAULT_EPS, choose_qparams_group, group_min_max, nf4_scales

from ._base import QuantkitObserver
from ._registry import register

__all__ = ["GroupwiseWeightObserver", "PER_GROUP", "WEIGHT_SCHEMES"]

# PER_GROUP (``obs.granularity``, defined in quantkit._qdq): ``group_size`` consecutive input features
# of one output row of a ``[N, K]`` weight; quantkit.convert emits group-wise q/dq ops for it
# integer: affine or symmetric qparams over [quant_min, quant_max]; "nf4": codes into the NF4
# table with per-group absmax scales
WEIGHT_SCHEMES = ("int4", "int8", "nf4")


@register("groupwise_minmax")
class GroupwiseWeightObserver(QuantkitObserver):
    """Min/max of each group of ``group_size`` input features of a ``[N, K]`` weight.

    When ``group_size`` does not divide K, the last group holds the remainder (576 features in
    groups of 128: four of 128 and one of 64), with its own range; the qparams are ``[N, ceil(K / g)]``.

    Weights are constant, so the observer keeps the ranges of the last weight it saw (merging
    two observers takes the union of their ranges); ``quantkit.convert`` observes the weight
    it folds once more, so the qparams always describe the weight being quantized.

    Declared by attribute: ``granularity == "per-group"``, ``group_size``, ``scheme``
    (``"int4"``, ``"int8"`` or ``"nf4"``), ``symmetric``, ``quant_min``/``quant_max`` and
    ``weight_algorithm`` (``"rtn"``, ``"gptq"`` or ``"awq"``: which rounding the quantizer asked for;
    this observer itself is round-to-nearest) and ``double_quant`` (NF4 only: convert stores the
    absmax scales double-quantized, QLoRA's 8-bit scales in blocks of 256; the observer's qparams
    are the fp32 scales before that).

    Args:
        group_size: input features per group (required: it is what the observer is for).
        scheme: ``"int4"`` (default), ``"int8"`` or ``"nf4"``.
        symmetric: symmetric qparams (zero point 0) instead of affine (ignored by NF4: absmax).
        weight_algorithm: recorded for the rounding algorithms; does not change this observer.
        gptq_clip_search: recorded for GPTQ (declared as ``gptq_clip_search``): search each group's
            range by the layer's output error (``GPTQConfig.clip_search``); does not change this observer.
        awq_fold_only: recorded for AWQ (declared as ``awq_fold_only``): scale this linear's input
            only where ``1/s`` folds into the op before it, never through an inserted ``mul``.
        double_quant: NF4 double quantization of the scales at convert (``scheme="nf4"`` only).
        dtype, quant_min, quant_max: storage dtype and range; defaults: int4 affine uint8 [0, 15],
            int4 symmetric int8 [-8, 7], int8 int8 [-128, 127], NF4 codes uint8 [0, 15].

    Example:
        >>> obs = GroupwiseWeightObserver(group_size=128)
        >>> obs(weight); scale, zero_point = obs.calculate_qparams()  # [N, ceil(K / 128)] each
    """

    qkind = "groupwise"  # quantkit.pipeline.emit: folded packed integers / NF4 codes, per-group dequantize
    repeat_invariant = True  # it keeps the ranges of the last weight seen: the same weight, the same ranges

    def __init__(self, group_size: int, scheme: str = "int4", symmetric: bool = False,
                 weight_algorithm: str = "rtn", double_quant: bool = False, gptq_clip_search: bool = False,
                 awq_fold_only: bool = False, dtype: torch.dtype | None = None,
                 quant_min: int | None = None, quant_max: int | None = None,
                 eps: float = DEFAULT_EPS, **kwargs) -> None:
        if scheme not in WEIGHT_SCHEMES:
            raise ValueError(f"unknown weight scheme {scheme!r}; use one of {list(WEIGHT_SCHEMES)}")
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2:
            raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
        if double_quant and scheme != "nf4":
            raise ValueError(f"double_quant quantizes NF4's absmax scales; scheme {scheme!r} has none: use scheme='nf4'")
        symmetric = bool(symmetric) or scheme == "nf4"
        if dtype is None:
            dtype = torch.int8 if (scheme == "int8" or (symmetric and scheme == "int4")) else torch.uint8
        if quant_min is None and quant_max is None:
            quant_min, quant_max = {"int8": (-128, 127), "nf4": (0, 15)}.get(
                scheme, (-8, 7) if dtype == torch.int8 else (0, 15))
        kwargs.pop("qscheme", None)  # declared by ``symmetric``
        kwargs.pop("ch_axis", None)
        super().__init__(dtype=dtype, qscheme=torch.per_channel_symmetric if symmetric else torch.per_channel_affine,
                         quant_min=quant_min, quant_max=quant_max, eps=eps, **kwargs)
        self.ch_axis = 0
        self.group_size = group_size
        self.scheme = scheme
        self.symmetric = symmetric
        self.weight_algorithm = weight_algorithm
        self.double_quant = bool(double_quant)
        self.gptq_clip_search = bool(gptq_clip_search)
        self.awq_fold_only = bool(awq_fold_only)
        self.register_buffer("min_val", torch.tensor([]))
        self.register_buffer("max_val", torch.tensor([]))

    @property
    def granularity(self) -> str:
        return PER_GROUP

    @property
    def calibrated(self) -> bool:
        return self.min_val.numel() > 0

    def _observe(self, x: torch.Tensor) -> None:
        if x.dim() != 2:
            raise ValueError(f"weight at node '{self.node_name}' has shape {tuple(x.shape)}; group-wise "
                             "quantization is for 2-D [out, in] weights")
        lo, hi = group_min_max(x, self.group_size)
        self._check_finite(lo, hi)
        if self.scheme == "nf4":  # absmax: the range is symmetric by construction
            hi = nf4_scales(x, self.group_size, eps=0.0)
            lo = -hi
        self.min_val, self.max_val = lo, hi

    def observe_weight(self, w: torch.Tensor) -> None:
        """Forget what was seen and observe the weight ``w`` (convert calls this with the weight it folds)."""
        self.min_val = torch.tensor([])
        self.max_val = torch.tensor([])
        self(w)

    def _min_max(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.min_val, self.max_val

    def _choose(self, min_val, max_val):
        if self.scheme == "nf4":
            return (torch.maximum(max_val.float(), self.eps.to(max_val.device)),
                    torch.zeros(max_val.shape, dtype=torch.int8, device=max_val.device))
        return choose_qparams_group(min_val, max_val, quant_min=self.quant_min, quant_max=self.quant_max,
                                    symmetric=self.symmetric, dtype=self.dtype, eps=self.eps)

    def _merge(self, other: "GroupwiseWeightObserver") -> None:
        if (other.group_size, other.scheme, other.double_quant) != (self.group_size, self.scheme, self.double_quant):
            raise ValueError("cannot merge group-wise observers with different group_size or scheme")
        if not self.calibrated:
            self.min_val, self.max_val = other.min_val.clone(), other.max_val.clone()
            return
        self.min_val = torch.minimum(self.min_val, other.min_val)
        self.max_val = torch.maximum(self.max_val, other.max_val)

    def extra_repr(self) -> str:
        dq = (", double_quant=True" if self.double_quant else "") + (
            ", gptq_clip_search=True" if self.gptq_clip_search else "") + (
            ", awq_fold_only=True" if self.awq_fold_only else "")
        return (f"scheme={self.scheme}{dq}, group_size={self.group_size}, symmetric={self.symmetric}, "
                f"quant_min={self.quant_min}, quant_max={self.quant_max}, algorithm={self.weight_algorithm}, "
                f"node={self.node_name!r}")
