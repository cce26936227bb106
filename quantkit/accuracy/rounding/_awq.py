"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"): scale the input channels of linears sharing an input by ``s = mean|x|^α``
(weights ``W·s``, activations ``x/s``) so that the salient channels lose less to rounding.

For each group of linears that read the same activation, α is searched over
0, 1/20, …, 19/20 (the paper's grid) to minimise, with the weights rounded to nearest in
their own scheme, the output error of the block the group feeds, as the reference code does
(``_region``, found in the graph: the attention up to its SDPA for ``q/k/v``, the gated MLP
up to ``silu(gate) * up`` for ``gate/up``, or, with ``block_end="residual"``, the reference's
module outputs, ``o_proj`` and ``down_proj`` included; a group that feeds only its own
linear, ``o_proj`` or ``down_proj``, is scored by that linear's output); ``s`` is normalised
by ``sqrt(max s · min s)`` as in the reference code. The rows are a uniform sample of every
calibration batch's rows (``_sample``: bottom-k keys, seeded), and every grid point is scored
in one batched computation (chunked to bound memory): the output error
``‖X Wᵀ - X Q(s)ᵀ‖²`` as ``tr(D XᵀX Dᵀ)`` with ``D = W - Q(s)``, when the sample has more rows
than the layer has inputs. ``1/s`` is folded into the op before the group where that op feeds
only these linears (SmoothQuant's folding helpers, ``_folding``: a LayerNorm/RMSNorm, decomposed
or not; a linear's output rows; a gated MLP's ``up`` rows), otherwise an explicit ``mul`` is
inserted, or, where the observers declare ``awq_fold_only``, the group is left unscaled. Scales
folded into an earlier group's rows leave its integers unchanged (a row is a whole number of
groups); every scaled weight's qparams are fixed last. Optionally, each group of each weight is then clipped to the fraction of
its max |w| (1, 0.95, …, 0.55) with the least output error (the reference's ``auto_clip``),
all fractions scored at once through the groups' blocks of ``XᵀX``; query and key projections
are not clipped (the reference skips them: their output error says little about attention's).

``algorithm="awq+gptq"`` runs the scale search and the folding here and leaves the rounding
(and so the clipping) to GPTQ, after calibrate's pass, on the scaled weights; its scales are
scored by the linears' own outputs (``AWQConfig.loss="auto"``: measured better there).
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
from .._folding import FoldGroup, apply_fold, attr_use_counts, fold_target, insert_mul
from .._wscheme import WeightScheme
from ._base import RoundedLinear, Tapped, observer_unwrapper, record_rounding, rounding_plan
from ._region import BatchSample, RegionScorer, feeds_attention_scores, output_region, store_tap
from ._sample import RowSample
from ._sync import distributed_rounding, sync_batch_sample, sync_row_stats, synced_pass

__all__ = ["AWQConfig", "AWQ_ALGORITHMS", "awq_scales", "awq_clip", "run_awq", "awq_hook"]

# the weight algorithms whose linears get AWQ's scales; the second is then rounded by GPTQ
AWQ_ALGORITHMS = ("awq", "awq+gptq")


@dataclass(frozen=True)
class AWQConfig:
    """AWQ settings.

    Args:
        n_grid: points of the α grid in [0, 1) (20 in the paper and reference code).
        clip: search a per-group clipping range after scaling (the reference's ``auto_clip``).
        clip_grid: shrink steps of 5% (the reference: 20 steps, up to ``max_shrink`` 0.5).
        max_shrink: the most the clipping range shrinks (0.5 in the reference).
        rows: activation rows kept per group of linears for the scale search (a uniform
            sample of every batch's rows).
        clip_rows: of those, rows used by the clipping search (512 tokens in the reference).
        seed: seed of the row sample.
        loss: ``"block"`` (the reference's): score a group's scales by the output of the block
            it feeds (attention, MLP: ``_region``); ``"linear"``: by its linears' own outputs;
            ``"auto"``: block for ``awq``, linear for ``awq+gptq`` (each measured better on
            SmolLM2 int4 g64: AWQ +21.2% vs +22.0%, AWQ+GPTQ +8.5% vs +10.4%; BENCHMARKS.md).
        block_rows: rows (tokens) of the whole calibration batches kept for blocks that mix a
            sequence's rows (attention); row-wise blocks (the MLP) use the ``rows`` sample.
        block_candidates: the block loss scores the no-scaling point and this many best grid
            points by the linears' own output error (None: every grid point).
        block_end: where the block ends (``_region``): ``"merge"``, where the group's outputs
            meet (the attention's SDPA, the MLP's ``silu(gate) * up``; measured better on
            SmolLM2), or ``"residual"``, the module output up to the residual add (the reference's).
        clip_qk: also clip the query and key projections (the reference skips them: their
            output error says little about the attention's).
    """

    n_grid: int = 20
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    rows: int = 2048
    clip_rows: int = 512
    seed: int = 0
    loss: str = "auto"
    block_rows: int = 2048
    block_candidates: int | None = None
    block_end: str = "merge"
    clip_qk: bool = False

    def __post_init__(self) -> None:
        if self.loss not in ("auto", "block", "linear"):
            raise ValueError(f"loss must be 'auto', 'block' or 'linear', got {self.loss!r}")
        if self.block_candidates is not None and (isinstance(self.block_candidates, bool)
                                                  or not isinstance(self.block_candidates, int)
                                                  or self.block_candidates < 1):
            raise ValueError(f"block_candidates must be a positive int or None, got {self.block_candidates!r}")
        if self.block_end not in ("merge", "residual"):
            raise ValueError(f"block_end must be 'merge' or 'residual', got {self.block_end!r}")
        for name in ("n_grid", "clip_grid", "rows", "clip_rows", "block_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 0.0 <= self.max_shrink < 1.0:
            raise ValueError(f"max_shrink must be in [0, 1), got {self.max_shrink!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")


class _RowStats(torch.nn.Module):
    """Mean |x| per channel (last dim) of everything seen, and a uniform sample of rows."""

    def __init__(self, keep: int, seed: int = 0) -> None:
        super().__init__()
        self.keep = keep
        self.abs_sum = None
        self.sums: list[torch.Tensor] = []  # per batch: distributed AWQ sums them again in one order
        self.count = 0
        self.sample = RowSample(keep, seed)

    def forward(self, x):
        flat = real_tokens(x.detach())
        flat = flat.reshape(-1, flat.shape[-1]).float()
        if flat.shape[0]:
            s = flat.abs().sum(0, dtype=torch.float64)
            self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
            self.sums.append(s)
            self.count += flat.shape[0]
            self.sample.add(flat)
        return x


# bytes of one chunk's largest temporary in the batched searches (grid points scored together)
_CHUNK_BYTES = 128 << 20


def _candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, n_grid: int) -> tuple[torch.Tensor, list]:
    """``[1 + 2 n_grid, K]`` scales: none (ones), the paper's ``x^α`` (the reference clamps at
    1e-4), then AutoAWQ's ``duo_scaling`` ``x^α / w^(1-α)``; each normalised by
    ``sqrt(max s · min s)``. Also the α of each row (None for the first)."""
    alpha = (torch.arange(n_grid, dtype=torch.float32) / n_grid)[:, None]
    paper = x_mean.clamp(min=1e-4)[None].pow(alpha)
    duo = (x_mean[None].pow(alpha) / (w_mean[None].pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
    s = torch.cat([paper, duo])
    s = s / (s.amax(1, keepdim=True) * s.amin(1, keepdim=True)).sqrt()
    alphas = [None] + [i / n_grid for i in range(n_grid)] * 2
    return torch.cat([torch.ones(1, s.shape[1]), s]), alphas


def scale_errors(x: torch.Tensor, weights: list[torch.Tensor], schemes: list[WeightScheme],
                 scales: torch.Tensor) -> torch.Tensor:
    """The output error ``Σ_w ‖x wᵀ - (x / s) RTN(w · s)ᵀ‖²`` (float64, ``[P]``) of each row
    ``s`` of ``scales`` (``[P, K]``) on the rows ``x`` (``[T, K]``), grid points batched."""
    t, k = x.shape
    gram = x.T @ x if k < t else None  # tr(D XᵀX Dᵀ) costs N·K² against T·N·K directly
    errs = torch.zeros(scales.shape[0], dtype=torch.float64)
    for w, scheme in zip(weights, schemes):
        n = w.shape[0]
        step = max(1, _CHUNK_BYTES // (4 * n * max(k, t if gram is None else 0)))
        for p0 in range(0, scales.shape[0], step):
            s = scales[p0:p0 + step, None, :]                                  # [c, 1, K]
            q = scheme.rtn((w[None] * s).reshape(-1, k)).reshape(-1, n, k)
            d = w[None] - q / s  # the weight the scaled model computes with, in x's units
            if gram is not None:
                errs[p0:p0 + step] += ((d @ gram) * d).sum((1, 2), dtype=torch.float64)
            else:
                errs[p0:p0 + step] += (x @ d.transpose(1, 2)).pow(2).sum((1, 2), dtype=torch.float64)
    return errs


def awq_scales(x: torch.Tensor, x_mean_abs: torch.Tensor, weights: list[torch.Tensor],
               schemes: list[WeightScheme], n_grid: int = 20, *, scorer: RegionScorer | None = None,
               candidates: int | None = None) -> tuple[torch.Tensor | None, float | None]:
    """The per-input-channel scales ``s`` (and the α) with the least output error of the
    linears ``weights`` on the rows ``x``; ``(None, None)`` when no α beats no scaling.
    Both the paper's ``mean|x|^α`` and AutoAWQ's ``duo_scaling`` (its default) are searched,
    every grid point in one batched computation (:func:`scale_errors`).

    With ``scorer`` (the block the linears feed), the error is the block's output error
    instead; ``candidates``: only no scaling and that many grid points with the least linear
    output error are run through the block (None: all)."""
    scales, alphas = _candidate_scales(x_mean_abs.float(), _weight_mean(weights, schemes), n_grid)
    if scorer is None or candidates is not None:
        errs = scale_errors(x, weights, schemes, scales)
    if scorer is not None:
        if candidates is None:
            idx = list(range(scales.shape[0]))
        else:
            idx = [0] + sorted(int(i) + 1 for i in torch.argsort(errs[1:], stable=True)[:candidates])
        dtypes = [scorer.dtype(j) for j in range(len(weights))]
        trial = ([(scheme.rtn(w * scales[i]) / scales[i]).to(dt) for w, scheme, dt in zip(weights, schemes, dtypes)]
                 for i in idx)
        errs = torch.full((scales.shape[0],), float("inf"), dtype=torch.float64)
        errs[idx] = scorer.errors(trial)
    best = int(torch.argmin(errs))  # the first of equal errors, as a loop keeping strict improvements
    return (None, None) if best == 0 else (scales[best], alphas[best])


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
    group output ``x_g · w_gᵀ`` is closest to the unclipped float one (least squares over ``x``).

    Every fraction is scored at once: the error of a group is ``d H_g dᵀ`` with ``d`` the
    rounding error of the clipped group and ``H_g = x_gᵀ x_g`` (float64)."""
    n, k = w.shape
    gs = scheme.group(k)
    g = k // gs
    xg = x.reshape(x.shape[0], g, gs).double()
    hg = torch.einsum("tgc,tgd->gcd", xg, xg)                       # [G, gs, gs]
    wg = w.reshape(n, g, gs)
    amax = wg.abs().amax(-1, keepdim=True)
    steps = max(1, int(max_shrink * grid))
    best_err = torch.full((n, g), float("inf"), dtype=torch.float64)
    best = wg.clone()
    chunk = max(1, _CHUNK_BYTES // (8 * n * k))
    for i0 in range(0, steps, chunk):
        frac = 1 - torch.arange(i0, min(i0 + chunk, steps), dtype=torch.float32) / grid
        m = amax[None] * frac[:, None, None, None]                      # [S, N, G, 1]
        cand = torch.maximum(torch.minimum(wg[None], m), -m)            # [S, N, G, gs]
        q = scheme.rtn(cand.reshape(-1, k)).reshape(cand.shape)
        d = (q - wg[None]).double()
        err = (torch.einsum("sngc,gcd->sngd", d, hg) * d).sum(-1)      # [S, N, G]
        low, at = err.min(0)  # the first of equal errors: the wider range
        better = low < best_err
        best_err = torch.where(better, low, best_err)
        pick = cand.gather(0, at[None, ..., None].expand(1, n, g, gs))[0]
        best = torch.where(better[..., None], pick, best)
    return best.reshape(n, k)


def _regions(tapped: Tapped, groups: dict, config: AWQConfig) -> dict:
    """Per group (by its source node), the block its linears feed, where there is one beyond the
    linear itself (``_region``), for the groups scored by the block loss (:func:`_loss`)."""
    out = {}
    for src, lins in groups.items():
        if _loss(config, lins) != "block":
            continue
        region = output_region(tapped.env[src], [tapped.env[lin.node] for lin in lins], tapped.gm,
                               end=config.block_end)
        if region is not None and not region.trivial:
            out[src] = region
    return out


def _loss(config: AWQConfig, lins: list[RoundedLinear]) -> str:
    if config.loss != "auto":
        return config.loss
    return "block" if all(lin.algorithm == "awq" for lin in lins) else "linear"


def _scorer(prepared: GraphModule, region, lins, x: torch.Tensor, sample: BatchSample, index: int,
            modified: set) -> RegionScorer | None:
    weights = [lin.weight for lin in lins]
    reads = {str(a.target) for n in region.nodes for a in n.all_input_nodes if a.op == "get_attr"}
    if (reads - set(weights)) & modified:
        return None  # an earlier group changed a weight inside this block: its captured outputs are stale
    if region.separable:
        dtype = region.src.meta["val"].dtype if "val" in region.src.meta else x.dtype
        batches = [{"src": x.to(dtype)}]
    else:
        batches = sample.values(index)
        if not batches:
            return None
    return RegionScorer(prepared, region, weights, batches)


def run_awq(prepared: GraphModule, linears: list[RoundedLinear], data: Iterable, *,
            max_batches: int | None, config: AWQConfig = AWQConfig()) -> list[dict]:
    """Scale (and clip) the weights of ``linears`` with AWQ, from one pass over ``data``."""
    groups: dict[Node, list[RoundedLinear]] = {}
    for lin in linears:
        groups.setdefault(lin.source, []).append(lin)
    tapped = Tapped(prepared)
    regions = _regions(tapped, groups, config)
    index = {src: i for i, src in enumerate(groups)}
    sample = BatchSample(config.block_rows, config.seed)
    slots: dict[Node, list[tuple]] = {}  # tapped node -> the (group, name) slots its value fills
    for src, region in regions.items():
        if not region.separable:
            slots.setdefault(region.src, []).append((index[src], "src"))
            for i, n in enumerate(region.inputs):
                slots.setdefault(n, []).append((index[src], f"in{i}"))
    stats = {src: _RowStats(config.rows, config.seed) for src in groups}
    prepared_of = {new: old for old, new in tapped.env.items()}
    taps = list(stats.items()) + [(prepared_of[n], store_tap(sample, s)) for n, s in slots.items()]
    # the pass stops after the last tapped value (the head after the last group is not run); of the
    # taps on that node the first inserted ends up last (each goes in right after the node)
    order = {n: i for i, n in enumerate(prepared.graph.nodes)}
    last = max(range(len(taps)), key=lambda i: (order[taps[i][0]], -i))
    for i, (node, module) in enumerate(taps):
        tapped.tap(node, module, stop=i == last)
    around = sample.batch if slots else None

    def sync():
        sync_row_stats(stats.values())
        sync_batch_sample(sample)

    seen = synced_pass(lambda: tapped.run(data, max_batches=max_batches, desc="awq", around=around), sync)
    tapped.clear()
    if seen == 0:
        raise CalibrationError("calibration data is empty: no batches were run; AWQ needs representative batches")
    counts = attr_use_counts(prepared)
    unwrap = observer_unwrapper(prepared)
    records, done = [], []
    modified: set[str] = set()
    for src, lins in groups.items():
        st = stats[src]
        if st.abs_sum is None:
            continue  # never reached by calibration: rounded to nearest
        x = st.sample.rows
        weights = [get_attr(prepared, lin.weight).detach().float() for lin in lins]
        schemes = [WeightScheme.of(lin.observer) for lin in lins]
        # the linears' direct inputs from src (the linears, or activation observers before them)
        users = list(dict.fromkeys(u for lin in lins for u in src.users if u is lin.node or lin.node in u.users))
        group = FoldGroup(src, users)
        target = fold_target(prepared, group, counts, unwrap=unwrap)
        scorer, loss = None, "linear"
        if target is None and all(getattr(lin.observer, "awq_fold_only", False) for lin in lins):
            s, alpha, kind = None, None, "unscaled"  # no op to fold 1/s into, and no mul wanted
        else:
            if src in regions:
                scorer = _scorer(prepared, regions[src], lins, x, sample, index[src], modified)
                loss = "linear" if scorer is None else "block"
            s, alpha = awq_scales(x, st.abs_sum / st.count, weights, schemes, config.n_grid,
                                  scorer=scorer, candidates=config.block_candidates)
            kind = None
        if s is not None:
            if target is None:
                insert_mul(prepared, group, (1.0 / s), index[src])
                kind = "mul"
            else:
                kind, attrs = target
                # the rows of a linear upstream (its integers unchanged: a row is a whole number of groups)
                apply_fold(prepared, attrs, s)
                modified.update(name for name, _ in attrs)
            weights = [w * s for w in weights]  # (a fold goes upstream of src: never into these)
            x = x / s
        for lin, w, scheme in zip(lins, weights, schemes):
            clip = config.clip and lin.algorithm == "awq"  # awq+gptq: GPTQ chooses the ranges
            if clip and not config.clip_qk and feeds_attention_scores(tapped.env[lin.node]):
                clip = False
            if clip:
                # the sample is in key order (random): its first rows are a uniform sample too
                w = awq_clip(x[:config.clip_rows], w, scheme, config.clip_grid, config.max_shrink)
            set_attr(prepared, lin.weight, w.to(get_attr(prepared, lin.weight).dtype))
            modified.add(lin.weight)
            done.append(lin)
            records.append({"layer": lin.node.name, "algorithm": lin.algorithm, "alpha": alpha, "loss": loss,
                            "clipped": clip,
                            "folded_into": kind if kind in (None, "mul", "unscaled") else f"{kind}:{src.name}"})
    for lin in done:  # last: a later group's 1/s may have gone into an earlier group's rows
        # the observer's own (round-to-nearest) qparams of the final weight, fixed
        obs, new = lin.observer, get_attr(prepared, lin.weight)
        obs.observe_weight(new) if hasattr(obs, "observe_weight") else obs(new)
        obs.set_qparams(*obs.calculate_qparams())
    prepared.recompile()
    return records


@register_calibration_hook("awq", when="before_pass")
def awq_hook(cal: CalibrationRun) -> Callable[[], None] | None:
    """Before calibrate's pass (so that activation observers see the scaled activations), when
    weight observers ask for AWQ (or AWQ+GPTQ): scale (and for AWQ clip) their linears from one
    pass over the data."""
    awq = [lin for lin in rounding_plan(cal) if lin.algorithm in AWQ_ALGORITHMS]
    if not awq:
        return None

    def step() -> None:
        with distributed_rounding(cal.distributed):
            records = run_awq(cal.prepared, awq, cal.data, max_batches=cal.max_batches)
        record_rounding(cal, records)

    return step
