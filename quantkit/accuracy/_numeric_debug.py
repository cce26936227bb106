"""compare: per-layer numerics of a quantized model against its float model.

Float and quantized intermediates are matched by node name: the names of the original
ops (``linear_3``) survive prepare and convert. Three runs per batch, each with small
recording modules spliced into a copy of the graph:

* the float graph (batch norms folded, as ``prepare`` does) records each layer's output
  and each quantized activation's float value;
* the quantized graph records each layer's output with all upstream error
  (``sqnr_cumulative``);
* the quantized graph with every activation quantizer fed its float input records each
  layer's output with that layer's own quantization error only (``sqnr``, the ranking).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.fx import GraphModule, Node

from ..pipeline._calibrate import run_batches
from ..pipeline._capture import capture
from ..pipeline._fold_bn import fold_conv_bn
from ..pipeline._layers import DEQUANTIZE_OPS, QUANTIZE_OPS, Layer, find_layers, layer_of, source_dequantize
from ._metrics import reiterable
from .._graph import unique_attr_name
from .._qmath import dequantize

__all__ = ["compare", "LayerReport", "LayerRow", "ActivationRange"]

_QD = torch.ops.quantized_decomposed
_CHOOSE = {_QD.choose_qparams.tensor, _QD.choose_qparams_symmetric.tensor, _QD.choose_qparams_per_token.default}


@dataclass(frozen=True)
class ActivationRange:
    """One quantized activation input of a layer.

    Attributes:
        tensor: the node whose output is quantized.
        q_range: the range int8 can represent, ``(dequant(qmin), dequant(qmax))``;
            None for dynamic quantization (chosen per batch).
        observed: min and max of the float values seen on the compared data.
        clipped: fraction of those values that saturate: more than half a
            quantization step outside ``q_range``.
    """

    tensor: str
    q_range: tuple[float, float] | None
    observed: tuple[float, float]
    clipped: float


@dataclass(frozen=True)
class LayerRow:
    """Numerics of one quantized op.

    Attributes:
        layer: which op (node name, module fqn, op family).
        sqnr: SQNR in dB of the op's output when it alone is quantized (float inputs
            through its own quantizers): this layer's own error.
        sqnr_cumulative: SQNR in dB of the op's output inside the quantized model
            (errors of earlier layers included).
        max_abs_error: largest absolute error of the op's output, alone.
        inputs: its quantized activation inputs (empty for weight-only quantization).
    """

    layer: Layer
    sqnr: float
    sqnr_cumulative: float
    max_abs_error: float
    inputs: tuple[ActivationRange, ...]

    @property
    def clipped(self) -> float:
        """The largest clipped fraction among the activation inputs."""
        return max((r.clipped for r in self.inputs), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.layer.name, "module": self.layer.module, "op": self.layer.op,
            "sqnr_db": _num(self.sqnr), "sqnr_cumulative_db": _num(self.sqnr_cumulative),
            "max_abs_error": self.max_abs_error, "clipped": self.clipped,
            "inputs": [{"tensor": r.tensor, "q_range": list(r.q_range) if r.q_range else None,
                        "observed": list(r.observed), "clipped": r.clipped} for r in self.inputs],
        }


def _num(x: float):
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _fmt_range(r) -> str:
    return "dynamic" if r is None else f"[{r[0]:.3g}, {r[1]:.3g}]"


@dataclass
class LayerReport:
    """Per-layer numerics from :func:`compare`.

    ``rows`` are in graph order; ``ranked`` puts the worst layer (lowest SQNR) first.
    ``print(report)`` shows a table; ``report.to_json()`` the same as JSON.
    """

    rows: list[LayerRow]
    batches: int

    @property
    def ranked(self) -> list[LayerRow]:
        return sorted(self.rows, key=lambda r: r.sqnr)

    @property
    def worst(self) -> LayerRow:
        return self.ranked[0]

    def to_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "rows": [r.to_dict() for r in self.rows]}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        rank = {id(r): i for i, r in enumerate(self.ranked, 1)}
        head = (f"{'layer':<44} {'op':<7} {'SQNR dB':>8} {'cum. dB':>8} {'max|err|':>9} "
                f"{'int8 range':>20} {'observed':>20} {'clipped':>8} {'rank':>4}")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            worst_in = max(r.inputs, key=lambda a: a.clipped, default=None)
            q = _fmt_range(worst_in.q_range) if worst_in else "-"
            obs = _fmt_range(worst_in.observed) if worst_in else "-"
            lines.append(
                f"{r.layer.label[:44]:<44} {r.layer.op:<7} {r.sqnr:>8.2f} {r.sqnr_cumulative:>8.2f} "
                f"{r.max_abs_error:>9.3g} {q:>20} {obs:>20} {100 * r.clipped:>7.3f}% {rank[id(r)]:>4}"
            )
        lines.append(f"worst: {self.worst.layer.label} at {self.worst.sqnr:.2f} dB ({self.batches} batches)")
        return "\n".join(lines)


class _Tap(torch.nn.Module):
    def __init__(self, key: str, sink: dict) -> None:
        super().__init__()
        self.key, self.sink = key, sink

    def forward(self, x):
        self.sink[self.key] = x.detach()
        return x


class _Swap(torch.nn.Module):
    """Returns the float model's value of the same node instead of its input."""

    def __init__(self, key: str, source: dict) -> None:
        super().__init__()
        self.key, self.source = key, source

    def forward(self, x):
        return self.source[self.key]


