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
from .._graph import get_attr
from ..pipeline._variants import SCORING_WEIGHTS_META_KEY
from ..quantizers._config import QuantConfig
from ..quantizers._scheme import get_scheme
from ._metrics import Evaluator, reiterable

__all__ = ["AutoRecipe", "RECIPES", "Trial", "AutotuneReport", "autotune", "search", "recipe_names",
           "fallback_search", "DEFAULT_TARGETS", "fastest", "mark_pareto", "model_bytes", "speed_verdict",
           "float_baseline", "FALLBACK_WEIGHTS", "fallback_with_weights", "best_base", "auto_recipes",
           "fallback_weights"]

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
    # offered by the auto search only where oneDNN's int8 GEMMs saturate 8-bit data (no VNNI/AMX: an
    # AVX2-only CPU); its 7-bit weights are what makes them exact there (lowering/_onednn.exact_for_graph)
    only_without_vnni: bool = False
    # tried by ``auto`` (False: only when named, ``--recipe NAME`` / ``recipes=[...]``)
    in_auto: bool = True

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
    def weight_bits(self) -> int:
        return self.scheme.weight_bits

    @property
    def lowering(self) -> str:
        """The kind of compiled graph the recipe gives: recipes of one kind lower to the same
        kernels (a fallback recipe is static with some layers float: static is its lower bound)."""
        kind = ("per-token" if self.granularity == "per-token" else "dynamic") if self.dynamic else "static"
        # narrower weights lower to other kernels on CPUs without VNNI (oneDNN's, instead of the reference)
        return kind if self.weight_bits == 8 else f"{kind}-w{self.weight_bits}"

    def config(self, ops=None) -> QuantConfig:
        """The scheme, restricted to the op families ``ops`` when given."""
        return self.scheme if ops is None else dataclasses.replace(self.scheme, ops=frozenset(ops))


