"""``quantkit quantize --recipe auto|NAME --target VALUE --strict``: choose the recipe.

``auto`` (the default when no recipe flag is given) runs :func:`quantkit.accuracy._autotune.search`
over the recipes, scoring each on the command's held-out split with the report's own metric
(held-out mean cosine; top-1 agreement for classifiers), and returns the winner as an explicit
:class:`~quantkit.cli._quantize.Recipe` (a float fallback becomes ``--skip`` patterns), which
``quantize`` then builds as if its flags had been given: quantization.json records a recipe that
reproduces the artifact without a search.
"""

from __future__ import annotations

import dataclasses

__all__ = ["add_arguments", "requested", "choose", "exit_code", "summary_line"]

RECIPE_HELP = ("auto (default when no other recipe flag is given): the fastest recipe that meets --target on the "
               "held-out split, measured; or force one: static, static-smoothquant, histogram, per-token, "
               "per-token-smoothquant, per-token-fallback, fallback (gptq where available); on CPUs without VNNI, auto "
               "also tries their 7-bit-weight variants: histogram-w7, per-token-w7, per-token-smoothquant-w7, "
               "per-token-fallback-w7 (fallback-w7 only when named)")
# flags that spell out a recipe by hand: with them, no search runs (and --recipe conflicts)
_MANUAL = (("scheme", "--scheme"), ("activation", "--activation"), ("dynamic", "--dynamic"),
           ("granularity", "--granularity"), ("observer", "--observer"), ("weight_bits", "--weight-bits"),
           ("smoothquant", "--smoothquant"), ("accuracy_budget", "--accuracy-budget"))


def add_arguments(group) -> None:
    group.add_argument("--recipe", metavar="auto|NAME", help=RECIPE_HELP)
    group.add_argument("--target", type=float, metavar="VALUE",
                       help="--recipe auto: the held-out score to reach (default: mean cosine 0.999; top-1 "
                            "agreement 0.99 for classifiers)")
    group.add_argument("--strict", action="store_true",
                       help="exit non-zero when no recipe meets --target (the best one is still written)")


def requested(args) -> list | None:
    """The recipes to try (``[one]`` when forced), or None for a hand-written recipe."""
    from . import _inputs as inputs

    name = getattr(args, "recipe", None)
    target = getattr(args, "target", None)
    if target is not None and not 0 < target <= 1:  # held-out cosine and top-1 agreement lie in [-1, 1]
        raise inputs.UsageError(f"--target must be in (0, 1] (a held-out mean cosine or top-1 agreement), got {target:g}")
    # identity, not ==: `--accuracy-budget 0` gives 0.0, and 0.0 == False
    manual = [flag for attr, flag in _MANUAL if getattr(args, attr, None) is not None
              and getattr(args, attr, None) is not False]
    if name is None and manual:
        if getattr(args, "target", None) is not None or getattr(args, "strict", False):
            raise inputs.UsageError(f"--target/--strict apply to --recipe auto, not to {manual[0]}; drop one of them")
        return None
    if manual:
        raise inputs.UsageError(f"--recipe {name} conflicts with {manual[0]} (a hand-written recipe); drop one of them")
    from quantkit.accuracy._autotune import RECIPES

    name = (name or "auto").strip().lower()
    if name == "auto":
        from quantkit.accuracy._autotune import auto_recipes

        return auto_recipes()
    if name not in RECIPES:
        raise inputs.UsageError(f"unknown --recipe {name!r}; use auto or one of {', '.join(RECIPES)}")
    if getattr(args, "target", None) is not None and not name.endswith("fallback"):
        raise inputs.UsageError(f"--target applies to --recipe auto (or a fallback), not to --recipe {name}; "
                                "drop it")
    return [RECIPES[name]]


