"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"): scale the input channels of linears sharing an input by ``s = mean|x|^α``
(weights ``W·s``, activations ``x/s``) so that the salient channels lose less to rounding.

For each group of linears that read the same activation, α is searched over
0, 1/20, …, 19/20 (the paper's grid) to minimise the group's output error on calibration
rows with the weights rounded to nearest in their own scheme; ``s`` is normalised by
``sqrt(max s · min s)`` as in the reference code. ``1/s`` is folded into the preceding
LayerNorm/RMSNorm or linear where that op feeds only these linears (SmoothQuant's folding
helpers), otherwise an explicit ``mul`` is inserted. Optionally, each group of each weight
is then clipped to the fraction of its max |w| (1, 0.95, …, 0.55) with the least output error
(the reference's ``auto_clip``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.fx import GraphModule, Node

from quantkit.observers._tokens import real_tokens

from ..._errors import CalibrationError
from ..._graph import get_attr, set_attr
from ...pipeline._hooks import CalibrationRun, register_calibration_hook
from .._folding import FoldGroup, attr_use_counts, fold_target, insert_mul
from .._wscheme import WeightScheme
from ._base import RoundedLinear, Tapped, record_rounding, rounding_plan
from ._sync import distributed_rounding, sync_row_stats, synced_pass

__all__ = ["AWQConfig", "awq_scales", "awq_clip", "run_awq", "awq_hook"]


@dataclass(frozen=True)
class AWQConfig:
    """AWQ settings.

    Args:
        n_grid: points of the α grid in [0, 1) (20 in the paper and reference code).
        clip: search a per-group clipping range after scaling (the reference's ``auto_clip``).
        clip_grid: shrink steps of 5% (the reference: 20 steps, up to ``max_shrink`` 0.5).
        max_shrink: the most the clipping range shrinks (0.5 in the reference).
        rows: activation rows kept per group of linears for the scale search (uniform sample).
        clip_rows: of those, rows used by the clipping search (512 tokens in the reference).
    """

    n_grid: int = 20
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    rows: int = 2048
    clip_rows: int = 512

    def __post_init__(self) -> None:
        for name in ("n_grid", "clip_grid", "rows", "clip_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 0.0 <= self.max_shrink < 1.0:
            raise ValueError(f"max_shrink must be in [0, 1), got {self.max_shrink!r}")


class _RowStats(torch.nn.Module):
    """Mean |x| per channel (last dim) of everything seen, and a uniform sample of rows."""

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep
        self.abs_sum = None
        self.sums: list[torch.Tensor] = []  # per batch: distributed AWQ sums them again in one order
        self.count = 0
        self.rows: list[torch.Tensor] = []
        self.kept = 0
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x):
        flat = real_tokens(x.detach())
        flat = flat.reshape(-1, flat.shape[-1]).float()
        if flat.shape[0]:
            s = flat.abs().sum(0, dtype=torch.float64)
            self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
            self.sums.append(s)
            self.count += flat.shape[0]
            take = min(self.keep - self.kept, flat.shape[0])
            if take > 0:
                idx = torch.randperm(flat.shape[0], generator=self.gen)[:take]
                self.rows.append(flat[idx].cpu())
                self.kept += take
        return x


def _group_error(x: torch.Tensor, weights: list[torch.Tensor], schemes: list[WeightScheme],
                 s: torch.Tensor | None, refs: list[torch.Tensor]) -> float:
    err = 0.0
    for w, scheme, ref in zip(weights, schemes, refs):
        wq = scheme.rtn(w if s is None else w * s)
        out = (x if s is None else x / s) @ wq.T
        err += float((ref - out).double().pow(2).sum())
    return err


def awq_scales(x: torch.Tensor, x_mean_abs: torch.Tensor, weights: list[torch.Tensor],
               schemes: list[WeightScheme], n_grid: int = 20) -> tuple[torch.Tensor | None, float | None]:
    """The per-input-channel scales ``s`` (and the α) with the least output error of the
    linears ``weights`` on the rows ``x``; ``(None, None)`` when no α beats no scaling.
    Both the paper's ``mean|x|^α`` and AutoAWQ's ``duo_scaling`` (its default) are searched."""
    refs = [x @ w.T for w in weights]  # the float outputs
    best_s, best_alpha, best = None, None, _group_error(x, weights, schemes, None, refs)
    x_mean = x_mean_abs.float()
    w_mean = _weight_mean(weights, schemes)
    for duo in (False, True):
        for i in range(n_grid):
            alpha = i / n_grid
            if duo:  # AutoAWQ's duo_scaling: x^α / w^(1-α), w normalised by its group's max
                s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
            else:    # the paper's s = x^α (the reference clamps at 1e-4)
                s = x_mean.clamp(min=1e-4).pow(alpha)
            s = s / (s.max() * s.min()).sqrt()
            err = _group_error(x, weights, schemes, s, refs)
            if err < best:
                best_s, best_alpha, best = s, alpha, err
    return best_s, best_alpha


def _weight_mean(weights: list[torch.Tensor], schemes: list[WeightScheme]) -> torch.Tensor:
    """Mean over output rows of |w| / max|w| of its group, per input channel (AutoAWQ's w_mean)."""
    parts = []
    for w, scheme in zip(weights, schemes):
        n, k = w.shape
        g = w.abs().reshape(n, k // scheme.group(k), -1)
        parts.append((g / g.amax(-1, keepdim=True).clamp(min=1e-12)).reshape(n, k))
    return torch.cat(parts).mean(0)


def awq_clip(x: torch.Tensor, w: torch.Tensor, scheme: WeightScheme, grid: int = 20,
             max_shrink: float = 0.5) -> torch.Tensor:
    """``w`` with each group (of each row) clipped to the fraction of its max |w| whose rounded
    group output ``x_g · w_gᵀ`` is closest to the unclipped float one (least squares over ``x``)."""
    n, k = w.shape
    gs = scheme.group(k)
    xg = x.reshape(x.shape[0], k // gs, gs)                       # [T, G, gs]
    wg = w.reshape(n, k // gs, gs)                                # [N, G, gs]
    ref = torch.einsum("tgc,ngc->ngt", xg, wg)
    amax = wg.abs().amax(-1, keepdim=True)
    best_err = torch.full((n, k // gs), float("inf"), dtype=torch.float64)
    best = wg.clone()
    for i in range(int(max_shrink * grid)):
        m = amax * (1 - i / grid)
        cand = torch.maximum(torch.minimum(wg, m), -m)
        q = scheme.rtn(cand.reshape(n, k)).reshape(n, k // gs, gs)
        err = (torch.einsum("tgc,ngc->ngt", xg, q) - ref).double().pow(2).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[..., None], cand, best)
    return best.reshape(n, k)


def _own_copy(gm: GraphModule, node: Node) -> None:
    """Replace the attributes the op ``node`` reads by copies (the folding below writes them)."""
    for arg in node.args:
        if isinstance(arg, Node) and arg.op == "get_attr":
            set_attr(gm, str(arg.target), get_attr(gm, str(arg.target)).detach().clone())


def run_awq(prepared: GraphModule, linears: list[RoundedLinear], data: Iterable, *,
            max_batches: int | None, config: AWQConfig = AWQConfig()) -> list[dict]:
    """Scale (and clip) the weights of ``linears`` with AWQ, from one pass over ``data``."""
    groups: dict[Node, list[RoundedLinear]] = {}
    for lin in linears:
        groups.setdefault(lin.source, []).append(lin)
    tapped = Tapped(prepared)
    stats = {}
    for src in groups:
        stats[src] = _RowStats(config.rows)
        tapped.tap(src, stats[src])
    seen = synced_pass(lambda: tapped.run(data, max_batches=max_batches, desc="awq"),  # every rank's, when distributed
                       lambda: sync_row_stats(stats.values()))
    tapped.clear()
    if seen == 0:
        raise CalibrationError("calibration data is empty: no batches were run; AWQ needs representative batches")
    counts = attr_use_counts(prepared)
    records = []
    for index, (src, lins) in enumerate(groups.items()):
        st = stats[src]
        if st.abs_sum is None:
            continue  # never reached by calibration: rounded to nearest
        x = torch.cat(st.rows)
        weights = [get_attr(prepared, lin.weight).detach().float() for lin in lins]
        schemes = [WeightScheme.of(lin.observer) for lin in lins]
        s, alpha = awq_scales(x, st.abs_sum / st.count, weights, schemes, config.n_grid)
        kind = None
        if s is not None:
            # the linears' direct inputs from src (the linears, or activation observers before them)
            users = list(dict.fromkeys(u for lin in lins for u in src.users
                                       if u is lin.node or lin.node in u.users))
            group = FoldGroup(src, users)
            if src.op == "call_function":
                _own_copy(prepared, src)
            target = fold_target(prepared, group, counts)
            if target is None:
                insert_mul(prepared, group, (1.0 / s), index)
                kind = "mul"
            else:
                kind, tensors = target
                with torch.no_grad():
                    for t, rows_axis in tensors:
                        t.div_(s[:, None] if rows_axis else s)
            weights = [w * s for w in weights]
            x = x / s
        for lin, w, scheme in zip(lins, weights, schemes):
            if config.clip:
                rows = x[::max(1, x.shape[0] // config.clip_rows)][:config.clip_rows]
                w = awq_clip(rows, w, scheme, config.clip_grid, config.max_shrink)
            set_attr(prepared, lin.weight, w.to(get_attr(prepared, lin.weight).dtype))
            # the observer's own (round-to-nearest) qparams of the new weight, fixed
            obs, new = lin.observer, get_attr(prepared, lin.weight)
            obs.observe_weight(new) if hasattr(obs, "observe_weight") else obs(new)
            obs.set_qparams(*obs.calculate_qparams())
            records.append({"layer": lin.node.name, "algorithm": "awq", "alpha": alpha,
                            "folded_into": kind if kind in (None, "mul") else f"{kind}:{src.name}"})
    prepared.recompile()
    return records


@register_calibration_hook("awq", when="before_pass")
def awq_hook(cal: CalibrationRun) -> Callable[[], None] | None:
    """Before calibrate's pass (so that activation observers see the scaled activations), when
    weight observers ask for AWQ: scale and clip their linears from one pass over the data."""
    awq = [lin for lin in rounding_plan(cal) if lin.algorithm == "awq"]
    if not awq:
        return None

    def step() -> None:
        with distributed_rounding(cal.distributed):
            records = run_awq(cal.prepared, awq, cal.data, max_batches=cal.max_batches)
        record_rounding(cal, records)

    return step
