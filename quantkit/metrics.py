"""Metrics for :func:`quantkit.sensitivity` and :func:`quantkit.auto_fallback`.

A metric is ``metric(float_output, quantized_output) -> float``, higher is better.
The APIs also take these by name (``"cosine"``, ``"kl"``, ``"top1"``) or as
``"module:function"`` for your own.
"""

from .accuracy._metrics import METRICS, embedding_cosine, logits_kl, resolve_metric, top1_agreement

__all__ = ["embedding_cosine", "logits_kl", "top1_agreement", "METRICS", "resolve_metric"]
