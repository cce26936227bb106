"""Min-max observers: running extrema, optionally averaged, per tensor or per channel."""

from __future__ import annotations

import torch

from quantkit._errors import ConvertError
from quantkit._qdq import emit_dynamic
from quantkit._qmath import is_per_channel, underlying_dtype

from ._base import PER_TENSOR, PER_TOKEN, QuantkitObserver, StatelessObserver
from ._history import BatchHistory
from ._registry import register

__all__ = [
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "PerChannelMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "PlaceholderObserver",
]


def _check_averaging_constant(c: float) -> float:
    if not 0.0 < c <= 1.0:
        raise ValueError(f"averaging_constant must be in (0, 1], got {c}")
    return float(c)


@register("minmax")
class MinMaxObserver(QuantkitObserver):
    """Running minimum and maximum of everything observed (per tensor).

    Gives the same qparams as torchao's ``MinMaxObserver`` on the same data.
    Merging takes the min of minima and the max of maxima, so it is exact.
    """

    repeat_invariant = True  # min(a, a) == a

    def __init__(self, dtype=torch.quint8, qscheme=torch.per_tensor_affine, **kwargs) -> None:
        super().__init__(dtype=dtype, qscheme=qscheme, **kwargs)
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    @property
    def calibrated(self) -> bool:
        return bool(self.min_val <= self.max_val)

    def _batch_min_max(self, x: torch.Tensor):
        mn, mx = torch.aminmax(x.to(self.min_val.dtype))
        self._check_finite(mn, mx)
        return mn, mx

    def _observe(self, x: torch.Tensor) -> None:
        mn, mx = self._batch_min_max(x)
        self.min_val.copy_(torch.min(mn, self.min_val))
        self.max_val.copy_(torch.max(mx, self.max_val))

    def _min_max(self):
        return self.min_val, self.max_val

    def _merge(self, other) -> None:
        self.min_val.copy_(torch.min(self.min_val, other.min_val.to(self.min_val.device)))
        self.max_val.copy_(torch.max(self.max_val, other.max_val.to(self.max_val.device)))


@register("moving_average_minmax")
class MovingAverageMinMaxObserver(MinMaxObserver):
    """Exponential moving average of per-batch minima and maxima.

    ``min ← min + c·(batch_min − min)`` with ``c = averaging_constant`` (0.01, as in
    torchao). Merging averages the two states weighted by their batch counts; it is
    exact when both sides saw one batch each, and an approximation otherwise.
    """

    repeat_invariant = False  # num_batches counts every repeat

    def __init__(self, averaging_constant: float = 0.01, dtype=torch.quint8,
                 qscheme=torch.per_tensor_affine, **kwargs) -> None:
        super().__init__(dtype=dtype, qscheme=qscheme, **kwargs)
        self.averaging_constant = _check_averaging_constant(averaging_constant)
        self.register_buffer("num_batches", torch.tensor(0, dtype=torch.int64))
        self.batch_history = BatchHistory()  # replayed by quantkit.observers.sync

    def _observe(self, x: torch.Tensor) -> None:
        mn, mx = self._batch_min_max(x)
        self.batch_history.record(mn, mx)
        self._average(mn, mx)

    def _average(self, mn: torch.Tensor, mx: torch.Tensor) -> None:
        """One step of the average with a batch's minimum and maximum."""
        if int(self.num_batches) == 0:
            self.min_val.copy_(mn)
            self.max_val.copy_(mx)
        else:
            c = self.averaging_constant
            self.min_val.copy_(self.min_val + c * (mn - self.min_val))
            self.max_val.copy_(self.max_val + c * (mx - self.max_val))
        self.num_batches += 1

    def _merge(self, other) -> None:
        n1, n2 = int(self.num_batches), int(other.num_batches)
        if n1 == 0:
            self.min_val.copy_(other.min_val)
            self.max_val.copy_(other.max_val)
        else:
            w = n2 / (n1 + n2)
            self.min_val.copy_(self.min_val + w * (other.min_val - self.min_val))
            self.max_val.copy_(self.max_val + w * (other.max_val - self.max_val))
        self.num_batches += n2