class _HeldOut:
    """The report's held-out metric (``compare_models``: per-sample cosine of sentence embeddings,
    logits or outputs; top-1 agreement) as an evaluator with ``reference``, ``score``, ``data``;
    the float model's rows are computed once."""

    def __init__(self, float_model, batches, origins, key: str, kind: str) -> None:
        import torch

        from quantkit.pipeline._inputs import call_model

        from . import _report as report

        self.data, self.key, self.kind = batches, key, kind
        self.reference = 1.0  # cosine / agreement of the float model with itself
        self.refs = []
        with torch.no_grad():
            for b, where in zip(batches, origins):
                ref, owner = report._rows(kind, call_model(float_model, b), b)
                real = owner < len(where)  # rows past the batch's samples pad it to a static shape
                self.refs.append((ref[real], owner[real], real, len(where)))

    def score(self, model) -> float:
        import torch

        from quantkit.pipeline._inputs import call_model

        from . import _report as report

        sc = report._Score()
        with torch.no_grad():
            for b, (ref, owner, real, n) in zip(self.data, self.refs):
                approx = report._rows(self.kind, call_model(model, b), b)[0][real]
                if not bool(torch.isfinite(approx).all()):
                    return float("-inf")
                sc.add(ref, approx, owner, n, top1=self.kind in (report.LOGITS, report.TOKEN_LOGITS))
        return float(sc.result(self.kind)[self.key])

    def head(self, n: int) -> "_HeldOut":
        """The same metric on the first ``n`` batches (ranks layers cheaply)."""
        out = object.__new__(_HeldOut)
        out.data, out.refs, out.key, out.kind, out.reference = self.data[:n], self.refs[:n], self.key, self.kind, 1.0
        return out


def _as_cli(auto, base, skip=(), float_weights=None):
    """The CLI recipe of an autotune recipe, keeping the user's --ops, --skip and --weight-observer
    (``float_weights``: what the skipped layers' weights are stored in; the fallback's: int8 or bf16)."""
    return dataclasses.replace(base, activation=None, dynamic=auto.dynamic, granularity=auto.granularity,
                               float_weights=float_weights or base.float_weights,
                               observer="minmax" if auto.dynamic else auto.act_observer,
                               smoothquant=auto.smoothquant, accuracy_budget=None,
                               weight_algorithm=auto.weight_algorithm, weight_bits=auto.weight_bits,
                               skip=tuple(base.skip) + tuple(s for s in skip if s not in base.skip))


