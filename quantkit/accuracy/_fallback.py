"""auto_fallback: keep the fewest layers float that bring the metric drop within a budget."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch
from torch.fx import GraphModule

from ..pipeline._layers import Layer, find_layers, gemm_flops, int8_fraction
from ._metrics import Evaluator, Metric, reiterable, resolve_metric
from ._sensitivity import SensitivityReport, _mode, measure
from ..pipeline._variants import Variants

__all__ = ["auto_fallback", "FallbackReport"]


@dataclass
class FallbackReport:
    """What :func:`auto_fallback` chose and measured.

    Attributes:
        budget: the allowed absolute drop of the metric.
        reference: the float model's own score, ``metric(float_out, float_out)``.
        quantized_score: the score with every layer int8.
        score: the returned model's score, measured afresh after the search.
        float_layers: the layers kept float, most sensitive first.
        int8_gemm_fraction: fraction of GEMM FLOPs (linear, conv, matmul, attention)
            that run in int8 in the returned model, for the first evaluation batch.
        sensitivity: the per-layer ranking the search followed (None when the
            all-int8 model already met the budget).
        trials: every configuration tried, as (float layer names, score), in order.
        quantizer: a quantizer that reproduces the returned model with
            ``quantkit.quantize(model, example_inputs, calib_data, quantizer)``.
    """

    budget: float
    reference: float
    quantized_score: float
    score: float
    float_layers: list[Layer]
    int8_gemm_fraction: float
    sensitivity: SensitivityReport | None
    trials: list[tuple[tuple[str, ...], float]] = field(default_factory=list)
    quantizer: Any = None

    @property
    def drop(self) -> float:
        """``reference - score``."""
        return self.reference - self.score

    @property
    def met(self) -> bool:
        """Whether the returned model's drop is within the budget."""
        return self.drop <= self.budget

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget, "reference": self.reference, "quantized_score": self.quantized_score,
            "score": self.score, "drop": self.drop, "met": self.met,
            "float_layers": [asdict(layer) for layer in self.float_layers],
            "int8_gemm_fraction": self.int8_gemm_fraction,
            "trials": [{"float_layers": list(names), "score": s} for names, s in self.trials],
            "sensitivity": self.sensitivity.to_dict() if self.sensitivity is not None else None,
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        kept = ", ".join(layer.label for layer in self.float_layers) or "none"
        return (f"auto_fallback: drop {self.drop:.4g} (budget {self.budget:.4g}, all-int8 drop "
                f"{self.reference - self.quantized_score:.4g}); float score {self.reference:.6g}, "
                f"score {self.score:.6g}; {len(self.float_layers)} layer(s) kept float: {kept}; "
                f"{100 * self.int8_gemm_fraction:.1f}% of GEMM FLOPs in int8")


def _check_budget(budget) -> float:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be a number (an absolute metric drop), got {type(budget).__name__}")
    if not math.isfinite(budget) or budget < 0:
        raise ValueError(f"budget must be a finite number >= 0, got {budget}")
    return float(budget)


