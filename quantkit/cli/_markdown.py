"""report.md and the terminal's tables: the Markdown side of the report (the numbers come from
``_report``; the recipe search's section from its ``autotune`` record)."""

from __future__ import annotations

import math
from typing import Any

from .._text import printable
from ._fp8 import describe_fp8
from ._weight_only import describe_weight_only

__all__ = ["render_table", "describe_recipe", "render_autotune", "render_report"]


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return "inf" if math.isinf(x) else f"{x:.4f}" if abs(x) < 1.5 else f"{x:.2f}"
    return str(x)


def render_table(rows: list[dict], columns: list[str]) -> str:
    """A plain-text table (also valid Markdown). Cells pass through ``quantkit._text.printable``
    (before the widths are measured): a field read from a file cannot reach the terminal as a
    control character or bidirectional override."""
    cells = [[printable(_fmt(r.get(c, ""))) for c in columns] for r in rows]
    columns = [printable(c) for c in columns]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells])


def describe_recipe(r: dict) -> str:
    """One sentence naming a recipe's choices (report.md, inspect)."""
    if r.get("config_type"):  # a registered scheme the command line has no flags for (cli/_registered.py)
        return f"scheme `{r.get('scheme')}` ({r.get('config_type')}): {r.get('description')}"
    if r.get("fp8"):
        return describe_fp8(r)
    if r.get("weight_only"):
        return describe_weight_only(r)
    act = (f"dynamic {r.get('activation')} activations ({r.get('granularity')})" if r.get("dynamic")
           else f"static {r.get('activation')} activations (observer `{r.get('observer')}`)")
    return (f"scheme `{r.get('scheme')}`: int8 weights (observer `{r.get('weight_observer')}`), {act}, "
            f"ops {', '.join(r.get('ops') or [])}")


def render_report(report: dict) -> str:
    """report.md from report.json's dictionary."""
    m, s, r, d = report["metric"], report["size"], report["recipe"], report["data"]
    accuracy = {"metric": m["name"], "mean cosine": m["mean_cosine"], "min cosine": m["min_cosine"],
                "SQNR (dB)": m["sqnr_db"], "samples": m["samples"]}
    cols = ["metric", "mean cosine", "min cosine", "SQNR (dB)", "samples"]
    if "top1_agreement" in m:
        accuracy["top-1 agreement"] = m["top1_agreement"]
        cols.insert(4, "top-1 agreement")
    lines = [f"# quantkit int8 report: {report['model']}", ""]
    fit = report.get("weights_not_loaded")
    if fit:
        summary = ", ".join(f"{len(fit[k])} {k}" for k in ("missing", "unexpected", "mismatched") if fit[k])
        lines += [f"**Warning: the checkpoint does not fit {fit['architecture']} ({summary}); it was quantized "
                  "with --allow-missing-weights, so those tensors are randomly initialised.**", ""]
    lines += [
        f"Recipe: {describe_recipe(r)}; {d['calibration_samples']} calibration samples "
        f"(held out: {d['heldout_samples']}), skipped: {', '.join(r['skip']) or 'nothing'}.",
        "",
    ]
    if report.get("autotune"):  # --recipe auto|NAME (cli/_autotune.py)
        lines += render_autotune(report["autotune"])
    for k in (report.get("kernels") or {}).values():  # e.g. the CPU int4 kernel: runs here, or why not
        lines += [f"Kernel {k['kernel']}: {'available' if k['available'] else 'unavailable'} ({k['reason']}).", ""]
    if d.get("nonfinite_skipped"):
        lines += [f"{d['nonfinite_skipped']} samples holding NaN or inf were left out (--skip-nonfinite), "
                  f"e.g. {', '.join(d['nonfinite_examples'])}.", ""]
    lines += [
        "## Accuracy on the held-out split",
        "",
        render_table([accuracy], cols),
        "",
        "## Size",
        "",
        render_table([{"fp32 weights (bytes)": s["float_bytes"], "model.pt2 (bytes)": s["int8_bytes"],
                       "ratio": s["ratio"]}], ["fp32 weights (bytes)", "model.pt2 (bytes)", "ratio"]),
        "",
        "## Time",
        "",
        render_table([{"stage": k, "seconds": v} for k, v in report["time_s"].items()], ["stage", "seconds"]),
        "",
        "## Per-layer output SQNR",
        "",
        "Each layer's output in the int8 model against the float model on one held-out batch "
        "(errors of earlier layers included; inf: identical).",
        "",
        render_table(report["layers"], ["layer", "op", "weight", "sqnr_db"]),
        "",
    ]
    return "\n".join(lines)


def render_autotune(doc: dict) -> list[str]:
    """report.md lines for the recipe search."""
    if not doc["trials"]:
        return [f"Recipe {doc['chosen']}: {doc['reason']}.", ""]
    dash = lambda v: "-" if v is None else v  # noqa: E731
    rows = [{"recipe": t["recipe"], doc["metric"]: dash(t["score"]), "compiled ms": dash(t["latency_ms"]),
             "bytes": dash(t.get("size_bytes")),
             "Pareto": {True: "yes", False: "no"}.get(t.get("pareto"), "-"), "result": t["status"],
             "float layers": ", ".join(t["details"].get("float_layers", [])) or "-"} for t in doc["trials"]]
    lines = ["## Recipe search" if doc["mode"] == "auto" else "## Recipe", "",
             f"Target: held-out {doc['metric']} >= {doc['target']:g}. Chosen: **{doc['chosen']}** "
             f"({'met' if doc['met'] else 'NOT met'}): {doc['reason']}.", "",
             render_table(rows, ["recipe", doc["metric"], "compiled ms", "bytes", "Pareto", "result",
                                 "float layers"]), "",
             "The winner is the fastest candidate meeting the target; latencies within "
             f"{100 * (doc.get('speed') or {}).get('noise', 0.05):g}% of each other are ties, broken by the "
             "fixed recipe order. Pareto: no other candidate is as accurate, as fast and as small and better "
             "in one (accuracy, latency, tensor bytes).", ""]
    if doc.get("verdict"):
        lines += [f"**{doc['verdict'][0].upper()}{doc['verdict'][1:]}.**", ""]
    if doc.get("cpu_note"):
        lines += [f"Note: {doc['cpu_note']}.", ""]
    s = doc.get("speed") or {}
    if "vs_fp32" in s:
        bf16 = (f", bf16 {s['bf16_ms']:.2f} ms (**{s['vs_bf16']:.2f}x**)" if s.get("vs_bf16")
                else "; bf16 not compared (no native BF16 on this CPU)")
        lines += [f"Compiled speed of the chosen recipe: {s['int8_ms']:.2f} ms per batch; fp32 {s['fp32_ms']:.2f} ms "
                  f"(**{s['vs_fp32']:.2f}x**){bf16}. {doc['latency_note']}.", ""]
    elif "error" in s:
        lines += [f"Compiled speed not measured: {s['error']}.", ""]
    if doc.get("cache_notes"):
        lines += ["Latency cache entries ignored and measured again:", ""]
        lines += [f"- {note}" for note in doc["cache_notes"]] + [""]
    return lines
