"""Observer base class: subclasses update statistics, the base turns them into qparams."""

from __future__ import annotations

import torch
from torchao.quantization.pt2e.observer import ObserverBase

from quantkit._errors import CalibrationError, ConvertError
from quantkit._qdq import PER_CHANNEL, PER_TENSOR, PER_TOKEN, kind_from_attributes
from quantkit._qmath import DEFAULT_EPS, choose_qparams, default_qrange, is_per_channel, underlying_dtype

from ._tokens import real_tokens

__all__ = ["QuantkitObserver", "StatelessObserver", "PER_TENSOR", "PER_CHANNEL", "PER_TOKEN", "declared_qscheme", "empty_message"]

_QSCHEMES = (
    torch.per_tensor_affine,
    torch.per_tensor_symmetric,
    torch.per_channel_affine,
    torch.per_channel_symmetric,
)


# what one scale covers, as an observer declares it (``obs.granularity``): PER_TENSOR, PER_CHANNEL,
# PER_TOKEN (defined in quantkit._qdq, re-exported here); the values match
# quantkit.quantizers.Granularity where the two overlap


def declared_qscheme(ctor) -> torch.qscheme | None:
    """The qscheme that observers built by ``ctor`` (a class or ``with_args`` partial) declare
    with their defaults, read from an instance; None if ``ctor()`` needs arguments.

    This is how quantizers tell a per-channel observer from a per-tensor one: by what the
    observer says (``qscheme``), whatever its class is called.
    """
    try:
        obs = ctor()
    except (TypeError, ValueError):
        return None
    return getattr(obs, "qscheme", None)


def empty_message(node_name: str, shape=None) -> str:
    """Why an observer of a tensor with no elements (a zero-width layer or an empty slice) has no
    qparams: there is nothing to quantize there, which is not a calibration problem."""
    what = f"a tensor with no elements (shape {list(shape)})" if shape is not None else \
        "only tensors with no elements (a dimension of size 0)"
    return (f"observer at node '{node_name}' watches {what}, so there is no range to quantize it with; "
            "keep that layer float (it holds nothing to quantize)")


