"""Fake quantization for quantization-aware training: an observer plus quantize-dequantize with a
straight-through estimator, optionally with a learnable scale and zero point (LSQ / LSQ+)."""

from __future__ import annotations

import math

import torch
from torchao.quantization.pt2e.fake_quantize import FakeQuantizeBase

from quantkit._errors import ConvertError
from quantkit._qdq import kind_from_attributes
from quantkit._qmath import dequantize_group, is_per_channel, is_symmetric, quantize_group

from ._groupwise import PER_GROUP
from ._minmax import MinMaxObserver

__all__ = ["FakeQuantize", "lsq_grad_factor"]


def lsq_grad_factor(numel: int, quant_max: int) -> float:
    """LSQ's gradient scale for a step size, ``1 / sqrt(numel * Q_P)`` (Esser et al. 2020,
    "Learned Step Size Quantization", section 2.2), ``numel`` being the number of elements
    that one scale quantizes (per channel: the elements of one channel) and ``Q_P`` the
    largest quantized level (``quant_max``)."""
    return 1.0 / math.sqrt(max(int(numel), 1) * max(int(quant_max), 1))


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward (the straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


def _scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x forward, gradient multiplied by ``factor`` backward."""
    return x * factor + (x - x * factor).detach()


class FakeQuantize(FakeQuantizeBase):
    """Observer plus fake quantization, for quantization-aware training.

    In training mode (``.training``) the observer watches the input and the qparams follow it
    (weights are re-observed afresh each step: ``weight=True``); in eval mode they stay
    frozen. An instance that has never seen data takes its qparams from the first tensor it
    sees, in either mode. The output is ``dequantize(quantize(x))`` with the gradient passed
    straight through inside the quantization range and zero outside (STE).

    With ``learnable=True`` the scale is an ``nn.Parameter`` initialised from the observer
    and then trained (LSQ, Esser et al. 2020; its gradient scaled by :func:`lsq_grad_factor`);
    affine schemes learn their zero point too (LSQ+, Bhalgat et al. 2020), rounded to an
    integer with a straight-through estimator. Symmetric schemes keep their fixed zero point.

    It declares what it quantizes as observers do (``dtype``, ``qscheme``, ``ch_axis``,
    ``quant_min``/``quant_max``, ``is_dynamic``), and ``calculate_qparams`` returns the qparams it
    fake-quantizes with, so ``quantkit.convert`` and torchao's ``convert_pt2e`` turn it into the
    quantize/dequantize ops that compute the same values.

    Args:
        observer: the observer (an instance, or a constructor called with ``observer_kwargs``).
        learnable: train the scale (and, for affine schemes, the zero point).
        weight: the input is a weight: qparams come from the current value only, each step.
        channels: number of channels of a per-channel scheme (creates a learnable per-channel
            scale up front, so an optimizer built right after prepare sees it).
        freeze_after: stop observing after this many training steps (None: never).
    """

    requires_calibration = True

    def __init__(self, observer=MinMaxObserver, *, learnable: bool = False, weight: bool = False,
                 channels: int | None = None, freeze_after: int | None = None, **observer_kwargs) -> None:
        super().__init__()
        if isinstance(observer, torch.nn.Module):
            if observer_kwargs:
                raise TypeError("pass observer arguments with an observer constructor, not with an instance")
            obs = observer
        else:
            obs = observer(**observer_kwargs)
        if freeze_after is not None and (not isinstance(freeze_after, int) or freeze_after < 0):
            raise ValueError(f"freeze_after must be a non-negative integer or None, got {freeze_after!r}")
        if learnable and getattr(obs, "is_dynamic", False):
            raise ValueError("learnable ranges need a static scheme; dynamic quantization chooses qparams at run time")
        if learnable and getattr(obs, "granularity", None) == PER_GROUP:
            raise ValueError("learnable ranges are per tensor or per channel; group-wise weights follow their observer")
        self.activation_post_process = obs
        self.learnable = bool(learnable)
        self.weight = bool(weight)
        self.freeze_after = freeze_after
        per_channel = is_per_channel(self.qscheme)
        shape = (int(channels),) if per_channel and channels else (1,)
        self.register_buffer("steps", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))
        # weights are observed from scratch each step: the state of a fresh observer
        self._fresh_state = {k: v.clone() for k, v in obs.state_dict().items()} if weight else None
        learn_zp = self.learnable and not is_symmetric(self.qscheme)
        if self.learnable and (not per_channel or channels):
            self.scale = torch.nn.Parameter(torch.ones(shape))
        else:
            self.register_buffer("scale", torch.ones(shape))
        if learn_zp and (not per_channel or channels):
            self.zero_point = torch.nn.Parameter(torch.zeros(shape))
        else:
            self.register_buffer("zero_point", torch.zeros(shape, dtype=torch.float32 if learn_zp else torch.int64))
        self._learn_zp = learn_zp

    # --- what it quantizes, as the observer declares it -----------------------------------
    dtype = property(lambda self: self.activation_post_process.dtype)
    qscheme = property(lambda self: self.activation_post_process.qscheme)
    quant_min = property(lambda self: int(self.activation_post_process.quant_min))
    quant_max = property(lambda self: int(self.activation_post_process.quant_max))
    is_dynamic = property(lambda self: bool(getattr(self.activation_post_process, "is_dynamic", False)))
    ch_axis = property(lambda self: getattr(self.activation_post_process, "ch_axis", None))
    granularity = property(lambda self: getattr(self.activation_post_process, "granularity", None))
    # group-wise weights (granularity "per-group"): what quantkit.convert's group-wise path reads
    group_size = property(lambda self: self.activation_post_process.group_size)
    scheme = property(lambda self: self.activation_post_process.scheme)
    symmetric = property(lambda self: self.activation_post_process.symmetric)
    weight_algorithm = property(lambda self: getattr(self.activation_post_process, "weight_algorithm", "rtn"))
    # the convert emitter (quantkit.pipeline.emit) follows from the attributes above, as for observers
    qkind = property(kind_from_attributes)

    def observe_weight(self, w: torch.Tensor) -> None:
        """Take the qparams of the weight ``w`` afresh (convert's group-wise path calls this on the
        weight it folds; the forward of a group-wise weight does the same, so both agree)."""
        self.activation_post_process.observe_weight(w.detach())
        self._take_observer_qparams()

    @property
    def node_name(self) -> str:
        return getattr(self.activation_post_process, "node_name", "<unattached>")

    @node_name.setter
    def node_name(self, name: str) -> None:
        self.activation_post_process.node_name = name

    @property
    def calibrated(self) -> bool:
        """Whether it has qparams (it has seen data)."""
        return bool(self.initialized) or self.is_dynamic

    @property
    def frozen(self) -> bool:
        """Whether the observer no longer updates the qparams in training."""
        return not bool(self.observer_enabled[0]) or (
            self.freeze_after is not None and int(self.steps) >= self.freeze_after) or (
            self.learnable and bool(self.initialized))

    # --- qparams --------------------------------------------------------------------------
    def _eps(self) -> float:
        eps = getattr(self.activation_post_process, "eps", torch.finfo(torch.float32).eps)
        return float(eps.reshape(-1)[0]) if isinstance(eps, torch.Tensor) else float(eps)

    @torch.no_grad()
    def _take_observer_qparams(self) -> None:
        scale, zp = self.activation_post_process.calculate_qparams()
        scale = scale.detach().reshape(-1).to(torch.float32)
        zp = zp.detach().reshape(-1)
        for name, value in (("scale", scale), ("zero_point", zp)):
            current = getattr(self, name)
            if current.shape == value.shape:
                current.copy_(value.to(current.dtype))
            elif isinstance(current, torch.nn.Parameter):
                raise ValueError(f"fake quantize at node '{self.node_name}': its learnable {name} has "
                                 f"{current.numel()} entries, the observer gives {value.numel()}")
            elif self.learnable and (name == "scale" or self._learn_zp):
                # a per-channel learnable scheme whose channel count was not known up front
                setattr(self, name, torch.nn.Parameter(value.to(current.dtype).clone()))
            else:
                current.resize_(value.shape).copy_(value.to(current.dtype))
        self.initialized.fill_(1)

    def calculate_qparams(self):
        """``(scale, zero_point)`` this module fake-quantizes with (float32, int64)."""
        if self.is_dynamic:
            return self.activation_post_process.calculate_qparams()
        if not self.initialized:
            raise ConvertError(
                f"fake quantize at node '{self.node_name}' has seen no data; run a batch through the model first")
        scale = self.scale.detach().clamp_min(self._eps()).clone()
        zp = self.zero_point.detach()
        zp = torch.round(zp).clamp(self.quant_min, self.quant_max).to(torch.int64) if self._learn_zp else zp.clone()
        return scale, zp

    # --- forward --------------------------------------------------------------------------
    def forward(self, x):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
            return x
        if self.is_dynamic:
            return self.activation_post_process(x)  # run-time qparams: nothing to simulate here
        if self.granularity == PER_GROUP:
            self.observe_weight(x)
        elif not self.initialized or (self.training and not self.frozen):
            if self._fresh_state is not None:
                self.activation_post_process.load_state_dict(self._fresh_state)
            self.activation_post_process(x.detach())
            self._take_observer_qparams()
        if self.training:
            self.steps += 1
        if not bool(self.fake_quant_enabled[0]):
            return x
        return self._learned(x) if self.learnable else self._fixed(x)

    def _axis(self, x: torch.Tensor) -> int:
        return int(self.ch_axis) % x.dim()

    def _fixed(self, x: torch.Tensor) -> torch.Tensor:
        scale, zp = self.calculate_qparams()
        xf = x.float()
        if self.granularity == PER_GROUP:  # round to nearest per group; gradient straight through
            g, lo, hi, shape = self.group_size, self.quant_min, self.quant_max, (x.shape[0], -1)
            q = quantize_group(xf.detach(), scale.reshape(shape), zp.reshape(shape), lo, hi, self.dtype, g)
            out = dequantize_group(q, scale.reshape(shape), zp.reshape(shape), lo, hi, self.dtype, g)
            return (xf + (out - xf).detach()).to(x.dtype)
        if is_per_channel(self.qscheme):
            out = torch.fake_quantize_per_channel_affine(
                xf, scale, zp.to(torch.int32), self._axis(x), self.quant_min, self.quant_max)
        else:
            out = torch.fake_quantize_per_tensor_affine(
                xf, scale, zp.to(torch.int32), self.quant_min, self.quant_max)
        return out.to(x.dtype)

    def _learned(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        scale = self.scale.clamp_min(self._eps())
        zp = self.zero_point
        if is_per_channel(self.qscheme):
            axis = self._axis(x)
            shape = [1] * x.dim()
            shape[axis] = -1
            per_scale = x.numel() // max(x.shape[axis], 1)
            scale, zp = scale.reshape(shape), zp.reshape(shape)
        else:
            per_scale = x.numel()
        scale = _scale_grad(scale, lsq_grad_factor(per_scale, self.quant_max))
        if self._learn_zp:
            zp = torch.clamp(_round_ste(_scale_grad(zp, lsq_grad_factor(per_scale, self.quant_max))),
                             self.quant_min, self.quant_max)
        else:
            zp = zp.to(xf.dtype)
        # x * (1 / scale), rounded, plus the zero point: the arithmetic of quantized_decomposed's
        # quantize ops, so that convert computes the values trained with
        q = torch.clamp(_round_ste(xf * (1.0 / scale)) + zp, self.quant_min, self.quant_max)
        return ((q - zp) * scale).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"learnable={self.learnable}, weight={self.weight}, freeze_after={self.freeze_after}, "
                f"quant_min={self.quant_min}, quant_max={self.quant_max}, node={self.node_name!r}")