def choose(args, base, loaded, gm, calib, heldout, heldout_origins, module_names, progress, recipes):
    """Search (or build the forced recipe); returns ``(chosen CLI Recipe, report dict, donor, smoothed)``.

    ``smoothed``: the SmoothQuant graph the chosen recipe was scored on (the same ``smooth_quant``
    call ``quantize`` makes: it need not run again), or None.

    ``donor``: None, or for a chosen fallback in one process, the search's calibrated model
    (:meth:`~quantkit.pipeline._variants.Variants.calibrate_like`): ``quantize`` copies its observers
    into the artifact's prepared model instead of calibrating again (the same statistics: one
    process, the same batches; the copy is refused, and ``quantize`` calibrates, where an observer
    does not match exactly). Under torchrun the ranks calibrate their shards together instead."""
    import quantkit
    from quantkit.accuracy import _autotune as at, _latency
    from quantkit.accuracy._smoothquant import smoothquant_statistics
    from quantkit.pipeline._distributed import launched_world
    from quantkit.pipeline._inputs import call_model
    from quantkit.pipeline._variants import Variants, scoring_copy

    from . import _export
    from . import _report as report

    import torch

    if len(recipes) == 1 and not recipes[0].fallback:  # forced: nothing to search, quantize builds it
        return _as_cli(recipes[0], base), {"mode": "forced", "chosen": recipes[0].name, "met": None,
                                           "reason": f"forced with --recipe {recipes[0].name}", "trials": []}, None, None
    with torch.no_grad():
        kind = report.output_kind(call_model(loaded.model, heldout[0]), heldout[0])
    key, default = ("top1_agreement", at.DEFAULT_TARGETS["top1"]) if kind == report.LOGITS else \
        ("mean_cosine", at.DEFAULT_TARGETS["cosine"])
    target = args.target if args.target is not None else default
    evaluator = _HeldOut(loaded.model, heldout, heldout_origins, key, kind)
    smoothed: dict = {}
    sq_stats: dict = {}  # "stats": the SmoothQuant statistics of gm on calib, shared by its recipes
    cli_of: dict[str, object] = {}
    calibrated: dict = {}  # static recipe -> its calibrated prepared model (the fallback's base)
    bases: dict = {}  # static recipe -> Variants of its calibrated model (fallback, weight bounds)
    donors: dict = {}  # fallback recipe -> the Variants whose calibration its artifact can copy
    scored_on: dict = {}  # recipe -> the SmoothQuant graph it was scored on (its CLI recipe's alpha)

    def variants_of(b, cli, float_weights="fp32"):
        k = (b.name, float_weights)
        if k not in bases:
            bases[k] = Variants(graph_for(b, cli), None, calib, cli.quantizer(module_names),
                                prepared=calibrated.get(b.name), float_weights=float_weights)
        return bases[k]

    def cannot_meet(auto, trials):
        """A weight algorithm (GPTQ) changes only the int8 weights of its base recipe: its score is
        bounded by the base with float weights (activations rounded as they are), one forward per
        batch instead of a 13 s GPTQ calibration (issue 28)."""
        if auto.weight_algorithm == "rtn" or auto.fallback or auto.dynamic or auto.smoothquant is not None:
            return None
        rtn = next((r for r in at.RECIPES.values() if r.weight_algorithm == "rtn" and not r.fallback
                    and r.smoothquant is None and r.scheme == dataclasses.replace(auto.scheme, weight_algorithm="rtn")),
                   None)
        if rtn is None or rtn.name not in calibrated:  # not scored here (or several processes)
            return None
        float_w = variants_of(rtn, _as_cli(rtn, base)).weights_float()
        if float_w is None:
            return None
        bound = evaluator.score(float_w)
        if bound >= target:
            return None
        return (f"{rtn.name} with float weights scores {bound:.5f} < {target:g}; {auto.weight_algorithm} "
                f"only rounds those weights")

    def graph_for(auto, cli):
        if auto.smoothquant is None:
            return gm
        k = (auto.smoothquant, auto.lowering)
        if k not in smoothed:
            if "stats" not in sq_stats:  # one pass over the data for every SmoothQuant recipe
                sq_stats["stats"] = smoothquant_statistics(gm, calib)
            smoothed[k] = quantkit.smooth_quant(gm, calib, alpha=cli.smoothquant, config=cli.config(),
                                                statistics=sq_stats["stats"], fold_only=_export.folds_only(args))
        return smoothed[k]

    def evaluate(auto, trials):
        if auto.fallback:
            b = at.best_base(trials, auto)
            cli = _as_cli(b, base)
            # the base recipe's calibrated model, when it was scored: no second calibration
            # the float layers keep int8 weights (per channel, read unrounded inputs: a quarter of
            # the bytes of fp32) where that meets the target, else bf16 weights (issue 28 items 3 and
            # the 0.30x size); the variants score what the artifact computes
            # q is a real build (one prepare + convert): the search's latency is estimated on it, and
            # a scoring copy (constant float weights, fused q/dq) reads to the cost model as a float graph
            q, keep, score, weights, variants = at.fallback_with_weights(
                lambda w: variants_of(b, cli, w), evaluator, target, weights=at.fallback_weights(b),
                rank_evaluator=evaluator.head(1), progress=progress)
            layers = [layer for layer in variants.layers if layer.name in keep]
            skip = sorted({layer.module for layer in layers if layer.module})
            if len(skip) < len(layers):  # a top-level op has no module to name with --skip
                raise ValueError("a sensitive layer has no module name to keep float with --skip")
            cli_of[auto.name] = _as_cli(b, base, skip, float_weights=weights)
            donors[auto.name] = variants
            if b.smoothquant is not None:
                scored_on[auto.name] = variants.float_graph
            return q, score, {"base": b.name, "float_weights": weights,
                              "float_layers": [layer.label for layer in layers]}
        cli = _as_cli(auto, base)
        graph = graph_for(auto, cli)
        if auto.smoothquant is not None:
            scored_on[auto.name] = graph
        prepared = quantkit.prepare(graph, cli.quantizer(module_names))
        quantkit.calibrate(prepared, calib, progress=False)  # a dynamic recipe's: one batch (weights only)
        q = quantkit.convert(prepared)  # a copy: prepared stays calibrated, for a fallback on this base
        # under a launch of several processes calibrate reduces across ranks while Variants calibrates
        # each rank alone: reuse it only in one process (where the two are the same calibration)
        if not auto.dynamic and not (torch.distributed.is_available() and torch.distributed.is_initialized()
                                     and torch.distributed.get_world_size() > 1):
            calibrated[auto.name] = prepared
        cli_of[auto.name] = cli
        return q, evaluator.score(scoring_copy(q)), {}  # the same values, q/dq fused (a third of the passes)

    def _quick(auto):
        """A model of ``auto``'s kind of lowering, as quantize builds it, calibrated on one batch: for timing."""
        cli = _as_cli(at.best_base([], auto) if auto.fallback else auto, base)
        prepared = quantkit.prepare(gm, cli.quantizer(module_names))
        quantkit.calibrate(prepared, calib[:1], progress=False)
        return quantkit.convert(prepared)

    auto_mode = len(recipes) > 1
    meter = _latency.Meter(gm, calib[0]) if auto_mode else None
    noise, estimated = at._meter_noise(meter), at._estimates(meter)
    say = (lambda s: print(s, flush=True)) if progress else None
    qmodel, trials, best, reason = at.search(
        recipes, evaluate, target,
        latency=(lambda r, q: meter.int8(q, r.lowering)) if meter else None,
        lower_bound=(lambda r: meter.kind(r.lowering, lambda: _quick(r))) if meter else None,
        say=say, noise=noise, size=at.model_bytes, time_all=estimated, cannot_meet=cannot_meet)
    chosen = trials[best]
    speed, verdict = {}, None
    if meter is not None:
        try:
            if chosen.latency_ms is None:
                chosen.latency_ms = meter.int8(qmodel, at.RECIPES[chosen.recipe].lowering)
            speed = {"int8_ms": chosen.latency_ms, **meter.floats(gm if estimated else loaded.model)}
            speed["vs_fp32"] = round(speed["fp32_ms"] / speed["int8_ms"], 2)
            if speed.get("bf16_ms"):
                speed["vs_bf16"] = round(speed["bf16_ms"] / speed["int8_ms"], 2)
            verdict = at.speed_verdict(trials, best, speed, noise)
        except Exception as exc:  # report, don't fail: the artifact stands without the timing
            speed = {"error": " ".join(str(exc).split())[:150] or type(exc).__name__}
        speed["noise"] = noise
    sources = dict(meter.sources) if meter is not None else {}
    cpu_note = _cpu_note() if meter is not None else None
    how = ("estimated per kernel (accuracy/_costmodel: nothing compiled)" if estimated else
           "compiled (quantkit.compile / Inductor freezing), median ms per call on one calibration batch")
    doc = {"mode": "auto" if auto_mode else "forced", "metric": key, "target": target,
           "chosen": chosen.recipe, "met": chosen.status == "met", "reason": reason,
           "trials": [dataclasses.asdict(t) for t in trials], "speed": speed, "verdict": verdict,
           "latency_sources": sources, "latency_estimated": estimated, "cpu_note": cpu_note,
           "latency_note": how + ", cached in " + str(_latency.cache_path()),
           "cache_notes": list(meter.notes) if meter is not None else []}
    if not auto_mode:
        doc["reason"] = f"forced with --recipe {chosen.recipe}"
        doc["met"] = chosen.score is not None and chosen.score >= target
    chosen_cli = cli_of[chosen.recipe]
    # a weight algorithm (GPTQ) rounds at calibration: only plain rounding copies observers alone
    donor = donors.get(chosen.recipe) if launched_world() <= 1 and chosen_cli.weight_algorithm == "rtn" \
        else None
    smoothed_graph = scored_on.get(chosen.recipe) if chosen_cli.smoothquant is not None else None
    return chosen_cli, doc, donor, smoothed_graph


