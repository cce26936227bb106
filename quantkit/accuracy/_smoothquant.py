"""smooth_quant: move activation outliers into the weights before quantizing (Xiao et al. 2022).

For a linear ``y = x W^T`` and a per-input-channel factor ``s``,
``y = (x / s) (W s)^T`` exactly; with ``s_j = max|x_j|^α / max|W_:,j|^(1−α)`` the
activation's outlier channels shrink and the weight's columns grow, so both quantize
well. ``1/s`` is folded into the op that produces ``x`` when ``x`` feeds only the
linears being smoothed (a LayerNorm/RMSNorm's affine parameters, or a linear's output
rows); otherwise an explicit ``x * (1/s)`` is inserted before them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable

import torch
from torch.fx import GraphModule

from quantkit.observers._tokens import real_tokens

from quantkit.quantizers import Granularity, QuantConfig, W8A8Quantizer

from .._graph import get_attr
from .._qmath import choose_qparams, fake_quantize, fake_quantize_fused, fake_quantize_per_token, underlying_dtype
from ..pipeline._calibrate import run_batches
from ..pipeline._capture import capture
from ..pipeline._distributed import use_distributed
from ..pipeline._layers import DEQUANTIZE_OPS, layer_of
from ..pipeline._sharing import observer_for_spec
from ._folding import FoldGroup, apply_fold, attr_use_counts, fold_target, insert_mul, own_attr
from ._metrics import reiterable
from .rounding._sync import sync_channel_stats, synced_pass

__all__ = ["smooth_quant", "smoothquant_statistics", "SmoothQuantStatistics", "parse_alpha", "SMOOTHQUANT_META_KEY"]

aten = torch.ops.aten
# gm.meta entry: one record per smoothed group of linears
SMOOTHQUANT_META_KEY = "quantkit_smoothquant"

# alpha="auto" grid: 0, 0.05, ..., 1 (the SmoothQuant paper sweeps 0.4–0.9; the full
# range costs little), plus "no smoothing" so a layer is never made worse
_AUTO_GRID = [None] + [i / 20 for i in range(21)]
# activation rows kept per group for the alpha search
_AUTO_ROWS = 1024
# bounds on s: keep 1/s and W·s finite in float32
_S_MIN, _S_MAX = 1e-5, 1e5


def parse_alpha(text: str) -> float | str:
    """Parse a CLI value for ``--smoothquant``: a number in [0, 1] or ``auto``.

    Raises:
        ValueError: anything else.
    """
    value = str(text).strip().lower()
    if value == "auto":
        return "auto"
    try:
        alpha = float(value)
    except ValueError:
        raise ValueError(f"--smoothquant expects a number in [0, 1] or 'auto', got {text!r}") from None
    return _check_alpha(alpha)


def _check_alpha(alpha) -> float | str:
    if alpha == "auto":
        return alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"alpha must be a number in [0, 1] or 'auto', got {alpha!r}")
    if not (0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be in [0, 1] (or 'auto'), got {alpha}")
    return float(alpha)


def _groups(gm: GraphModule) -> list[FoldGroup]:
    counts = attr_use_counts(gm)
    groups = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.dtype == torch.float32):
            continue
        linears = [u for u in node.users if u.op == "call_function" and u.target is aten.linear.default
                   and u.args[0] is node and own_attr(u.args[1], counts)
                   and (len(u.args) < 3 or u.args[2] is None or own_attr(u.args[2], counts))]
        if linears:
            groups.append(FoldGroup(node, linears))
    return groups


class _ChannelStats(torch.nn.Module):
    """Per-channel (last dim) min and max of everything seen, and a sample of rows."""

    def __init__(self, keep_rows: int) -> None:
        super().__init__()
        self.min = self.max = None
        self.keep_rows = keep_rows
        self.rows: list[torch.Tensor] = []
        self.kept = 0
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x):
        if x.numel() == 0:  # a zero-width layer's input: no channel to measure (the group is skipped)
            return x
        flat = real_tokens(x.detach())  # padding tokens left out (calibration's token_mask)
        flat = flat.reshape(-1, flat.shape[-1]).float()
        if flat.numel():
            mn, mx = flat.amin(0), flat.amax(0)
            self.min = mn if self.min is None else torch.minimum(self.min, mn)
            self.max = mx if self.max is None else torch.maximum(self.max, mx)
            take = min(self.keep_rows - self.kept, flat.shape[0], max(self.keep_rows // 4, 1))
            if take > 0:
                idx = torch.randperm(flat.shape[0], generator=self.gen)[:take]
                self.rows.append(flat[idx].cpu())
                self.kept += take
        return x


def _collect(gm: GraphModule, groups: list[FoldGroup], data: Iterable, keep_rows: int,
             distributed: bool = False) -> list[_ChannelStats]:
    tapped = copy.deepcopy(gm)
    nodes = {n.name: n for n in tapped.graph.nodes}
    stats = []
    for i, group in enumerate(groups):
        mod = _ChannelStats(keep_rows)
        tapped.add_submodule(f"_qk_smooth_stats_{i}", mod)
        src = nodes[group.source.name]
        with tapped.graph.inserting_after(src):
            tap = tapped.graph.call_module(f"_qk_smooth_stats_{i}", (src,))
        for user in list(src.users):
            if user is not tap:
                user.replace_input_with(src, tap)
        stats.append(mod)
    tapped.recompile()
    n = synced_pass(lambda: run_batches(tapped, data, progress=False, max_batches=None, desc="smoothquant",
                                        what="calibration", skip_padding=True),
                    lambda: sync_channel_stats(stats), distributed)  # every rank's batches, when distributed
    if n == 0:
        raise ValueError("calibration data is empty; pass at least one batch")
    return stats


@dataclass(frozen=True)
class SmoothQuantStatistics:
    """What :func:`smooth_quant` measures of a captured float graph on calibration data, for every
    input it can smooth: per-channel activation ranges and (``rows`` > 0) the row sample that
    ``alpha="auto"`` scores on. One collection serves several :func:`smooth_quant` calls on the
    same graph and data (a search trying SmoothQuant under two activation schemes runs the data
    once): the same statistics, so the same factors. Make it with :func:`smoothquant_statistics`."""

    graph: GraphModule  # the float graph measured (smooth_quant refuses any other)
    rows: int  # rows kept per input for alpha="auto" (0: ranges only)
    stats: dict  # smoothable input node name -> its _ChannelStats


def smoothquant_statistics(gm: GraphModule, calib_data: Iterable, *, rows: int = _AUTO_ROWS,
                           distributed: bool | str = "auto") -> SmoothQuantStatistics:
    """Run ``calib_data`` through the captured float graph ``gm`` once, measuring what
    :func:`smooth_quant` needs; pass the result as its ``statistics=``, with the same graph."""
    if not isinstance(gm, GraphModule):
        raise TypeError(f"smoothquant_statistics expects a captured GraphModule, got {type(gm).__name__}")
    groups = _groups(gm)
    stats = _collect(gm, groups, reiterable(calib_data, "calibration"), rows, use_distributed(distributed)) \
        if groups else []
    return SmoothQuantStatistics(gm, rows, {g.source.name: st for g, st in zip(groups, stats)})


def _scales(act_max: torch.Tensor, w_max: torch.Tensor, alpha: float | None) -> torch.Tensor:
    if alpha is None:
        return torch.ones_like(act_max)
    s = act_max.pow(alpha) / w_max.pow(1 - alpha)
    s = torch.where((act_max > 0) & (w_max > 0), s, torch.ones_like(s))
    return s.clamp(_S_MIN, _S_MAX)


def _quantized_acts(xs: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, config) -> torch.Tensor:
    """``xs`` after the activation quantization ``config`` gives a linear's input: per token
    (the ``quantized_decomposed`` ops ``convert`` emits), dynamic per tensor (its own range), or
    static per tensor over the calibrated ``[lo, hi]``."""
    if hasattr(config, "fake_quant_activations"):  # a config that says how (FP8Config)
        return config.fake_quant_activations(xs, lo, hi)
    if config.dynamic and config.granularity is Granularity.PER_TOKEN:
        return fake_quantize_per_token(xs.float())  # the decomposed int8 per-token ops' values, fused
    scheme = config.activation
    qmin, qmax = scheme.qrange
    if config.dynamic:
        lo, hi = xs.min(), xs.max()
    scale, zp = choose_qparams(lo, hi, qscheme=scheme.qscheme, dtype=scheme.dtype, quant_min=qmin, quant_max=qmax)
    if underlying_dtype(scheme.dtype) in (torch.int8, torch.uint8) and xs.dtype == torch.float32:
        s = float(scale)  # quantize_per_tensor's values (its scale is a Python float), in four passes
        return fake_quantize_fused(xs, 1.0 / s, s, int(zp), qmin, qmax)
    return fake_quantize(xs, scale, zp, qmin, qmax, scheme.dtype)


def _quantized_weight(w: torch.Tensor, config) -> torch.Tensor:
    """``w`` fake-quantized by the weight observer ``config`` names (what convert stores)."""
    if hasattr(config, "fake_quant_weight"):  # a config that says how (FP8Config)
        return config.fake_quant_weight(w)
    obs = observer_for_spec(W8A8Quantizer.weight_spec(config))
    obs(w)
    scale, zp = obs.calculate_qparams()
    axis = 0 if scale.numel() > 1 else None
    return fake_quantize(w, scale, zp, -128, 127, torch.int8, axis=axis)


def _w8a8_error(rows, mn, mx, weights, s, config, refs=None) -> float:
    """Squared output error of the smoothed linears under ``config`` (a ``QuantConfig``):
    its activation scheme and granularity, and its weight observer. ``refs``: the float outputs
    ``rows @ w.T`` (they do not depend on ``s``: the alpha search computes them once per group,
    half its matmuls; the same products, so the same errors)."""
    s = s.float()
    xq = _quantized_acts(rows / s, (mn / s).min(), (mx / s).max(), config)
    if refs is None:
        refs = [rows @ w.T for w in weights]
    err = 0.0
    for w, ref in zip(weights, refs):
        wq = _quantized_weight(w * s, config)
        err += float((ref - xq @ wq.T).double().pow(2).sum())
    return err


def smooth_quant(model: torch.nn.Module, calib_data: Iterable, alpha: float | str = 0.5, *,
                 example_inputs=None, config=None, distributed: bool | str = "auto",
                 statistics: SmoothQuantStatistics | None = None, fold_only: bool = False) -> GraphModule:
    """Return a captured copy of ``model`` with activation outliers moved into linear weights.

    The result computes the same function in float (up to rounding); quantize it as
    usual: ``quantkit.quantize(smooth_quant(model, calib), example_inputs, calib)``.

    Args:
        model: the float model, or a GraphModule from :func:`quantkit.capture`
            (it is copied, never modified).
        calib_data: calibration batches; per-channel activation ranges come from them.
        alpha: migration strength in [0, 1] (0.5 in the paper), or ``"auto"`` to pick,
            per group of linears sharing an input, the α in 0, 0.05, …, 1 (or no
            smoothing) with the least W8A8 output error on calibration activations.
        example_inputs: batch to capture ``model`` with (default: the first
            calibration batch).
        config: the :class:`~quantkit.quantizers.QuantConfig` the result will be quantized
            with (default ``QuantConfig()``: static per-tensor uint8 activations, per-channel
            min-max weights); ``alpha="auto"`` scores each α under it, e.g. per-token
            activations for ``QuantConfig(dynamic=True, granularity="per-token")``; an
            ``FP8Config`` (``FP8Quantizer(...).global_config``) scores on the E4M3 grid.
        distributed: as :func:`quantkit.calibrate`'s: ``"auto"`` (default), under a
            ``torch.distributed`` group of more than one process, takes ``calib_data`` as this
            rank's shard and reduces the activation statistics across ranks, so that every rank
            gets the factors of one process on all the shards in rank order (min/max exact;
            ``alpha="auto"``'s row sample: see ``quantkit.accuracy.rounding._sync``).
        statistics: :func:`smoothquant_statistics` of ``model`` (a captured GraphModule, this
            very object) on ``calib_data``: used instead of running the data again.
        fold_only: smooth only the groups whose ``1/s`` folds into the op before them (a norm,
            decomposed or not, a linear's rows, a gated MLP's ``up`` rows); the others stay
            unsmoothed instead of reading their input through an inserted ``mul``, which
            compressed-tensors and GGUF cannot hold (llm-compressor's mappings do the same).

    Returns:
        The smoothed GraphModule. ``gm.meta["quantkit_smoothquant"]`` lists each
        smoothed group: its linears, modules, α and where ``1/s`` went
        (``"norm:<node>"``, ``"linear:<node>"``, ``"gate:<node>"``, ``"mul"``, or ``"unscaled"``
        with ``fold_only``).

    Example:
        >>> smoothed = quantkit.smooth_quant(model, calib, alpha=0.5)
        >>> qmodel = quantkit.quantize(smoothed, (x[:8],), calib)
    """
    alpha = _check_alpha(alpha)
    if not isinstance(fold_only, bool):
        raise ValueError(f"fold_only must be True or False, got {fold_only!r}")
    distributed = use_distributed(distributed)
    if config is None:
        config = QuantConfig()
    elif not isinstance(config, QuantConfig) and not hasattr(config, "fake_quant_activations"):
        raise TypeError(f"config must be a QuantConfig or FP8Config, got {type(config).__name__}")
    data = reiterable(calib_data, "calibration")
    if isinstance(model, GraphModule):
        if model.meta.get("quantkit_prepared") or any(
                n.op == "call_function" and n.target in DEQUANTIZE_OPS for n in model.graph.nodes):
            raise TypeError("smooth_quant expects a float model; apply it before quantkit.prepare/quantize")
        gm = copy.deepcopy(model)
    elif isinstance(model, torch.nn.Module):
        if example_inputs is None:
            example_inputs = next(iter(data), None)
            if example_inputs is None:
                raise ValueError("calibration data is empty; pass at least one batch")
        gm = copy.deepcopy(capture(model, example_inputs))
    else:
        raise TypeError(f"smooth_quant expects a torch.nn.Module, got {type(model).__name__}")

    groups = _groups(gm)
    if statistics is not None:
        if not isinstance(statistics, SmoothQuantStatistics) or statistics.graph is not model:
            raise ValueError("smooth_quant(statistics=...) takes smoothquant_statistics() of this very graph; "
                             "collect them on the model passed here, or leave statistics out")
        if alpha == "auto" and statistics.rows < _AUTO_ROWS:
            raise ValueError(f"alpha='auto' scores on {_AUTO_ROWS} rows per input; these statistics kept "
                             f"{statistics.rows}: collect them with rows={_AUTO_ROWS}")
        stats = [statistics.stats[g.source.name] for g in groups]
    else:
        stats = _collect(gm, groups, data, _AUTO_ROWS if alpha == "auto" else 0, distributed) if groups else []
    counts = attr_use_counts(gm)
    records = []
    for i, (group, st) in enumerate(zip(groups, stats)):
        if st.min is None:
            continue  # never reached by calibration
        weights = [get_attr(gm, lin.args[1].target).detach() for lin in group.linears]
        if any(w.numel() == 0 for w in weights):
            continue  # a zero-width layer in the group: nothing to balance (it stays float)
        target = fold_target(gm, group, counts)
        if target is None and fold_only:
            layers = [layer_of(lin) for lin in group.linears]
            records.append({"layers": [l.name for l in layers], "modules": [l.module for l in layers],
                            "alpha": None, "folded_into": "unscaled"})
            continue
        act_max = torch.maximum(st.min.abs(), st.max.abs()).double()
        w_max = torch.stack([w.abs().amax(0) for w in weights]).amax(0).double()
        chosen = alpha
        if alpha == "auto":
            rows = torch.cat(st.rows)
            refs = [rows @ w.T for w in weights]
            errors = [_w8a8_error(rows, st.min, st.max, weights, _scales(act_max, w_max, a), config, refs)
                      for a in _AUTO_GRID]
            chosen = _AUTO_GRID[min(range(len(errors)), key=errors.__getitem__)]
        layers = [layer_of(lin) for lin in group.linears]
        record = {"layers": [l.name for l in layers], "modules": [l.module for l in layers], "alpha": chosen}
        if chosen is None:
            records.append({**record, "folded_into": None})
            continue
        s = _scales(act_max, w_max, chosen).float()
        with torch.no_grad():
            for lin in group.linears:
                get_attr(gm, lin.args[1].target).mul_(s)
            if target is None:
                insert_mul(gm, group, (1.0 / s).to(st.min.device), i)
                kind = "mul"
            else:
                kind, attrs = target
                apply_fold(gm, attrs, s)
        records.append({**record, "folded_into": kind if kind == "mul" else f"{kind}:{group.source.name}"})
    gm.recompile()
    gm.meta[SMOOTHQUANT_META_KEY] = records
    return gm
