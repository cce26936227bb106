"""autotune: the fastest quantization recipe that meets an accuracy target.

Recipes are tried from the fastest expected to the most accurate (:data:`RECIPES`); each is
built, scored on held-out data, and the first that meets the target wins -- unless a later
recipe could still be faster by *measurement*: every recipe that meets the target has its
compiled latency measured on this machine (cached per model, input shapes and lowered graph,
see :mod:`._latency`), and a later recipe is only tried when the measured latency of its kind
of lowering (a lower bound for it) beats the winner's. The report lists every recipe tried with
its metric and latency, and why the winner won.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.fx import GraphModule

from .._errors import QuantkitError
from ..quantizers._config import QuantConfig
from ..quantizers._scheme import get_scheme
from ._metrics import Evaluator, reiterable

__all__ = ["AutoRecipe", "RECIPES", "Trial", "AutotuneReport", "autotune", "search", "recipe_names",
           "fallback_search", "DEFAULT_TARGETS"]

# default targets per metric (issue 17): embeddings / regression outputs held-out mean cosine
# >= 0.999; classifiers top-1 agreement >= 99%
DEFAULT_TARGETS = {"cosine": 0.999, "top1": 0.99}
# a later recipe is tried only if its lower bound is this much faster than the winner
# (two medians of a few compiled calls differ by a few percent on a quiet machine)
SPEED_MARGIN = 0.05


@dataclass(frozen=True)
class AutoRecipe:
    """One candidate recipe: a scheme (a registered :class:`~quantkit.quantizers.QuantConfig` preset or
    a variant of one), SmoothQuant before it, and whether the most sensitive layers fall back to float."""

    name: str
    summary: str
    scheme: QuantConfig = field(default_factory=lambda: get_scheme("w8a8"))
    smoothquant: float | str | None = None
    fallback: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, QuantConfig):
            raise TypeError(f"an autotune recipe's scheme is a QuantConfig, got {type(self.scheme).__name__}")

    # the scheme's fields the command line's recipe takes (cli/_autotune.py)
    @property
    def act_observer(self) -> str:
        return self.scheme.act_observer

    @property
    def dynamic(self) -> bool:
        return self.scheme.dynamic

    @property
    def granularity(self) -> str:
        return self.scheme.granularity.value

    @property
    def weight_algorithm(self) -> str:
        return self.scheme.weight_algorithm

    @property
    def lowering(self) -> str:
        """The kind of compiled graph the recipe gives: recipes of one kind lower to the same
        kernels (a fallback recipe is static with some layers float: static is its lower bound)."""
        if self.dynamic:
            return "per-token" if self.granularity == "per-token" else "dynamic"
        return "static"

    def config(self, ops=None) -> QuantConfig:
        """The scheme, restricted to the op families ``ops`` when given."""
        return self.scheme if ops is None else dataclasses.replace(self.scheme, ops=frozenset(ops))


_STATIC, _PER_TOKEN = get_scheme("w8a8"), get_scheme("w8a8-per-token")
_ALL = (
    AutoRecipe("static", "static per-tensor activations, min-max ranges", _STATIC),
    AutoRecipe("static-smoothquant", "SmoothQuant (alpha 0.5), then static per-tensor", _STATIC, smoothquant=0.5),
    AutoRecipe("histogram", "static per-tensor activations, histogram (L2-optimal) ranges",
               dataclasses.replace(_STATIC, act_observer="histogram")),
    AutoRecipe("per-token", "dynamic per-token activations", _PER_TOKEN),
    AutoRecipe("per-token-smoothquant", "SmoothQuant (alpha auto), then dynamic per-token", _PER_TOKEN,
               smoothquant="auto"),
    AutoRecipe("gptq", "static per-tensor activations, GPTQ-rounded weights",
               dataclasses.replace(_STATIC, weight_algorithm="gptq")),
    AutoRecipe("fallback", "the most accurate static recipe with its most sensitive layers float", _STATIC,
               fallback=True),
)


def _supported(r: AutoRecipe) -> bool:
    """GPTQ is offered where ``QuantConfig(weight_algorithm="gptq")`` exists (W8A8 weight observers
    then declare it and ``quantkit.calibrate`` rounds the weights)."""
    try:
        r.config()
    except (TypeError, ValueError):
        return False
    return True


RECIPES: dict[str, AutoRecipe] = {r.name: r for r in _ALL if _supported(r)}


def recipe_names() -> list[str]:
    """The recipe names, fastest expected first."""
    return list(RECIPES)


@dataclass
class Trial:
    """One recipe tried: its held-out metric, compiled latency (ms, None when not measured)
    and what happened (``met``, ``below target``, ``skipped: ...``, ``failed: ...``)."""

    recipe: str
    status: str
    score: float | None = None
    latency_ms: float | None = None
    seconds: float = 0.0
    details: dict = field(default_factory=dict)


@dataclass
class AutotuneReport:
    """What :func:`autotune` tried and chose.

    Attributes:
        metric: the metric's name; ``target``: the score a recipe must reach (higher is better).
        chosen: the returned recipe's name; ``met``: whether it meets the target (when no
            recipe does, the best-scoring one is returned and ``met`` is False).
        reason: one sentence on why it won.
        trials: every recipe in order, tried or skipped.
        eval_source: where the held-out data came from.
        speed: compiled latencies (ms) of the chosen model and, when measured, fp32 and bf16.
        notes: latency-cache entries (or the cache file) that were ignored and measured again, one
            line each (a cache is data: only finite positive latencies are taken from it).
    """

    metric: str
    target: float
    chosen: str
    met: bool
    reason: str
    trials: list[Trial]
    eval_source: str = ""
    speed: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def chosen_trial(self) -> Trial:
        return next(t for t in self.trials if t.recipe == self.chosen)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["trials"] = [asdict(t) for t in self.trials]
        return d

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [f"autotune: {self.chosen} ({'meets' if self.met else 'does NOT meet'} {self.metric} >= "
                 f"{self.target:g}); {self.reason}"]
        for t in self.trials:
            score = "-" if t.score is None else f"{t.score:.5f}"
            lat = "-" if t.latency_ms is None else f"{t.latency_ms:.2f} ms"
            lines.append(f"  {t.recipe:<24} {score:>9} {lat:>12}  {t.status}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def search(recipes: Sequence[AutoRecipe], evaluate: Callable[[AutoRecipe, list[Trial]], tuple[Any, float, dict]],
           target: float, *, latency: Callable[[AutoRecipe, Any], float] | None = None,
           lower_bound: Callable[[AutoRecipe], float | None] | None = None,
           say: Callable[[str], None] | None = None) -> tuple[Any, list[Trial], int, str]:
    """The search itself, independent of models: returns ``(model, trials, chosen index, reason)``.

    ``evaluate(recipe, trials_so_far) -> (model, score, details)`` builds and scores a recipe;
    ``latency(recipe, model)`` measures a compiled model (ms); ``lower_bound(recipe)`` is the
    measured latency of the recipe's kind of lowering, or None when unknown. Recipes run in
    order; the first meeting ``target`` wins, and a later recipe is tried only when its lower
    bound is at least :data:`SPEED_MARGIN` faster than the winner (then the faster one that
    meets the target wins). Without ``latency`` the first recipe meeting the target wins.
    With ``lower_bound``, the order is first sorted (stably) by the measured latency of each
    recipe's kind of lowering: the order is measured, not assumed (on a CPU without an int8
    per-token kernel, a static recipe with float fallback comes before per-token ones).
    A recipe that raises a ValueError/RuntimeError is recorded as failed and skipped.
    """
    trials: list[Trial] = []
    models: dict[int, Any] = {}
    winner: int | None = None
    if latency is not None and lower_bound is not None:
        bounds = {r.lowering: lower_bound(r) for r in recipes}
        recipes = sorted(recipes, key=lambda r: math.inf if bounds[r.lowering] is None else bounds[r.lowering])
    for recipe in recipes:
        if winner is not None:
            best = trials[winner]
            if latency is None or best.latency_ms is None:
                trials.append(Trial(recipe.name, f"skipped: {best.recipe} already meets the target"))
                continue
            bound = lower_bound(recipe) if lower_bound is not None else None
            if bound is None or bound >= best.latency_ms * (1 - SPEED_MARGIN):
                why = ("its kind of lowering is not measured" if bound is None else
                       f"its {recipe.lowering} lowering takes {bound:.2f} ms, not faster than {best.latency_ms:.2f} ms")
                trials.append(Trial(recipe.name, f"skipped: cannot beat {best.recipe} ({why})"))
                continue
        t0 = time.perf_counter()
        try:
            model, score, details = evaluate(recipe, trials)
        except (ValueError, RuntimeError, TypeError) as exc:  # QuantkitError is a ValueError
            msg = " ".join(str(exc).split())[:200] or type(exc).__name__
            trials.append(Trial(recipe.name, f"failed: {msg}", seconds=round(time.perf_counter() - t0, 2)))
            continue
        if not math.isfinite(score):
            score = -math.inf
        trial = Trial(recipe.name, "met" if score >= target else "below target", score,
                      seconds=round(time.perf_counter() - t0, 2), details=details)
        trials.append(trial)
        models[len(trials) - 1] = model
        if say is not None:
            say(f"autotune: {recipe.name}: {score:.5f} ({trial.status})")
        if score < target:
            continue
        if latency is not None:
            trial.latency_ms = latency(recipe, model)
        if winner is None or (trial.latency_ms is not None and trials[winner].latency_ms is not None
                              and trial.latency_ms < trials[winner].latency_ms * (1 - SPEED_MARGIN)):
            winner = len(trials) - 1
        for i in list(models):  # keep only the winner's model alive (memory)
            if i != winner:
                del models[i]
    scored = [i for i, t in enumerate(trials) if t.score is not None]
    if winner is not None:
        w = trials[winner]
        first = next(i for i, t in enumerate(trials) if t.status == "met")
        if first == winner:
            earlier = [t.recipe for t in trials[:winner] if t.score is not None]
            reason = (f"the first recipe meeting the target ({w.score:.5f} >= {target:g})"
                      + (f"; {', '.join(earlier)} fell short" if earlier else ""))
            if w.latency_ms is not None:
                reason += f"; compiled {w.latency_ms:.2f} ms"
        else:
            reason = (f"meets the target ({w.score:.5f} >= {target:g}) and is measurably faster than "
                      f"{trials[first].recipe} ({w.latency_ms:.2f} vs {trials[first].latency_ms:.2f} ms)")
        return models[winner], trials, winner, reason
    if not scored:
        raise QuantkitError("autotune: every recipe failed: " + "; ".join(f"{t.recipe}: {t.status}" for t in trials))
    best = max(scored, key=lambda i: trials[i].score)
    # the best model was dropped above unless it is still held: rebuild it
    model = models.get(best)
    if model is None:
        model, _, _ = evaluate(next(r for r in recipes if r.name == trials[best].recipe), trials[:best])
    reason = (f"no recipe meets the target {target:g}; {trials[best].recipe} scores best "
              f"({trials[best].score:.5f})")
    return model, trials, best, reason


def fallback_search(variants, evaluator, budget: float, *, rank_evaluator=None, progress: bool = False):
    """Keep the fewest most-sensitive layers float so ``evaluator`` drops at most ``budget``:
    the search of :func:`quantkit.auto_fallback`, for any evaluator with ``reference``,
    ``score(model)`` and ``data``; ``rank_evaluator`` (e.g. fewer batches) ranks the layers
    (one evaluation per layer), ``evaluator`` decides. Returns ``(model, float layer names, score)``."""
    from ._fallback import _Search
    from ._sensitivity import SensitivityMode, measure

    s = _Search(variants, evaluator, budget)
    keep: list[str] = []
    if not s.ok(()):
        rank = rank_evaluator or evaluator
        ranking = measure(variants, rank, SensitivityMode.SKIP_ONE, None if rank_evaluator else s.score(()),
                          progress=progress)
        keep = s.prune(s.shortest_prefix([layer.name for layer in ranking.layers]))
    if keep and len(keep) == len(variants.layers):
        raise ValueError(f"the fallback keeps every one of the {len(keep)} layers float (nothing left to "
                         "quantize); the target is out of reach for int8")
    model = variants.build(keep)
    return model, keep, s.score(keep)


def _best_static(trials: list[Trial]) -> AutoRecipe:
    """The most accurate static recipe tried so far (the base a fallback keeps fast)."""
    static = [t for t in trials if t.score is not None and t.recipe in RECIPES
              and RECIPES[t.recipe].lowering == "static" and not RECIPES[t.recipe].fallback]
    if not static:
        return RECIPES["static"]
    return RECIPES[max(static, key=lambda t: t.score).recipe]


def _split(calib: list, eval_data) -> tuple[list, list, str]:
    if eval_data is not None:
        return calib, list(reiterable(eval_data, "evaluation")), "eval_data"
    if len(calib) < 2:
        return calib, calib, "the calibration batch itself (one batch: nothing to hold out; pass eval_data)"
    k = max(1, round(len(calib) * 0.2))  # the last 20% of the batches, never calibrated on
    return calib[:-k], calib[-k:], f"the last {k} of {len(calib)} calibration batches, held out"


def autotune(model: torch.nn.Module, example_inputs: Any, calib: Iterable, eval_data: Iterable | None = None,
             metric="cosine", target: float = 0.999, *, recipes: Sequence[str] | None = None,
             measure_latency: bool = True, compare_speed: bool = False, progress: bool = False):
    """Quantize ``model`` with the fastest recipe that meets an accuracy target.

    Tries :data:`RECIPES` from the fastest expected to the most accurate -- static per-tensor,
    static + SmoothQuant, histogram observers, per-token dynamic, SmoothQuant-auto + per-token,
    (GPTQ weights where available), float fallback of the most sensitive layers -- and stops at
    the first whose held-out score meets ``target``; a later recipe is still tried when the
    measured latency of its kind of lowering could beat the winner's (see :func:`search`).

    Args:
        model: the float model (or a GraphModule from :func:`quantkit.capture`).
        example_inputs: one batch to capture it with.
        calib: calibration batches.
        eval_data: held-out batches; default: the last 20% of ``calib`` (never calibrated on).
        metric: ``"cosine"`` (default), ``"top1"``, ``"kl"``, ``"module:function"`` or a
            callable ``metric(float_output, quantized_output) -> float``, higher is better.
        target: the score to reach: 0.999 mean cosine by default; for classifiers use
            ``metric="top1", target=0.99``.
        recipes: names from :data:`RECIPES` to try, in order (default: all).
        measure_latency: compile and time each recipe meeting the target (cached, see
            ``quantkit.accuracy._latency``); False: the first meeting the target wins.
        compare_speed: also time compiled fp32 and bf16 float models for the report.
        progress: print one line per recipe.

    Returns:
        ``(qmodel, report)``: the converted GraphModule (``quantkit.compile`` it to run fast)
        and an :class:`AutotuneReport`. When no recipe meets the target, the best-scoring one
        is returned with a warning and ``report.met`` False.

    Example:
        >>> qmodel, report = quantkit.autotune(model, (x,), calib)
        >>> print(report); fast = quantkit.compile(qmodel)
    """
    import warnings

    from quantkit.pipeline._capture import capture
    from quantkit.pipeline._variants import Variants
    from quantkit.quantizers import W8A8Quantizer

    from . import _latency
    from ._smoothquant import smooth_quant

    if not isinstance(target, (int, float)) or not math.isfinite(target):
        raise ValueError(f"target must be a finite number, got {target!r}")
    chosen = _pick(recipes)
    calib, heldout, source = _split(list(reiterable(calib, "calibration")), eval_data)
    if not calib:
        raise ValueError("calibration data is empty; pass at least one batch")
    gm = model if isinstance(model, GraphModule) else capture(model, example_inputs)
    evaluator = Evaluator(model, heldout, metric)
    smoothed: dict = {}

    def base_graph(r: AutoRecipe):
        if r.smoothquant is None:
            return gm
        key = (r.smoothquant, r.lowering)
        if key not in smoothed:
            smoothed[key] = smooth_quant(gm, calib, alpha=r.smoothquant, config=r.config())
        return smoothed[key]

    def evaluate(r: AutoRecipe, trials):
        if r.fallback:
            base = _best_static(trials)
            variants = Variants(base_graph(base), None, calib, W8A8Quantizer(base.config()))
            q, keep, score = fallback_search(variants, evaluator, evaluator.reference - target)
            labels = {layer.name: layer.label for layer in variants.layers}
            return q, score, {"base": base.name, "float_layers": [labels[n] for n in keep]}
        from quantkit.pipeline._api import quantize

        q = quantize(base_graph(r), example_inputs, calib, W8A8Quantizer(r.config()), progress=False)
        return q, evaluator.score(q), {}

    meter = _latency.Meter(gm, example_inputs) if measure_latency else None
    say = print if progress else None
    qmodel, trials, best, reason = search(
        chosen, evaluate, target, latency=(lambda r, q: meter.int8(q, r.lowering)) if meter else None,
        lower_bound=(lambda r: meter.kind(r.lowering, lambda: _quick(r, gm, example_inputs, calib)))
        if meter else None, say=say)
    name = getattr(metric, "__name__", str(metric))
    report = AutotuneReport(name, float(target), trials[best].recipe, trials[best].status == "met", reason,
                            trials, source)
    if meter is not None and trials[best].latency_ms is None:
        trials[best].latency_ms = meter.int8(qmodel, RECIPES.get(trials[best].recipe, chosen[0]).lowering)
    report.speed = {"int8_ms": trials[best].latency_ms}
    if compare_speed and meter is not None:
        try:
            report.speed.update(meter.floats(model))
        except Exception as exc:  # e.g. a graph with float32 constants baked in cannot run in bf16
            report.speed["error"] = " ".join(str(exc).split())[:150] or type(exc).__name__
    report.notes = list(meter.notes) if meter is not None else []
    if not report.met:
        warnings.warn(f"autotune: {reason}; returning it anyway", stacklevel=2)
    return qmodel, report


def _quick(r: AutoRecipe, gm, example_inputs, calib):
    """A model of ``r``'s kind of lowering for timing alone: calibrated on one batch."""
    from quantkit.pipeline._api import quantize
    from quantkit.quantizers import W8A8Quantizer

    base = RECIPES["static"] if r.fallback else r
    return quantize(gm, example_inputs, calib[:1], W8A8Quantizer(QuantConfig(dynamic=base.dynamic,
                                                                             granularity=base.granularity)),
                    progress=False)


def _pick(names: Sequence[str] | None) -> list[AutoRecipe]:
    if names is None:
        return list(RECIPES.values())
    if isinstance(names, str):
        names = [names]
    unknown = [n for n in names if n not in RECIPES]
    if unknown or not names:
        raise ValueError(f"unknown recipe {unknown[0] if unknown else '(none)'!r}; choose from {', '.join(RECIPES)}")
    return [RECIPES[n] for n in names]