_STATIC, _PER_TOKEN = get_scheme("w8a8"), get_scheme("w8a8-per-token")
# 7-bit weights (-64..63): on AVX2 oneDNN's u8 x s8 pair sums then fit int16 with 8-bit activations
_STATIC_W7, _PER_TOKEN_W7 = dataclasses.replace(_STATIC, weight_bits=7), dataclasses.replace(_PER_TOKEN, weight_bits=7)
_ALL = (
    AutoRecipe("static", "static per-tensor activations, min-max ranges", _STATIC),
    AutoRecipe("static-smoothquant", "SmoothQuant (alpha 0.5), then static per-tensor", _STATIC, smoothquant=0.5),
    AutoRecipe("histogram", "static per-tensor activations, histogram (L2-optimal) ranges",
               dataclasses.replace(_STATIC, act_observer="histogram")),
    AutoRecipe("per-token", "dynamic per-token activations", _PER_TOKEN),
    AutoRecipe("per-token-smoothquant", "SmoothQuant (alpha auto), then dynamic per-token", _PER_TOKEN,
               smoothquant="auto"),
    AutoRecipe("per-token-fallback", "the most accurate per-token recipe with its most sensitive layers float",
               _PER_TOKEN, fallback=True),
    AutoRecipe("gptq", "static per-tensor activations, GPTQ-rounded weights",
               dataclasses.replace(_STATIC, weight_algorithm="gptq")),
    AutoRecipe("fallback", "the most accurate static recipe with its most sensitive layers float", _STATIC,
               fallback=True),
    # CPUs without VNNI/AMX (AVX2): the 8-bit recipes above run their reference graphs there (fp32
    # GEMMs), these run oneDNN's int8 GEMM exactly (MiniLM on a Zen 3: per-token 1.48x fp32 compiled)
    AutoRecipe("histogram-w7", "static per-tensor activations, histogram ranges, 7-bit weights",
               dataclasses.replace(_STATIC_W7, act_observer="histogram"), only_without_vnni=True),
    AutoRecipe("per-token-w7", "dynamic per-token activations, 7-bit weights", _PER_TOKEN_W7,
               only_without_vnni=True),
    AutoRecipe("per-token-smoothquant-w7", "SmoothQuant (alpha auto), then dynamic per-token, 7-bit weights",
               _PER_TOKEN_W7, smoothquant="auto", only_without_vnni=True),
    AutoRecipe("per-token-fallback-w7", "the most accurate 7-bit-weight per-token recipe with its most sensitive "
               "layers float", _PER_TOKEN_W7, fallback=True, only_without_vnni=True),
    # not in auto: on MiniLM (Zen 3) it met only with 29 of 36 layers float, 110 ms against
    # per-token-fallback-w7's 8 layers and 88 ms, and cost the search 28 s (BENCHMARKS, "AVX2 ...")
    AutoRecipe("fallback-w7", "the most accurate 7-bit-weight static recipe with its most sensitive layers float",
               _STATIC_W7, fallback=True, only_without_vnni=True, in_auto=False),
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


def auto_recipes() -> list[AutoRecipe]:
    """The recipes ``auto`` tries on this CPU: the ``in_auto`` ones, less the ``only_without_vnni`` ones
    where oneDNN accumulates 8-bit data exactly (VNNI/AMX: there they are only less accurate, never faster)."""
    from ..lowering._onednn import exact_on_this_cpu

    exact = exact_on_this_cpu()
    return [r for r in RECIPES.values() if r.in_auto and not (r.only_without_vnni and exact)]


@dataclass
class Trial:
    """One recipe tried: its held-out metric, compiled latency (ms, None when not measured), the
    size of its tensors (bytes), whether it is on the Pareto front of (accuracy, latency, size)
    among the candidates scored (None when it lacks one of the three), and what happened (``met``,
    ``below target``, ``skipped: ...``, ``failed: ...``)."""

    recipe: str
    status: str
    score: float | None = None
    latency_ms: float | None = None
    seconds: float = 0.0
    details: dict = field(default_factory=dict)
    size_bytes: int | None = None
    pareto: bool | None = None


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
        verdict: one line when the chosen model is slower than the float model compiled in bf16
            (fp32 where this CPU has no native BF16), naming the best alternative (see
            :func:`speed_verdict`); None otherwise. ``trials`` marks the Pareto front (``*``).
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
    verdict: str | None = None

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
            size = "-" if t.size_bytes is None else f"{t.size_bytes / 1e6:.1f} MB"
            front = " *" if t.pareto else "  "
            lines.append(f"  {t.recipe:<24} {score:>9} {lat:>12} {size:>9}{front} {t.status}")
        if self.verdict:
            lines.append(f"  {self.verdict}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _by_bound(recipes: Sequence[AutoRecipe], bounds: dict, noise: float) -> list[AutoRecipe]:
    """``recipes`` sorted by the latency bound of their kind of lowering, bounds within ``noise`` of
    the fastest of their group counting as equal (then the given order decides): a re-measured
    bound that moves within the noise does not reorder the search."""
    known = sorted({b for b in bounds.values() if b is not None})
    rank: dict[float, int] = {}
    group, head = -1, None
    for b in known:
        if head is None or b > head * (1 + noise):
            group, head = group + 1, b
        rank[b] = group
    last = len(known) + 1
    return sorted(recipes, key=lambda r: last if bounds[r.lowering] is None else rank[bounds[r.lowering]])


def fastest(trials: Sequence[Trial], order: Sequence[str], noise: float) -> int | None:
    """Index in ``trials`` of the fastest that met the target: latencies within ``noise`` (relative)
    of the fastest are ties, broken by ``order`` (the fixed recipe order), so that timing noise
    does not change the choice. Without latencies, the first that met it."""
    met = [i for i, t in enumerate(trials) if t.status == "met"]
    if not met:
        return None
    timed = [i for i in met if trials[i].latency_ms is not None]
    if not timed:
        return met[0]
    best = min(trials[i].latency_ms for i in timed)
    rank = {name: k for k, name in enumerate(order)}
    ties = [i for i in timed if trials[i].latency_ms <= best * (1 + noise)]
    return min(ties, key=lambda i: (rank.get(trials[i].recipe, len(rank)), i))


def mark_pareto(trials: Sequence[Trial]) -> None:
    """Set ``pareto`` on every scored trial: True when no other candidate is at least as accurate,
    as fast and as small and better in one of them; None where a trial lacks one of the three."""
    full = [t for t in trials if t.score is not None and t.latency_ms is not None and t.size_bytes is not None]
    for t in trials:
        t.pareto = None
    for t in full:
        t.pareto = not any(o is not t and o.score >= t.score and o.latency_ms <= t.latency_ms
                           and o.size_bytes <= t.size_bytes
                           and (o.score > t.score or o.latency_ms < t.latency_ms or o.size_bytes < t.size_bytes)
                           for o in full)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors a model holds (each stored tensor once): int8 weights count 1 byte an
    element, float ones 4 (2 in bf16); the artifact's file adds its program and metadata. A scoring
    copy's float32 stand-ins for int8 weights (``pipeline._variants.fuse_qdq``) count as the int8
    weights they stand for."""
    meta = getattr(model, "meta", None)
    stands_for = meta.get(SCORING_WEIGHTS_META_KEY, {}) if isinstance(meta, dict) else {}
    tensors = [t for name, t in list(model.named_parameters()) + list(model.named_buffers())
               if name not in stands_for]
    tensors += [get_attr(model, target) for target in stands_for.values()]
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def search(recipes: Sequence[AutoRecipe], evaluate: Callable[[AutoRecipe, list[Trial]], tuple[Any, float, dict]],
           target: float, *, latency: Callable[[AutoRecipe, Any], float] | None = None,
           lower_bound: Callable[[AutoRecipe], float | None] | None = None,
           say: Callable[[str], None] | None = None, noise: float = SPEED_MARGIN,
           size: Callable[[Any], int] | None = None, time_all: bool = False,
           cannot_meet: Callable[[AutoRecipe, list[Trial]], str | None] | None = None,
           ) -> tuple[Any, list[Trial], int, str]:
    """The search itself, independent of models: returns ``(model, trials, chosen index, reason)``.

    ``evaluate(recipe, trials_so_far) -> (model, score, details)`` builds and scores a recipe;
    ``latency(recipe, model)`` gives a model's compiled latency (ms); ``lower_bound(recipe)`` is the
    latency of the recipe's kind of lowering, or None when unknown; ``size(model)`` its bytes.
    With ``lower_bound``, the order is first sorted (stably) by the bound of each recipe's kind
    (bounds within ``noise`` of each other keep the given order): the order is measured, not
    assumed. A recipe is skipped once a winner exists unless its bound is more than ``noise``
    faster than the winner (it cannot win otherwise). The winner is the fastest candidate
    meeting ``target``, latencies within ``noise`` being ties broken by the given order (see
    :func:`fastest`); without ``latency``, the first meeting it. ``time_all``: also time the
    candidates below the target (cheap when latencies are estimated), for the Pareto front.
    ``cannot_meet(recipe, trials_so_far)``: why ``recipe`` cannot reach ``target`` (an upper bound
    of its score, measured, below it), or None; such a recipe is not built and its trial says
    why (a recipe that cannot meet the target is no candidate: the choice is unchanged).
    A recipe that raises a ValueError/RuntimeError is recorded as failed and skipped.
    """
    trials: list[Trial] = []
    models: dict[int, Any] = {}
    winner: int | None = None
    order = [r.name for r in recipes]
    if latency is not None and lower_bound is not None:
        bounds = {r.lowering: lower_bound(r) for r in recipes}
        recipes = _by_bound(recipes, bounds, noise)
    for recipe in recipes:
        if winner is not None:
            best = trials[winner]
            if latency is None or best.latency_ms is None:
                trials.append(Trial(recipe.name, f"skipped: {best.recipe} already meets the target"))
                continue
            bound = lower_bound(recipe) if lower_bound is not None else None
            if bound is None or bound >= best.latency_ms * (1 - noise):
                why = ("its kind of lowering is not measured" if bound is None else
                       f"its {recipe.lowering} lowering takes {bound:.2f} ms, not faster than {best.latency_ms:.2f} ms")
                trials.append(Trial(recipe.name, f"skipped: cannot beat {best.recipe} ({why})"))
                continue
        t0 = time.perf_counter()
        why_not = cannot_meet(recipe, trials) if cannot_meet is not None else None
        if why_not:
            trials.append(Trial(recipe.name, f"skipped: cannot meet the target ({why_not})",
                                seconds=round(time.perf_counter() - t0, 2)))
            if say is not None:
                say(f"autotune: {recipe.name}: skipped ({why_not})")
            continue
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
        if size is not None:
            trial.size_bytes = int(size(model))
        if say is not None:
            say(f"autotune: {recipe.name}: {score:.5f} ({trial.status})")
        if latency is not None and (score >= target or time_all):
            trial.latency_ms = latency(recipe, model)
        if score >= target:
            winner = fastest(trials, order, noise)
        for i in list(models):  # keep only the winner's model alive (memory)
            if i != winner:
                del models[i]
    mark_pareto(trials)
    scored = [i for i, t in enumerate(trials) if t.score is not None]
    if winner is not None:
        w = trials[winner]
        first = next(i for i, t in enumerate(trials) if t.status == "met")
        ties = [t for t in trials if t.status == "met" and t is not w and t.latency_ms is not None
                and w.latency_ms is not None and t.latency_ms <= w.latency_ms * (1 + noise)]
        if first == winner:
            earlier = [t.recipe for t in trials[:winner] if t.score is not None]
            reason = (f"the first recipe meeting the target ({w.score:.5f} >= {target:g})"
                      + (f"; {', '.join(earlier)} fell short" if earlier else ""))
            if w.latency_ms is not None:
                reason += f"; {w.latency_ms:.2f} ms"  # compiled or estimated: the report's latency_note says which
        else:
            reason = (f"meets the target ({w.score:.5f} >= {target:g}) and is the fastest that does "
                      f"({w.latency_ms:.2f} ms; {trials[first].recipe} {trials[first].latency_ms:.2f} ms)")
        if ties:
            reason += (f"; {', '.join(t.recipe for t in ties)} within the {100 * noise:g}% noise margin: "
                       "a tie, broken by the fixed recipe order")
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


def float_baseline(floats: dict) -> tuple[str, float] | None:
    """``(label, ms)`` of the float model to beat: compiled in bf16 where this CPU has native BF16,
    else in fp32 (emulated bf16 is no baseline). ``floats`` is ``Meter.floats``'s dict."""
    bf16, native = floats.get("bf16_ms"), floats.get("bf16_native")
    if native is None:  # a Meter that does not say: bf16 counts where it was timed at all
        native = bf16 is not None
    if native and bf16:
        return "bf16", float(bf16)
    fp32 = floats.get("fp32_ms")
    return ("fp32", float(fp32)) if fp32 else None


def speed_verdict(trials: Sequence[Trial], chosen: int, floats: dict, noise: float = SPEED_MARGIN) -> str | None:
    """One line when the chosen recipe is slower than the float model compiled in bf16 (fp32 where
    BF16 is not native), or within ``noise`` of it (no speed-up either), naming the best alternative;
    None when it is measurably faster (or not timed).

    The alternative is the most accurate candidate faster than the float model, if any (say
    which target it misses), else the float model itself."""
    base = float_baseline(floats)
    w = trials[chosen]
    if base is None or w.latency_ms is None:
        return None
    label, ms = base
    if w.latency_ms <= ms * (1 - noise):
        return None  # measurably faster than the float model: a real speed-up
    # within the noise margin of the float model is no speed-up either: say so rather than print "1.0x"
    slower = (f"is slower than the float model compiled in {label} ({ms:.1f} ms)" if w.latency_ms > ms * (1 + noise)
              else f"is no faster than the float model compiled in {label} ({ms:.1f} ms, within the "
                   f"{100 * noise:.0f}% noise margin)")
    quicker = [t for t in trials if t.score is not None and t.latency_ms is not None and t.latency_ms < ms
               and t is not w]
    if quicker:
        alt = max(quicker, key=lambda t: t.score)
        other = (f"--recipe {alt.recipe} ({alt.latency_ms:.1f} ms, {alt.score:.5f}"
                 f"{', below the target' if alt.status != 'met' else ''})")
        hint = f"for speed, {other}, or the float model compiled in {label}"
    else:
        hint = f"for speed, run the float model compiled in {label}; no candidate is faster"
    return f"the chosen recipe {w.recipe} ({w.latency_ms:.1f} ms) {slower}; {hint}"


def fallback_search(variants, evaluator, budget: float, *, rank_evaluator=None, progress: bool = False,
                    build: bool = True):
    """Keep float the layers that cost least (GEMM FLOPs: time, and bytes for linears) while
    ``evaluator`` drops at most ``budget`` (:meth:`._fallback._Search.cheapest`: a knapsack on the
    skip-one gains, each candidate scored), for any evaluator with ``reference``,
    ``score(model)`` and ``data``; ``rank_evaluator`` (e.g. fewer batches) ranks the layers
    (one evaluation per layer), ``evaluator`` decides. Every configuration is scored on a scoring
    copy (:meth:`Variants.variant`: no prepare or convert); the returned model is a real build
    (``build=False``: the scoring copy, for a caller that builds the artifact itself, as the CLI
    does from ``--skip`` patterns). Returns ``(model, float layer names, score)``."""
    from ..pipeline._layers import gemm_flops
    from ._fallback import _Search
    from ._sensitivity import SensitivityMode, measure

    s = _Search(variants, evaluator, budget)
    keep: list[str] = []
    if not s.ok(()):
        rank = rank_evaluator or evaluator
        ranking = measure(variants, rank, SensitivityMode.SKIP_ONE, None if rank_evaluator else s.score(()),
                          progress=progress)
        keep = s.cheapest(ranking, gemm_flops(variants.float_graph, next(iter(evaluator.data))))
    if keep and len(keep) == len(variants.layers):
        raise ValueError(f"the fallback keeps every one of the {len(keep)} layers float (nothing left to "
                         "quantize); the target is out of reach for int8")
    model = variants.build(keep) if build else variants.variant(keep)
    return model, keep, s.score(keep)


# what a fallback's float layers store their weights in, in the order tried: int8 per channel (a
# quarter of fp32's bytes; the layer reads its input unrounded, which is what made it sensitive),
# then bf16 where even that falls short (pipeline/_float_fallback)
FALLBACK_WEIGHTS = ("int8", "bf16")


def fallback_weights(base: AutoRecipe) -> tuple[str, ...]:
    """The float-layer weights a fallback on ``base`` tries: :data:`FALLBACK_WEIGHTS`, or bf16 alone on a
    SmoothQuant base. SmoothQuant scales each weight's input columns by the migrated activation range,
    so one int8 scale per output channel of ``W diag(s)`` rounds its small columns away: measured on
    MiniLM (per-token-fallback-w7, 14 float layers), int8 weights gave a layer of 3.7 dB and 0.99901
    mean cosine where fp32 weights on the same layers give 0.99950 and no layer under 15 dB."""
    return FALLBACK_WEIGHTS if base.smoothquant is None else ("bf16",)


def fallback_with_weights(variants_for: Callable[[str], Any], evaluator, target: float, *,
                          weights: Sequence[str] = FALLBACK_WEIGHTS, **kw):
    """:func:`fallback_search` for each of ``weights`` (default :data:`FALLBACK_WEIGHTS`) in turn
    (``variants_for(w)`` gives the :class:`~quantkit.pipeline._variants.Variants` storing the float
    layers' weights so), stopping at the first that meets ``target``. Returns ``(model, keep, score,
    weights, variants)``."""
    choices = tuple(weights)
    for chosen in choices:
        variants = variants_for(chosen)
        try:
            q, keep, score = fallback_search(variants, evaluator, evaluator.reference - target, **kw)
        except ValueError:  # even every layer float falls short with these weights
            if chosen == choices[-1]:
                raise
            continue
        if score >= target:
            break
    return q, keep, score, chosen, variants


def best_base(trials: list[Trial], fallback: AutoRecipe) -> AutoRecipe:
    """The base a fallback recipe keeps fast: the most accurate recipe of its kind of lowering
    (``fallback.lowering``, static or per-token) scored so far, not itself a fallback; the
    first such recipe in :data:`RECIPES` when none was (ties: the first scored)."""
    same = [t for t in trials if t.score is not None and t.recipe in RECIPES
            and RECIPES[t.recipe].lowering == fallback.lowering and not RECIPES[t.recipe].fallback]
    if not same:
        return next(r for r in RECIPES.values() if r.lowering == fallback.lowering and not r.fallback)
    return RECIPES[max(same, key=lambda t: t.score).recipe]


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
    float fallback of the most sensitive layers on the best per-token recipe, (GPTQ weights where
    available), float fallback on the best static recipe -- and stops at
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
    from quantkit.pipeline._variants import Variants, scoring_copy
    from quantkit.quantizers import W8A8Quantizer

    from . import _latency
    from ._smoothquant import smooth_quant, smoothquant_statistics

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
            if "stats" not in smoothed:  # one pass over the data for every SmoothQuant recipe
                smoothed["stats"] = smoothquant_statistics(gm, calib)
            smoothed[key] = smooth_quant(gm, calib, alpha=r.smoothquant, config=r.config(),
                                         statistics=smoothed["stats"])
        return smoothed[key]

    def evaluate(r: AutoRecipe, trials):
        if r.fallback:
            base = best_base(trials, r)
            prepared: dict = {}

            def variants_for(weights):
                v = Variants(base_graph(base), None, calib, W8A8Quantizer(base.config()),
                             prepared=prepared.get("p"), float_weights=weights)
                prepared.setdefault("p", v.prepared)
                return v

            q, keep, score, weights, variants = fallback_with_weights(variants_for, evaluator, target,
                                                                      weights=fallback_weights(base))
            labels = {layer.name: layer.label for layer in variants.layers}
            return q, score, {"base": base.name, "float_weights": weights,
                              "float_layers": [labels[n] for n in keep]}
        from quantkit.pipeline._api import quantize

        q = quantize(base_graph(r), example_inputs, calib, W8A8Quantizer(r.config()), progress=False)
        return q, evaluator.score(scoring_copy(q)), {}  # the same values, q/dq fused

    meter = _latency.Meter(gm, example_inputs) if measure_latency else None
    noise, cheap = _meter_noise(meter), _estimates(meter)
    say = print if progress else None
    qmodel, trials, best, reason = search(
        chosen, evaluate, target, latency=(lambda r, q: meter.int8(q, r.lowering)) if meter else None,
        lower_bound=(lambda r: meter.kind(r.lowering, lambda: _quick(r, gm, example_inputs, calib)))
        if meter else None, say=say, noise=noise, size=model_bytes, time_all=cheap)
    name = getattr(metric, "__name__", str(metric))
    report = AutotuneReport(name, float(target), trials[best].recipe, trials[best].status == "met", reason,
                            trials, source)
    if meter is not None and trials[best].latency_ms is None:
        trials[best].latency_ms = meter.int8(qmodel, RECIPES.get(trials[best].recipe, chosen[0]).lowering)
    report.speed = {"int8_ms": trials[best].latency_ms}
    if (compare_speed or cheap) and meter is not None:
        try:
            report.speed.update(meter.floats(gm if cheap else model))
            report.verdict = speed_verdict(trials, best, report.speed, noise)
        except Exception as exc:  # e.g. a graph with float32 constants baked in cannot run in bf16
            report.speed["error"] = " ".join(str(exc).split())[:150] or type(exc).__name__
    if meter is not None:
        report.speed["noise"] = noise
        report.speed["sources"] = dict(meter.sources)
    report.notes = list(meter.notes) if meter is not None else []
    if not report.met:
        warnings.warn(f"autotune: {reason}; returning it anyway", stacklevel=2)
    return qmodel, report


def _meter_noise(meter) -> float:
    """The meter's tie margin (``Meter.noise``; :data:`SPEED_MARGIN` without a meter)."""
    return SPEED_MARGIN if meter is None else float(meter.noise)


def _estimates(meter) -> bool:
    """Whether the meter's latencies are cheap estimates (nothing compiled): then every candidate
    is timed, and the float models too."""
    return meter is not None and not meter.measure


def _quick(r: AutoRecipe, gm, example_inputs, calib):
    """A model of ``r``'s kind of lowering for timing alone: calibrated on one batch."""
    from quantkit.pipeline._api import quantize
    from quantkit.quantizers import W8A8Quantizer

    base = best_base([], r) if r.fallback else r
    return quantize(gm, example_inputs, calib[:1], W8A8Quantizer(QuantConfig(dynamic=base.dynamic,
                                                                             granularity=base.granularity,
                                                                             weight_bits=base.weight_bits)),
                    progress=False)


def _pick(names: Sequence[str] | None) -> list[AutoRecipe]:
    if names is None:
        return auto_recipes()
    if isinstance(names, str):
        names = [names]
    unknown = [n for n in names if n not in RECIPES]
    if unknown or not names:
        raise ValueError(f"unknown recipe {unknown[0] if unknown else '(none)'!r}; choose from {', '.join(RECIPES)}")
    return [RECIPES[n] for n in names]