@register("per_channel_minmax")
class PerChannelMinMaxObserver(QuantkitObserver):
    """Running minimum and maximum per channel along ``ch_axis`` (weights: axis 0).

    Gives the same qparams as torchao's ``PerChannelMinMaxObserver``. Merging is exact.
    """

    repeat_invariant = True  # min(a, a) == a

    def __init__(self, ch_axis: int = 0, dtype=torch.quint8,
                 qscheme=torch.per_channel_affine, **kwargs) -> None:
        super().__init__(dtype=dtype, qscheme=qscheme, **kwargs)
        self.ch_axis = int(ch_axis)
        self.register_buffer("min_val", torch.tensor([]))
        self.register_buffer("max_val", torch.tensor([]))

    @property
    def calibrated(self) -> bool:
        return self.min_val.numel() > 0

    def _batch_min_max(self, x: torch.Tensor):
        if x.dim() == 0 or not -x.dim() <= self.ch_axis < x.dim():
            raise ValueError(
                f"observer at node '{self.node_name}': ch_axis={self.ch_axis} is out of range for a tensor of shape {tuple(x.shape)}"
            )
        y = torch.flatten(x.transpose(0, self.ch_axis).to(self.min_val.dtype), start_dim=1)
        mn, mx = torch.aminmax(y, dim=1)
        self._check_finite(mn, mx)
        if self.calibrated and mn.shape != self.min_val.shape:
            raise ValueError(
                f"observer at node '{self.node_name}': channel count changed from {self.min_val.numel()} to {mn.numel()}"
            )
        return mn, mx

    def _observe(self, x: torch.Tensor) -> None:
        mn, mx = self._batch_min_max(x)
        if self.calibrated:
            mn = torch.min(mn, self.min_val)
            mx = torch.max(mx, self.max_val)
        self._set(mn, mx)

    def _set(self, mn: torch.Tensor, mx: torch.Tensor) -> None:
        self.min_val.resize_(mn.shape).copy_(mn)
        self.max_val.resize_(mx.shape).copy_(mx)

    def _min_max(self):
        return self.min_val, self.max_val

    def _merge(self, other) -> None:
        if not self.calibrated:
            self._set(other.min_val.clone(), other.max_val.clone())
            return
        if other.min_val.shape != self.min_val.shape:
            raise ValueError(
                f"cannot merge per-channel observers with {self.min_val.numel()} and {other.min_val.numel()} channels"
            )
        self._set(torch.min(self.min_val, other.min_val), torch.max(self.max_val, other.max_val))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # buffers start empty; take the saved shape before loading
        for name in ("min_val", "max_val"):
            if prefix + name in state_dict:
                getattr(self, name).resize_(state_dict[prefix + name].shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


@register("moving_average_per_channel_minmax")
class MovingAveragePerChannelMinMaxObserver(PerChannelMinMaxObserver):
    """Per-channel exponential moving average of minima and maxima (see
    :class:`MovingAverageMinMaxObserver` for the update and merge rules)."""

    repeat_invariant = False  # num_batches counts every repeat

    def __init__(self, averaging_constant: float = 0.01, ch_axis: int = 0, dtype=torch.quint8,
                 qscheme=torch.per_channel_affine, **kwargs) -> None:
        super().__init__(ch_axis=ch_axis, dtype=dtype, qscheme=qscheme, **kwargs)
        self.averaging_constant = _check_averaging_constant(averaging_constant)
        self.register_buffer("num_batches", torch.tensor(0, dtype=torch.int64))
        self.batch_history = BatchHistory()  # replayed by quantkit.observers.sync

    def _observe(self, x: torch.Tensor) -> None:
        mn, mx = self._batch_min_max(x)
        self.batch_history.record(mn, mx)
        self._average(mn, mx)

    def _average(self, mn: torch.Tensor, mx: torch.Tensor) -> None:
        """One step of the average with a batch's per-channel minima and maxima."""
        if self.calibrated:
            c = self.averaging_constant
            mn = self.min_val + c * (mn - self.min_val)
            mx = self.max_val + c * (mx - self.max_val)
        self._set(mn, mx)
        self.num_batches += 1

    def _merge(self, other) -> None:
        n1, n2 = int(self.num_batches), int(other.num_batches)
        if not self.calibrated:
            self._set(other.min_val.clone(), other.max_val.clone())
        else:
            w = n2 / (n1 + n2)
            self._set(self.min_val + w * (other.min_val - self.min_val),
                      self.max_val + w * (other.max_val - self.max_val))
        self.num_batches += n2


@register("placeholder")
class PlaceholderObserver(StatelessObserver):
    """Marks a tensor for dynamic quantization: records nothing, qparams are
    computed at run time by ``choose_qparams`` in the converted graph
    (``choose_qparams_per_token`` with ``per_token=True``: one scale per row of the
    last dimension; ``granularity`` says which).

    ``eps`` is a float here, as on torchao's ``PlaceholderObserver``: it is written into
    the converted graph as a literal. Under torchao's ``convert_pt2e`` the observer converts
    itself (:meth:`convert`) with the ops ``quantkit.convert`` emits; per-token observers
    convert with ``quantkit.convert`` only.
    """

    def __init__(self, dtype=torch.int8, qscheme=torch.per_tensor_symmetric,
                 is_dynamic: bool = True, per_token: bool = False, **kwargs) -> None:
        super().__init__(dtype=dtype, qscheme=qscheme, is_dynamic=is_dynamic, **kwargs)
        if per_token and (underlying_dtype(dtype) != torch.int8 or qscheme != torch.per_tensor_symmetric):
            raise ValueError("per-token dynamic quantization is symmetric int8; use dtype=torch.int8, per_tensor_symmetric")
        if is_per_channel(qscheme):
            raise ValueError(f"dynamic quantization is per tensor or per token, got qscheme {qscheme}")
        eps = float(self.eps.reshape(-1)[0])
        del self.eps  # the buffer: a literal in the converted graph, not state
        self.eps = eps
        self.per_token = bool(per_token)

    @property
    def granularity(self) -> str:
        return PER_TOKEN if self.per_token else PER_TENSOR

    def calculate_qparams(self):
        raise ConvertError(
            f"observer at node '{self.node_name}' is for dynamic quantization; its qparams are chosen at run time"
        )

    def convert(self, model: torch.fx.GraphModule, observer_node: torch.fx.Node) -> None:
        """Replace ``observer_node`` in ``model`` with run-time choose-qparams, quantize and
        dequantize ops: the hook torchao's ``convert_pt2e`` calls (``quantkit.convert``
        emits the same ops itself).

        Raises:
            ConvertError: for per-token observers, which torchao's ``convert_pt2e`` cannot
                express (its metadata pass knows only per-tensor ``choose_qparams``).
        """
        if self.per_token:
            where = self.node_name if self.node_name != "<unattached>" else observer_node.args[0].name
            raise ConvertError(
                f"per-token dynamic quantization (node '{where}') cannot go through torchao's convert_pt2e, "
                "which knows only per-tensor choose_qparams; convert with quantkit.convert"
            )
        out = emit_dynamic(model.graph, observer_node, self)
        observer_node.replace_all_uses_with(out)
        model.graph.erase_node(observer_node)