class QuantkitObserver(ObserverBase):
    """Base class of quantkit's observers.

    It subclasses torchao's ``ObserverBase``, so quantkit observers can be used as
    ``observer_or_fake_quant_ctr`` in a torchao ``QuantizationSpec`` and are
    recognised by torchao's ``prepare_pt2e``/``convert_pt2e`` as well as by quantkit.

    A subclass implements ``_observe(x)`` (update statistics from a non-empty,
    detached tensor), ``_min_max()`` (the range to quantize), ``calibrated`` and
    ``_merge(other)``. The base class checks for NaN/inf, skips empty tensors and
    turns the range into qparams with :func:`quantkit._qmath.choose_qparams`.

    What an observer is, it declares by attribute (never by class name): ``qscheme`` (with
    ``ch_axis`` for per-channel schemes), ``is_dynamic`` (qparams chosen at run time) and
    ``granularity`` (``"per-tensor"``, ``"per-channel"`` or ``"per-token"``); ``token_axes`` is recorded by ``quantkit.prepare``
    for padding-aware calibration; ``requires_calibration`` (True) makes ``quantkit.convert``
    refuse the observer until it has seen data. ``qkind`` names the convert emitter that
    replaces it (``quantkit.pipeline.emit``): here it follows from the attributes above
    (:func:`quantkit._qdq.kind_from_attributes`: ``"affine"``, ``"dynamic"``, ``"float8"``,
    ``"float16"``, ``"passthrough"``); a subclass of one kind declares it as a class attribute.

    Args:
        dtype: quantized dtype (torch.int8/uint8, or torch.qint8/quint8).
        qscheme: per-tensor or per-channel, affine or symmetric.
        quant_min, quant_max: custom integer range; default is the dtype's full range.
        eps: smallest scale; keeps a constant tensor from getting a zero scale.
        is_dynamic: qparams are computed at run time (dynamic quantization).
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_tensor_affine,
        quant_min: int | None = None,
        quant_max: int | None = None,
        eps: float = DEFAULT_EPS,
        is_dynamic: bool = False,
        factory_kwargs=None,
    ) -> None:
        super().__init__(dtype=dtype, is_dynamic=is_dynamic)
        if qscheme not in _QSCHEMES:
            raise ValueError(f"unsupported qscheme {qscheme}; use one of {list(_QSCHEMES)}")
        lo, hi = default_qrange(underlying_dtype(dtype))
        self.has_customized_qrange = quant_min is not None and quant_max is not None
        if (quant_min is None) != (quant_max is None):
            raise ValueError("give both quant_min and quant_max, or neither")
        if self.has_customized_qrange:
            if not (lo <= quant_min <= 0 <= quant_max <= hi and quant_min < quant_max):
                raise ValueError(
                    f"quant range [{quant_min}, {quant_max}] must contain 0 and fit in {dtype} [{lo}, {hi}]"
                )
        else:
            quant_min, quant_max = lo, hi
        self.qscheme = qscheme
        self.quant_min = int(quant_min)
        self.quant_max = int(quant_max)
        self.reduce_range = False
        self.register_buffer("eps", torch.tensor([eps], dtype=torch.float32))
        # set by quantkit.prepare: names the graph edge this observer watches
        self.node_name = "<unattached>"

    @property
    def qkind(self) -> str:
        """The convert kind (``quantkit.pipeline.emit``) that this observer's attributes declare."""
        return kind_from_attributes(self)

    # quantkit.convert refuses an observer that declares it needs calibration and has seen no
    # data (a safety feature: default qparams would silently ruin the model). An observer that
    # does not declare it (torchao's, torch.ao's) follows its own contract: convert calls its
    # calculate_qparams as torchao's convert_pt2e would (torchao's return defaults and warn).
    requires_calibration: bool = True

    # True where observing a tensor it has already seen leaves every statistic as it is (a running
    # min/max): a graph whose every such observer watches a constant (a weight) then calibrates in
    # one batch as in many (quantkit.pipeline._calibrate.one_batch_suffices). False by default: a
    # moving average, a histogram or a batch count changes with each repeat.
    repeat_invariant: bool = False

    # recorded by quantkit.prepare for observers of [batch, ..., tokens, ...] activations:
    # one (layout, token axis) pair per call site, a layout being the tensor's sizes with
    # None for symbolic ones (_tokens.FLAT for [batch * tokens, ...] rows); calibration then
    # leaves padding tokens out (see _tokens.token_mask). Empty: not padding aware.
    token_axes: tuple[tuple[tuple[int | None, ...], int], ...] = ()

    @property
    def padding_aware(self) -> bool:
        """Whether calibration leaves padding tokens out of this observer's statistics."""
        return bool(self.token_axes)

    def _token_axis(self, shape) -> int | None:
        """The token axis recorded for the call site whose layout ``shape`` has; None when no
        recorded layout fits, or several fit with different axes (e.g. ``[B, h, S, d]`` and
        ``[B, h, d, S]`` when ``S == d``): the tensor is then observed whole."""
        found = {axis for layout, axis in self.token_axes
                 if len(layout) == len(shape) and all(n is None or n == s for n, s in zip(layout, shape))}
        return found.pop() if len(found) == 1 else None

    @property
    def granularity(self) -> str:
        """What one scale covers: ``"per-channel"`` when ``qscheme`` says so, else ``"per-tensor"``."""
        return PER_CHANNEL if is_per_channel(self.qscheme) else PER_TENSOR

    # --- to implement in subclasses -------------------------------------------------
    @property
    def calibrated(self) -> bool:
        raise NotImplementedError

    def _observe(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def _min_max(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _merge(self, other: "QuantkitObserver") -> None:
        raise NotImplementedError

    # --- shared behaviour -----------------------------------------------------------
    # set when a tensor with no elements arrived (it is not observed): says why an observer
    # that saw nothing else has no range (a zero-size dimension, not missing calibration)
    saw_empty: bool = False

    def forward(self, x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.numel() == 0:
            if not self.saw_empty:
                self.saw_empty = True
            return x
        if not x.is_floating_point():
            raise CalibrationError(
                f"observer at node '{self.node_name}' got a {x.dtype} tensor; only floating-point tensors can be quantized"
            )
        axis = self._token_axis(x.shape) if self.token_axes and not is_per_channel(self.qscheme) else None
        if axis is not None:
            real = real_tokens(x, axis)
            if real.numel() == 0:  # all padding
                return x
            self._observe(real.detach())
        else:
            self._observe(x.detach())
        return x

    def _check_finite(self, min_val: torch.Tensor, max_val: torch.Tensor) -> None:
        if not bool(torch.isfinite(min_val).all() and torch.isfinite(max_val).all()):
            raise CalibrationError(
                f"observer at node '{self.node_name}' saw NaN or inf values; "
                "check the calibration data (and the float model's outputs) for NaN/inf"
            )

    def calculate_qparams(self):
        """``(scale, zero_point)`` from the statistics seen so far.

        Raises:
            ConvertError: if the observer has seen no data.
        """
        if self._fixed_qparams is not None:
            return self._fixed_qparams
        self._check_calibrated()
        return self._choose(*self._min_max())

    # set by set_qparams: qparams a rounding algorithm (GPTQ) chose, returned whatever was observed
    _fixed_qparams: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_qparams(self, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
        """Fix the qparams :meth:`calculate_qparams` returns from now on, whatever the observer
        sees (a rounding algorithm such as GPTQ chose them together with the weight's integers).

        Args:
            scale, zero_point: shaped and typed as this observer's own ``calculate_qparams`` gives them.
        """
        self._fixed_qparams = (scale.detach().clone(), zero_point.detach().clone())

    @property
    def has_fixed_qparams(self) -> bool:
        """Whether :meth:`set_qparams` fixed this observer's qparams."""
        return self._fixed_qparams is not None

    def _qp(self) -> dict:
        """This observer's quantization settings, as choose_qparams' keyword arguments."""
        return dict(qscheme=self.qscheme, dtype=self.dtype, quant_min=self.quant_min,
                    quant_max=self.quant_max, eps=self.eps, customized_qrange=self.has_customized_qrange)

    def _choose(self, min_val, max_val):
        return choose_qparams(min_val, max_val, **self._qp())

    def _check_calibrated(self) -> None:
        if not self.calibrated:
            raise ConvertError(empty_message(self.node_name) if self.saw_empty else
                               f"observer at node '{self.node_name}' has seen no data; "
                               "run quantkit.calibrate(prepared, data) before convert")

    def merge(self, other: "QuantkitObserver") -> "QuantkitObserver":
        """Fold ``other``'s statistics into this observer (e.g. from another process).

        Returns ``self``. Both observers must be of the same class and configuration.
        """
        if type(other) is not type(self):
            raise TypeError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        for attr in ("dtype", "qscheme", "quant_min", "quant_max", "is_dynamic"):
            if getattr(self, attr) != getattr(other, attr):
                raise ValueError(
                    f"cannot merge observers with different {attr}: {getattr(self, attr)} vs {getattr(other, attr)}"
                )
        if other.calibrated:
            self._merge(other)
        return self

    def extra_repr(self) -> str:
        return (
            f"dtype={self.dtype}, qscheme={self.qscheme}, quant_min={self.quant_min}, "
            f"quant_max={self.quant_max}, node={self.node_name!r}"
        )


class StatelessObserver(QuantkitObserver):
    """An observer that records nothing: its input passes through, it is always calibrated and
    merges nothing (dynamic placeholders, fixed qparams, qparams derived from other observers).
    A subclass gives ``calculate_qparams`` (and may narrow ``calibrated``)."""

    @property
    def calibrated(self) -> bool:
        return True

    def forward(self, x):
        return x

    def _merge(self, other) -> None:
        pass