def _cpu_note() -> str | None:
    """Why this CPU gets no fast int8/bf16 path (one line), or None
    (``accuracy._costmodel.cpu_support_line``)."""
    from quantkit.accuracy import _costmodel

    return _costmodel.cpu_support_line()


def summary_line(doc: dict) -> str:
    """The terminal's line on the search: the winner and its speed-up over float, or, when it is
    slower than the float model compiled in bf16 (fp32 without native BF16), that verdict instead
    (``doc["verdict"]``, :func:`quantkit.accuracy._autotune.speed_verdict`): never a speed-up it is not."""
    if not doc["trials"]:
        return f"recipe {doc['chosen']} ({doc['reason']})"
    if doc.get("verdict"):
        return f"recipe {doc['chosen']} ({doc['reason']}); warning: {doc['verdict']}"
    s = doc.get("speed") or {}
    speed = ""
    if "vs_fp32" in s:
        how = "estimated" if doc.get("latency_estimated") else "compiled"
        speed = f"; {how} {s['int8_ms']:.1f} ms per batch compiled = {s['vs_fp32']:.2f}x fp32"
        if s.get("vs_bf16"):  # only where bf16 is native: Meter.floats gives no bf16_ms elsewhere
            speed += f", {s['vs_bf16']:.2f}x bf16"
    return f"recipe {doc['chosen']} ({doc['reason']}){speed}"


def exit_code(args, doc: dict | None) -> int:
    """Non-zero only with --strict when the target is not met (the artifact is written either way)."""
    if doc is None or doc["met"] is not False:
        return 0
    msg = (f"warning: no recipe meets --target {doc['target']:g} ({doc['metric']}); wrote the best, "
           f"{doc['chosen']}, anyway")
    print(msg + ("; failing because of --strict" if args.strict else "; pass --strict to make this an error"))
    return 1 if args.strict else 0
