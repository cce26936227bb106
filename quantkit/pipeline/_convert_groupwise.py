"""Former home of convert's group-wise path; it lives in :mod:`quantkit.pipeline.emit._groupwise`
(kind ``"groupwise"``) and the op set in :mod:`quantkit._graph`. These names stay importable from here."""

from __future__ import annotations

from .._graph import GROUPWISE_DEQUANTIZE_OPS
from .._qdq import PER_GROUP
from .emit._groupwise import emit_groupwise

__all__ = ["is_groupwise", "emit_groupwise", "GROUPWISE_DEQUANTIZE_OPS"]


def is_groupwise(obs) -> bool:
    """Whether ``obs`` declares one scale per group of input features (``granularity``)."""
    return getattr(obs, "granularity", None) == PER_GROUP