def _splice(gm: GraphModule, node: Node, module: torch.nn.Module, users=None) -> None:
    """Insert ``module`` after ``node``; route ``users`` (default: all) through it."""
    name = unique_attr_name(gm, "_qk_debug_")
    gm.add_submodule(name, module)
    targets = list(node.users) if users is None else list(users)
    with gm.graph.inserting_after(node):
        new = gm.graph.call_module(name, (node,))
    for user in targets:
        user.replace_input_with(node, new)


def _float_graph(float_model: torch.nn.Module, batch) -> GraphModule:
    if isinstance(float_model, GraphModule):
        if any(n.op == "call_function" and n.target in DEQUANTIZE_OPS for n in float_model.graph.nodes) or \
                float_model.meta.get("quantkit_prepared"):
            raise TypeError("float_model must be the float model (or its captured graph), not a prepared or quantized one")
        gm = copy.deepcopy(float_model)
    else:
        gm = copy.deepcopy(capture(float_model, batch))
    fold_conv_bn(gm)  # as prepare does, so conv outputs match the quantized graph's
    return gm


def _static_range(q: Node) -> tuple[float, float, float] | None:
    """``(lo, hi, scale)`` of a static per-tensor quantizer; None for a dynamic one."""
    if q.target is not _QD.quantize_per_tensor.default:
        return None
    _, scale, zp, qmin, qmax, dtype = q.args[:6]
    ends = torch.tensor([qmin, qmax]).to(dtype)
    lo, hi = dequantize(ends, scale, zp, qmin, qmax, dtype).tolist()
    return lo, hi, float(scale)


class _Stats:
    def __init__(self) -> None:
        self.signal = self.noise = self.noise_cum = 0.0
        self.max_err = 0.0


class _InputStats:
    def __init__(self, static) -> None:
        self.q_range = static[:2] if static else None
        # a value clips when it lies more than half a step beyond the ends (its error then exceeds scale/2)
        self.limits = (static[0] - static[2] / 2, static[1] + static[2] / 2) if static else None
        self.lo, self.hi = math.inf, -math.inf
        self.clipped = self.count = 0


def _sqnr(signal: float, noise: float) -> float:
    # 10·log10(Σref² / Σerr²) over all batches: quantkit._qmath.sqnr for one batch
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


class _Step(torch.nn.Module):
    """Runs the three instrumented graphs on one batch and accumulates statistics."""

    def __init__(self, runs, layers, inputs, sinks) -> None:
        super().__init__()
        self.runs, self.layers, self.inputs, self.sinks = runs, layers, inputs, sinks
        self.stats = {layer.name: _Stats() for layer in layers}
        self.input_stats = {src: _InputStats(q_range) for src, q_range in inputs.items()}

    def forward(self, *args, **kwargs):
        batch = (args, kwargs)
        for sink, model in zip(self.sinks, self.runs):
            sink.clear()
            model(*batch[0], **batch[1])
        f, cum, loc = self.sinks
        for layer in self.layers:
            ref, st = f[layer.name].double(), self.stats[layer.name]
            err_loc = ref - loc[layer.name].double()
            st.signal += float(ref.pow(2).sum())
            st.noise += float(err_loc.pow(2).sum())
            st.noise_cum += float((ref - cum[layer.name].double()).pow(2).sum())
            st.max_err = max(st.max_err, float(err_loc.abs().max()) if err_loc.numel() else 0.0)
        for src, ist in self.input_stats.items():
            x = f[src]
            if x.numel() == 0:
                continue
            ist.lo, ist.hi = min(ist.lo, float(x.min())), max(ist.hi, float(x.max()))
            if ist.limits is not None:
                ist.clipped += int(((x < ist.limits[0]) | (x > ist.limits[1])).sum())
            ist.count += x.numel()
        return None


