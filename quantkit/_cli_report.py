"""Measuring an int8 model against its float source: metric, per-layer SQNR, latency, reports."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
from torch.fx import GraphModule

from . import _hf
from ._inputs import call_model
from ._scopes import module_scopes

__all__ = ["outputs_of", "compare", "layer_sqnr", "render_report", "render_table", "sqnr_db"]

aten = torch.ops.aten
_LAYER_OPS = {
    aten.linear.default: "linear", aten.embedding.default: "embedding",
    aten.conv1d.default: "conv", aten.conv2d.default: "conv", aten.conv3d.default: "conv",
    aten.conv1d.padding: "conv", aten.conv2d.padding: "conv", aten.conv3d.padding: "conv",
}


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """10·log10(‖ref‖² / ‖ref − approx‖²) in float64; inf when they are equal."""
    ref, approx = ref.double(), approx.double()
    noise = (ref - approx).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(max(signal, 1e-300) / noise)


def _first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "keys"):
        out = list(out.values())
    for v in out:
        if isinstance(v, torch.Tensor):
            return v
    raise TypeError(f"the model returned no tensor ({type(out).__name__})")


def _rows(out, batch, embedding: bool) -> torch.Tensor:
    """One vector per sample: the pooled sentence embedding for encoders, the flattened output otherwise."""
    if embedding:
        return _hf.embed(out, batch["attention_mask"])
    t = _first_tensor(out)
    return t.reshape(t.shape[0], -1).float()


def is_encoder_batch(batch) -> bool:
    return isinstance(batch, dict) and "attention_mask" in batch


def outputs_of(model, batches: list, *, progress: bool, desc: str, timing: dict | None = None) -> torch.Tensor:
    """Per-sample output rows of ``model`` over ``batches`` (see :func:`compare`).

    With ``timing``, the first batch is run once more as a warm-up and ``timing`` gets
    the median wall time per batch and the throughput of the timed pass.
    """
    from tqdm.auto import tqdm

    rows, times, n = [], [], 0
    with torch.no_grad():
        if timing is not None:
            call_model(model, _head(batches[0], 1))  # warm-up (allocator, lazy init), not timed
        for b in tqdm(batches, desc=desc, unit="batch", disable=not progress, leave=False):
            t0 = time.perf_counter()
            out = call_model(model, b)
            times.append(time.perf_counter() - t0)
            n += _batch_size(b)
            rows.append(_rows(out, b, is_encoder_batch(b)))
    if timing is not None:
        timing.update(median_ms_per_batch=round(1e3 * statistics.median(times), 2),
                      samples_per_s=round(n / sum(times), 1), batches=len(times))
    return torch.cat(rows)


def compare(ref: torch.Tensor, approx: torch.Tensor, *, encoder: bool) -> dict:
    """Cosine per sample (mean and min) and the SQNR of the whole output."""
    cos = _hf.cosine(ref, approx)
    return {
        "name": "embedding cosine" if encoder else "output cosine",
        "samples": int(cos.numel()),
        "mean_cosine": float(cos.mean()),
        "min_cosine": float(cos.min()),
        "sqnr_db": sqnr_db(ref, approx),
    }


def _layer_nodes(gm: GraphModule) -> dict[str, torch.fx.Node]:
    """Innermost module name → its linear/conv/embedding node (first one if a module has several)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _LAYER_OPS:
            continue
        scopes = module_scopes(node)
        if scopes:
            name = scopes[-1][0]
            out.setdefault(name, node)
    return out


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: GraphModule, wanted: dict[torch.fx.Node, str]):
        super().__init__(gm)
        self.wanted = wanted
        self.seen: dict[str, torch.Tensor] = {}

    def run_node(self, n):
        out = super().run_node(n)
        if n in self.wanted and isinstance(out, torch.Tensor):
            self.seen[self.wanted[n]] = out.detach()
        return out


def _flat_inputs(gm: GraphModule, batch) -> list:
    """The batch in the order of the graph's placeholders (keyword inputs matched by name)."""
    if not isinstance(batch, dict):
        return list(batch) if isinstance(batch, (tuple, list)) else [batch]
    names = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    missing = [n for n in names if n not in batch]
    if missing:
        raise KeyError(f"the batch has no input(s) {missing} that the graph takes")
    return [batch[n] for n in names]


def layer_sqnr(float_model: torch.nn.Module, qmodel: GraphModule, batch, records: list[dict]) -> list[dict]:
    """Output SQNR of every quantized layer on one batch (errors of earlier layers included).

    Layers are matched by module name: the float model's submodule and the int8 graph's
    linear/conv/embedding node whose innermost ``nn_module_stack`` entry has that name.
    """
    batch = _head(batch, 8)  # 8 samples are plenty for a per-layer SQNR and keep this cheap
    nodes = _layer_nodes(qmodel)
    quantized = {r["node"].split(" -> ")[-1]: r for r in records if r.get("kind") == "weight"}
    modules = dict(float_model.named_modules())
    wanted = {node: name for name, node in nodes.items() if name in modules}
    float_out: dict[str, torch.Tensor] = {}
    hooks = [modules[name].register_forward_hook(
        lambda mod, inp, out, name=name: float_out.setdefault(name, out.detach()) if isinstance(out, torch.Tensor) else None)
        for name in wanted.values()]
    try:
        with torch.no_grad():
            call_model(float_model, batch)
            rec = _Recorder(qmodel, wanted)
            rec.run(*_flat_inputs(qmodel, batch))
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for node, name in wanted.items():
        if name not in float_out or name not in rec.seen or float_out[name].shape != rec.seen[name].shape:
            continue
        w = quantized.get(node.name)
        rows.append({
            "layer": name,
            "op": _LAYER_OPS[node.target],
            "weight": f"{w['dtype']} {w['qscheme'].replace('_', '-')}" if w else "float",
            "sqnr_db": round(sqnr_db(float_out[name], rec.seen[name]), 2),
        })
    return rows


def _head(batch, n: int):
    if isinstance(batch, dict):
        return {k: v[:n] for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(t[:n] for t in batch)
    return batch[:n]


def _batch_size(batch) -> int:
    t = next(iter(batch.values())) if isinstance(batch, dict) else batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(t.shape[0])


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return "inf" if math.isinf(x) else f"{x:.4f}" if abs(x) < 1.5 else f"{x:.2f}"
    return str(x)


def render_table(rows: list[dict], columns: list[str]) -> str:
    """A plain-text table (also valid Markdown)."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells])


def render_report(report: dict) -> str:
    """report.md from report.json's dictionary."""
    m, s, r = report["metric"], report["size"], report["recipe"]
    lines = [
        f"# quantkit int8 report: {report['model']}",
        "",
        f"Recipe: scheme `{r['scheme']}`, activation observer `{r['observer']}`, weight observer "
        f"`{r['weight_observer']}`, {report['data']['calibration_samples']} calibration samples "
        f"(held out: {report['data']['heldout_samples']}), skipped: {', '.join(r['skip']) or 'nothing'}.",
        "",
        "## Accuracy on the held-out split",
        "",
        render_table([{"metric": m["name"], "mean cosine": m["mean_cosine"], "min cosine": m["min_cosine"],
                       "SQNR (dB)": m["sqnr_db"], "samples": m["samples"]}],
                     ["metric", "mean cosine", "min cosine", "SQNR (dB)", "samples"]),
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
        "(errors of earlier layers included).",
        "",
        render_table(report["layers"], ["layer", "op", "weight", "sqnr_db"]),
        "",
    ]
    return "\n".join(lines)