class _Search:
    """Scores configurations (sets of float layers), each at most once."""

    def __init__(self, variants: Variants, evaluator: Evaluator, budget: float) -> None:
        self.variants, self.evaluator, self.budget = variants, evaluator, budget
        self.scores: dict[frozenset, float] = {}
        self.trials: list[tuple[tuple[str, ...], float]] = []

    def score(self, names) -> float:
        key = frozenset(names)
        if key not in self.scores:
            # a scoring copy (no prepare, no convert; see Variants.variant): the result is rebuilt for real
            self.scores[key] = self.evaluator.score(self.variants.variant(key))
            self.trials.append((tuple(names), self.scores[key]))
        return self.scores[key]

    def ok(self, names) -> bool:
        return self.evaluator.reference - self.score(names) <= self.budget

    def shortest_prefix(self, order: list[str]) -> list[str]:
        """Fewest leading layers of ``order`` whose float fallback meets the budget.

        Tries 1, 2, 4, ... layers, then bisects; keeping every layer float always meets it.
        """
        return self._walk(order, 1)

    def prune(self, keep: list[str]) -> list[str]:
        """Verification pass: return each kept layer to int8 (least sensitive first) if the budget still holds."""
        for name in reversed(list(keep)):
            trial = [n for n in keep if n != name]
            if self.ok(trial):
                keep = trial
        return keep

    def cheapest(self, ranking: SensitivityReport, costs: dict[str, float]) -> list[str]:
        """Float layers that meet the budget at a small total ``cost`` (GEMM FLOPs: what a float layer
        adds to the latency, and, for a linear, in proportion to the bytes it adds), in few scorings.

        A knapsack on the ranking's gains (issue 28): one layer's gain is what keeping it alone float
        recovers (skip-one), and the gains of a few small rounding errors add up. Layers are taken by
        gain per cost, the predicted number of them that covers the missing score is scored first,
        and the search walks from there (1, 2, 4, ... layers either way, then bisects) instead of from
        one layer. The kept layers are then returned to int8 one at a time, largest cost first, where
        the measured margin says the budget may still hold (each such return is scored, never assumed).
        """
        gain = {e.layer.name: max(e.sensitivity, 0.0) for e in ranking.ranked}
        names = [e.layer.name for e in ranking.ranked]  # most sensitive first
        known = sorted(c for c in (costs.get(n) for n in names) if c)
        typical = known[len(known) // 2] if known else 1.0
        cost = {n: float(costs.get(n) or typical) for n in names}
        helpful = sorted((n for n in names if gain[n] > 0), key=lambda n: -gain[n] / cost[n])
        order = helpful + [n for n in names if gain[n] <= 0]
        target = self.evaluator.reference - self.budget
        need, total, k = target - self.score(()), 0.0, len(order)
        for i, name in enumerate(order):
            total += gain[name]
            if total >= need:
                k = i + 1
                break
        keep = self._walk(order, k)
        margin = self.score(keep) - target
        for name in sorted(keep, key=lambda n: -cost[n]):
            if len(keep) > 1 and gain[name] <= margin:
                trial = [n for n in keep if n != name]
                if self.ok(trial):
                    keep, margin = trial, self.score(trial) - target
        return keep

    def _walk(self, order: list[str], k: int) -> list[str]:
        """The shortest prefix of ``order`` meeting the budget, searched from a guess of ``k`` layers
        (the empty prefix is known to fail; all of them float always meets it)."""
        n = len(order)
        k = max(1, min(k, n))
        if self.ok(order[:k]):
            hi, step, lo = k, 1, k - 1
            while lo > 0 and self.ok(order[:lo]):
                hi, step = lo, step * 2
                lo = max(0, hi - step)
        else:
            lo, step, hi = k, 1, min(n, k + 1)
            while hi < n and not self.ok(order[:hi]):
                lo, step = hi, step * 2
                hi = min(n, lo + step)
        while hi - lo > 1:  # order[:lo] fails, order[:hi] meets it
            mid = (lo + hi) // 2
            if self.ok(order[:mid]):
                hi = mid
            else:
                lo = mid
        return order[:hi]


def auto_fallback(model: torch.nn.Module, example_inputs: Any, calib_data: Iterable, eval_data: Iterable,
                  metric: str | Metric, budget: float, quantizer=None, *, mode: str = "skip-one",
                  progress: bool = False) -> tuple[GraphModule, FallbackReport]:
    """Quantize ``model``, keeping a small set of layers float so the metric drop stays within ``budget``.

    1. Calibrate once and score the all-int8 model; if its drop is within the budget, done.
    2. Rank the layers by sensitivity (see :func:`quantkit.sensitivity`).
    3. Greedily keep the most sensitive layers float: the fewest leading layers of the
       ranking that meet the budget.
    4. Verification: try returning each kept layer to int8, least sensitive first,
       keeping it int8 when the budget still holds; then build the final model and
       measure it afresh: that measurement is the reported score.

    ``model`` is not modified; the returned model is new.

    Args:
        model: the float model.
        example_inputs: one batch to capture it with.
        calib_data: calibration batches.
        eval_data: evaluation batches (keep them apart from your test data).
        metric: ``metric(float_output, quantized_output) -> float``, higher is better,
            or ``"cosine"``, ``"kl"``, ``"top1"``, ``"module:function"``.
        budget: the allowed absolute drop, ``metric(f, f) - metric(f, q)`` averaged
            over the evaluation batches (e.g. 0.002 of mean cosine).
        quantizer: defaults to ``W8A8Quantizer()``.
        mode: the sensitivity ranking to follow, ``"skip-one"`` (default) or ``"quantize-one"``.
        progress: show a progress bar while measuring sensitivities.

    Returns:
        ``(quantized_model, report)``: the converted GraphModule (the float captured
        graph if every layer had to stay float) and a :class:`FallbackReport`.

    Example:
        >>> qmodel, report = quantkit.auto_fallback(model, (x[:8],), calib, evals, "cosine", budget=0.002)
        >>> print(report)
    """
    budget = _check_budget(budget)
    mode = _mode(mode)
    metric = resolve_metric(metric)
    variants = Variants(model, example_inputs, reiterable(calib_data, "calibration"), quantizer)
    evaluator = Evaluator(model, eval_data, metric)
    search = _Search(variants, evaluator, budget)
    quantized_score = search.score(())
    ranking = None
    keep: list[str] = []
    if not search.ok(()):
        ranking = measure(variants, evaluator, mode, quantized_score, progress=progress)
        keep = search.prune(search.shortest_prefix([layer.name for layer in ranking.layers]))
    final = variants.build(keep)
    score = evaluator.score(final)  # the verified, reported measurement
    by_name = {layer.name: layer for layer in variants.layers}
    flops = gemm_flops(variants.float_graph, next(iter(evaluator.data)))
    report = FallbackReport(
        budget=budget, reference=evaluator.reference, quantized_score=quantized_score, score=score,
        float_layers=[by_name[n] for n in keep],
        int8_gemm_fraction=int8_fraction(flops, find_layers(final)),
        sensitivity=ranking, trials=search.trials, quantizer=variants.quantizer_for(keep),
    )
    return final, report