def compare(float_model: torch.nn.Module, quantized_model: GraphModule, data: Iterable, *,
            max_batches: int | None = None) -> LayerReport:
    """Per-layer SQNR, max error, int8 range against observed range, and clipping.

    Neither model is modified (the recording runs on copies).

    Args:
        float_model: the float model the quantized one was made from (or its
            captured graph).
        quantized_model: the converted model (``quantkit.convert`` / ``quantize``).
        data: batches to compare on.
        max_batches: stop after this many batches.

    Returns:
        A :class:`LayerReport`; ``report.worst`` is the layer with the lowest SQNR.

    Example:
        >>> report = quantkit.debug.compare(model, qmodel, [(x,)])
        >>> print(report)
    """
    if not isinstance(quantized_model, GraphModule):
        raise TypeError(f"quantized_model must be the GraphModule from quantkit.convert, got {type(quantized_model).__name__}")
    data = reiterable(data, "comparison")
    first = next(iter(data), None)
    if first is None:
        raise ValueError("comparison data is empty; pass at least one batch")
    layer_nodes = [n for n in quantized_model.graph.nodes
                   if n.op == "call_function" and n.name in {layer.name for layer in find_layers(quantized_model)}]
    if not layer_nodes:
        raise ValueError("quantized_model has no quantized ops; pass the output of quantkit.convert or quantkit.quantize")
    float_gm = _float_graph(float_model, first)
    float_names = {n.name: n for n in float_gm.graph.nodes}

    # each layer's quantized activation inputs, named by the tensor they quantize
    inputs: dict[str, tuple | None] = {}
    per_layer: dict[str, list[str]] = {}
    for node in layer_nodes:
        srcs = []
        for arg in node.args[:2]:
            dq = source_dequantize(arg)
            q = dq.args[0] if dq is not None else None
            if isinstance(q, Node) and q.op == "call_function" and q.target in QUANTIZE_OPS:
                src = q.args[0]
                inputs[src.name] = _static_range(q)
                srcs.append(src.name)
        per_layer[node.name] = srcs
    missing = [name for name in list(per_layer) + list(inputs) if name not in float_names]
    if missing:
        raise ValueError(
            f"node {missing[0]!r} of quantized_model is not in float_model's graph; "
            "pass the float model the quantized model was made from"
        )

    sinks = ({}, {}, {})
    float_run = float_gm
    cum_run, loc_run = copy.deepcopy(quantized_model), copy.deepcopy(quantized_model)
    for name in dict.fromkeys(list(per_layer) + list(inputs)):
        _splice(float_run, float_names[name], _Tap(name, sinks[0]))
    # swaps before taps: a layer's output may itself be the input of a quantizer
    loc_nodes = {n.name: n for n in loc_run.graph.nodes}
    for name in inputs:
        node = loc_nodes[name]
        quantizers = [u for u in node.users if u.op == "call_function" and (u.target in QUANTIZE_OPS or u.target in _CHOOSE)]
        _splice(loc_run, node, _Swap(name, sinks[0]), users=quantizers)
    for run, sink in ((cum_run, sinks[1]), (loc_run, sinks[2])):
        nodes = {n.name: n for n in run.graph.nodes}
        for name in per_layer:
            _splice(run, nodes[name], _Tap(name, sink))
    for run in (float_run, cum_run, loc_run):
        run.recompile()

    layers = [layer_of(n) for n in layer_nodes]
    step = _Step((float_run, cum_run, loc_run), layers, inputs, sinks)
    batches = run_batches(step, data, progress=False, max_batches=max_batches, desc="comparing", what="comparison")
    rows = []
    for layer in layers:
        st = step.stats[layer.name]
        ranges = tuple(
            ActivationRange(src, step.input_stats[src].q_range, (step.input_stats[src].lo, step.input_stats[src].hi),
                            step.input_stats[src].clipped / max(step.input_stats[src].count, 1))
            for src in per_layer[layer.name]
        )
        rows.append(LayerRow(layer, _sqnr(st.signal, st.noise), _sqnr(st.signal, st.noise_cum), st.max_err, ranges))
    return LayerReport(rows, batches)
