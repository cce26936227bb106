"""sensitivity: how much each quantized layer costs in the user's metric."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Iterable

import torch

from ..pipeline._layers import Layer
from ._metrics import Evaluator, Metric, reiterable, resolve_metric
from ..pipeline._variants import Resumed, Variants

__all__ = ["sensitivity", "SensitivityMode", "SensitivityReport", "LayerSensitivity"]


class SensitivityMode(str, Enum):
    """``quantize-one``: only that layer int8, drop against float. ``skip-one``: every
    layer int8 but that one, metric recovered against the all-int8 model."""

    QUANTIZE_ONE = "quantize-one"
    SKIP_ONE = "skip-one"


def _mode(mode) -> SensitivityMode:
    try:
        return SensitivityMode(mode)
    except ValueError:
        raise ValueError(f"unknown sensitivity mode {mode!r}; use 'quantize-one' or 'skip-one'") from None


@dataclass(frozen=True)
class LayerSensitivity:
    """One layer's measurement: ``score`` is the metric of the variant, ``sensitivity``
    the metric lost to quantizing this layer (higher = more sensitive)."""

    layer: Layer
    score: float
    sensitivity: float


@dataclass
class SensitivityReport:
    """Per-layer sensitivities, most sensitive first.

    Attributes:
        mode: how each layer was measured (see :class:`SensitivityMode`).
        reference: the float model's own score, ``metric(float_out, float_out)``.
        quantized_score: the score with every layer int8.
        ranked: one :class:`LayerSensitivity` per layer, most sensitive first.
    """

    mode: SensitivityMode
    reference: float
    quantized_score: float
    ranked: list[LayerSensitivity]

    @property
    def layers(self) -> list[Layer]:
        """The layers, most sensitive first."""
        return [entry.layer for entry in self.ranked]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "reference": self.reference,
            "quantized_score": self.quantized_score,
            "ranked": [{**asdict(e.layer), "score": e.score, "sensitivity": e.sensitivity} for e in self.ranked],
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [f"sensitivity ({self.mode.value}); float score {self.reference:.6g}, "
                 f"all-int8 score {self.quantized_score:.6g}",
                 f"{'rank':>4}  {'layer':<48} {'op':<7} {'score':>12} {'sensitivity':>12}"]
        for i, e in enumerate(self.ranked, 1):
            lines.append(f"{i:>4}  {e.layer.label[:48]:<48} {e.layer.op:<7} {e.score:>12.6g} {e.sensitivity:>12.4g}")
        return "\n".join(lines)

    def plot(self, ax=None, top: int | None = None):
        """Horizontal bar chart of the sensitivities (most sensitive at the top); returns the Axes."""
        import matplotlib.pyplot as plt

        entries = self.ranked[:top] if top else self.ranked
        if ax is None:
            _, ax = plt.subplots(figsize=(7, max(2.0, 0.28 * len(entries) + 1)))
        labels = [e.layer.label for e in entries][::-1]
        ax.barh(range(len(entries)), [e.sensitivity for e in entries][::-1])
        ax.set_yticks(range(len(entries)), labels, fontsize=7)
        ax.set_xlabel("metric drop" if self.mode is SensitivityMode.QUANTIZE_ONE else "metric recovered when float")
        ax.set_title(f"per-layer sensitivity ({self.mode.value})")
        ax.figure.tight_layout()
        return ax


def measure(variants: Variants, evaluator: Evaluator, mode: SensitivityMode,
            quantized_score: float | None = None, progress: bool = False) -> SensitivityReport:
    """Sensitivity of every layer of ``variants`` (shared by sensitivity and auto_fallback)."""
    names = [layer.name for layer in variants.layers]
    if quantized_score is None:
        quantized_score = evaluator.score(variants.quantized)
    from tqdm.auto import tqdm

    def keep(layer):
        return [n for n in names if n != layer.name] if mode is SensitivityMode.QUANTIZE_ONE else [layer.name]

    # skip-one variants differ from the all-int8 graph from their one float layer on: each is run
    # from there on the all-int8 graph's values (Resumed: the same ops on the same values)
    resumed = Resumed(variants.variant(())) if mode is SensitivityMode.SKIP_ONE else None
    models = [variants.variant(keep(layer)) for layer in variants.layers]
    if resumed is not None:
        models = [resumed.plan(m) for m in models]
    entries = []
    for layer, model in tqdm(list(zip(variants.layers, models)), desc="sensitivity", unit="layer",
                             disable=not progress, leave=False):
        score = evaluator.score(model)
        if mode is SensitivityMode.QUANTIZE_ONE:
            entries.append(LayerSensitivity(layer, score, evaluator.reference - score))
        else:
            entries.append(LayerSensitivity(layer, score, score - quantized_score))
    # stable: ties keep graph order
    entries.sort(key=lambda e: -e.sensitivity)
    return SensitivityReport(mode, evaluator.reference, quantized_score, entries)


def sensitivity(model: torch.nn.Module, example_inputs: Any, calib_data: Iterable, eval_data: Iterable,
                metric: str | Metric, quantizer=None, mode: str = "quantize-one", *,
                progress: bool = False) -> SensitivityReport:
    """Measure how much each quantized layer costs in ``metric``, ranked.

    The model is calibrated once; each layer's variant reuses those statistics (they
    do not depend on which other layers are quantized). ``model`` is not modified.

    Args:
        model: the float model.
        example_inputs: one batch to capture it with.
        calib_data: calibration batches.
        eval_data: evaluation batches; the metric is averaged over them.
        metric: ``metric(float_output, quantized_output) -> float`` (higher is better),
            or ``"cosine"``, ``"kl"``, ``"top1"``, ``"module:function"``.
        quantizer: defaults to ``W8A8Quantizer()``; its quantized ops are the layers.
        mode: ``"quantize-one"``: quantize that layer alone, sensitivity = float score
            − score. ``"skip-one"``: quantize all but that layer, sensitivity = score −
            all-int8 score.
        progress: show a progress bar over layers.

    Returns:
        A :class:`SensitivityReport`; ``print`` it, or ``.plot()`` it.

    Example:
        >>> report = quantkit.sensitivity(model, (x[:8],), calib, evals, "cosine")
        >>> report.ranked[0].layer.module
        'encoder.layer.3.output.dense'
    """
    mode = _mode(mode)
    metric = resolve_metric(metric)  # fail on a bad metric before calibrating
    variants = Variants(model, example_inputs, reiterable(calib_data, "calibration"), quantizer)
    evaluator = Evaluator(model, eval_data, metric)  # after capture: the model is in eval mode
    return measure(variants, evaluator, mode, progress=progress)
