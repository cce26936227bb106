"""Observers: modules that watch tensors during calibration and choose qparams.

Each observer is registered by name (``quantkit.observers.get("minmax")``), can be
used as ``observer_or_fake_quant_ctr`` in a ``QuantizationSpec``, and can merge the
state of another observer of its kind (``obs.merge(other)``).
"""

from ._base import PER_CHANNEL, PER_TENSOR, PER_TOKEN, QuantkitObserver, declared_qscheme
from ._groupwise import PER_GROUP, GroupwiseWeightObserver
from ._hessian import HessianObserver
from ._histogram import HistogramMethod, HistogramObserver, PerChannelMSEObserver
from ._minmax import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
    PlaceholderObserver,
)
from ._fake_quant import FakeQuantize
from ._registry import available, get, register
from ._special import DerivedObserver, FixedQParamsObserver
from ._sync import sync

__all__ = [
    "QuantkitObserver",
    "declared_qscheme",
    "PER_TENSOR",
    "PER_CHANNEL",
    "PER_TOKEN",
    "PER_GROUP",
    "GroupwiseWeightObserver",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "PerChannelMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "PlaceholderObserver",
    "FixedQParamsObserver",
    "DerivedObserver",
    "FakeQuantize",
    "HessianObserver",
    "HistogramMethod",
    "HistogramObserver",
    "PerChannelMSEObserver",
    "register",
    "get",
    "available",
    "sync",
]
