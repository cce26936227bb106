"""QuantConfig: what W8A8Quantizer does to one part of the model, as data."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from quantkit.observers import get as get_observer

from ._scheme import SchemeConfig, register_scheme

__all__ = ["ActivationScheme", "Granularity", "QuantConfig", "QUANTIZABLE_OPS", "W8A8_OPT_IN_OPS", "parse_choice"]

# op families W8A8Quantizer knows; "add" (residual adds) is off by default
QUANTIZABLE_OPS = frozenset({"linear", "conv", "matmul", "add"})
# op families only W8A8Quantizer knows, never in a default: "attention" quantizes the q, k and v
# inputs of scaled_dot_product_attention (static per tensor), which quantkit.lowering._qsdpa
# lowers to an int8 Q.K^T kernel. Kept out of QUANTIZABLE_OPS so that FP8Config and the CLI's
# --ops (which read that set) do not accept a family they would silently ignore.
W8A8_OPT_IN_OPS = frozenset({"attention"})


def parse_choice(enum_cls, value, what: str, *, shown=None):
    """``enum_cls(value)``, or a ValueError naming ``what``, the value given (``shown`` when the
    user wrote something else) and the choices."""
    try:
        return enum_cls(value)
    except ValueError:
        raise ValueError(
            f"unknown {what} {value if shown is None else shown!r}; use one of {[c.value for c in enum_cls]}"
        ) from None


class ActivationScheme(str, Enum):
    """How activations are quantized (per tensor).

    ``AFFINE_UINT7`` is affine uint8 restricted to 0..127 (FBGEMM's ``reduce_range``): on x86
    CPUs without VNNI, oneDNN's int8 GEMM adds pairs of u8*s8 products into a saturating
    int16, and 2 * 127 * 128 = 32512 fits where 2 * 255 * 128 does not. It costs one bit of
    activation resolution and lets ``quantkit.compile`` run oneDNN exactly on those CPUs.
    """

    AFFINE_UINT8 = "affine-uint8"
    SYMMETRIC_INT8 = "symmetric-int8"
    AFFINE_UINT7 = "affine-uint7"

    @property
    def dtype(self) -> torch.dtype:
        return torch.int8 if self is ActivationScheme.SYMMETRIC_INT8 else torch.uint8

    @property
    def qscheme(self) -> torch.qscheme:
        return torch.per_tensor_symmetric if self is ActivationScheme.SYMMETRIC_INT8 else torch.per_tensor_affine

    @property
    def qrange(self) -> tuple[int, int]:
        """``(quant_min, quant_max)`` of the stored integers."""
        return self.qrange_bits(8)

    def qrange_bits(self, bits: int) -> tuple[int, int]:
        """``(quant_min, quant_max)`` at ``bits`` bits (2..8) in the same storage dtype: affine
        uint8 0..2^bits-1, symmetric int8 -2^(bits-1)..2^(bits-1)-1, affine uint7 one bit less."""
        if self is ActivationScheme.SYMMETRIC_INT8:
            return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        return 0, 2 ** (bits - (1 if self is ActivationScheme.AFFINE_UINT7 else 0)) - 1


class Granularity(str, Enum):
    """Which elements share one activation scale."""

    PER_TENSOR = "per-tensor"
    # one scale per row of the last dimension (per token); dynamic only, since the
    # scales of tokens not seen in calibration cannot be known ahead of time
    PER_TOKEN = "per-token"


@dataclass(frozen=True)
class QuantConfig(SchemeConfig):
    """Static (or dynamic) W8A8 quantization settings.

    Args:
        activation: ``"affine-uint8"`` (default for static), ``"symmetric-int8"``
            (default for dynamic) or ``"affine-uint7"`` (uint8 in 0..127, for oneDNN on
            x86 CPUs without VNNI; see :class:`ActivationScheme`).
        act_observer: registered observer name for activations (``"minmax"``, ...).
            Ignored when ``dynamic`` (qparams are chosen at run time).
        weight_observer: registered observer name for weights; weights are symmetric
            int8, per output channel when the observer is a per-channel one.
        dynamic: quantize activations at run time instead of calibrating them.
        granularity: ``"per-tensor"`` (default) or ``"per-token"`` (dynamic, symmetric
            int8 only): each token gets its own scale, which keeps outlier tokens
            (e.g. a transformer's [CLS]/[SEP]) from costing every other token precision.
        ops: op families to quantize: any of ``"linear"``, ``"conv"``, ``"matmul"``
            (matmul/bmm, e.g. attention) and ``"add"`` (residual adds); opt-in, never a default:
            ``"attention"`` (the q, k, v inputs of ``scaled_dot_product_attention``, per tensor).
        weight_bits, activation_bits: integer widths from 2 to 8 (default 8), stored in
            int8/uint8 with a reduced ``quant_min``/``quant_max`` (e.g. weights at 4 bits:
            -8..7; affine uint8 activations at 4 bits: 0..15; affine-uint7 keeps one bit less).
        learnable_ranges: in quantization-aware training (``quantkit.prepare_qat``), learn the
            scale and, for affine activations, the zero point (LSQ / LSQ+) instead of following
            the observers.
        weight_algorithm: how weights are rounded: ``"rtn"`` (to nearest, default), ``"gptq"``
            (Frantar et al. 2022) or ``"awq"`` (Lin et al. 2023), run by ``quantkit.calibrate``
            (which then needs a re-iterable list of batches; see ``quantkit.accuracy.rounding``).
        qat: annotate with fake-quantize modules (``quantkit.observers.FakeQuantize``) instead of
            observers, for torchao's ``prepare_qat_pt2e``; ``quantkit.prepare_qat`` needs no flag.

    ``quantizer()`` is ``W8A8Quantizer(self)``; the presets ``w8a8``, ``w8a8-dynamic`` and
    ``w8a8-per-token`` are registered below (``quantkit.quantizers.get_scheme``).

    Example:
        >>> QuantConfig(act_observer="moving_average_minmax", ops=frozenset({"linear"}))
    """

    VERSION = 1

    activation: ActivationScheme | str | None = None
    act_observer: str = "minmax"
    weight_observer: str = "per_channel_minmax"
    dynamic: bool = False
    granularity: Granularity | str = Granularity.PER_TENSOR
    ops: frozenset = field(default_factory=lambda: frozenset({"linear", "conv", "matmul"}))
    weight_bits: int = 8
    activation_bits: int = 8
    learnable_ranges: bool = False
    qat: bool = False
    weight_algorithm: str = "rtn"

    def __post_init__(self) -> None:
        act = self.activation
        if act is None:
            act = ActivationScheme.SYMMETRIC_INT8 if self.dynamic else ActivationScheme.AFFINE_UINT8
        act = parse_choice(ActivationScheme, act, "activation scheme", shown=self.activation)
        object.__setattr__(self, "activation", act)
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"dynamic must be True or False, got {self.dynamic!r}")
        granularity = parse_choice(Granularity, self.granularity, "granularity")
        object.__setattr__(self, "granularity", granularity)
        if granularity is Granularity.PER_TOKEN:
            if not self.dynamic:
                raise ValueError("per-token activation quantization is dynamic; pass dynamic=True")
            if act is not ActivationScheme.SYMMETRIC_INT8:
                raise ValueError(
                    f"per-token activations are symmetric int8; got activation={act.value!r}, use 'symmetric-int8'"
                )
        ops = frozenset([self.ops] if isinstance(self.ops, str) else self.ops)
        unknown = ops - QUANTIZABLE_OPS - W8A8_OPT_IN_OPS
        if unknown:
            raise ValueError(f"unknown op families {sorted(unknown)}; "
                             f"choose from {sorted(QUANTIZABLE_OPS | W8A8_OPT_IN_OPS)}")
        if "attention" in ops and granularity is Granularity.PER_TOKEN:
            raise ValueError("'attention' quantizes q, k and v per tensor; per-token granularity applies to "
                             "linear inputs only: drop 'attention' from ops or use granularity='per-tensor'")
        object.__setattr__(self, "ops", ops)
        for name in ("weight_bits", "activation_bits"):
            bits = getattr(self, name)
            if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
                raise ValueError(f"{name} must be an integer from 2 to 8, got {bits!r}")
        for name in ("learnable_ranges", "qat"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.learnable_ranges and self.dynamic:
            raise ValueError("learnable_ranges needs static activations (dynamic ones get their range at run time); "
                             "drop dynamic=True or learnable_ranges=True")
        if self.weight_algorithm not in ("rtn", "gptq", "awq"):
            raise ValueError(f"unknown weight_algorithm {self.weight_algorithm!r}; use 'rtn', 'gptq' or 'awq'")
        get_observer(self.act_observer)  # raises ValueError naming the known observers
        get_observer(self.weight_observer)


register_scheme("w8a8", QuantConfig(),
                description="static int8 weights per channel, calibrated uint8 activations per tensor")
register_scheme("w8a8-dynamic", QuantConfig(dynamic=True),
                description="int8 weights, int8 activations quantized per batch at run time")
register_scheme("w8a8-per-token", QuantConfig(dynamic=True, granularity="per-token"),
                description="int8 weights, int8 activations quantized per token at run time")
