"""Measuring an int8 model against its float source: metric, per-layer SQNR, latency, reports."""

from __future__ import annotations

import math
import statistics
import time

import torch
from torch.fx import GraphModule

from .. import _hf
from .._errors import QuantkitError
from ..pipeline._inputs import call_model
from .._graph import module_scopes

__all__ = ["output_kind", "compare_models", "time_interleaved", "json_safe", "layer_sqnr", "sqnr_db", "METRIC_NAMES"]

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


# what a model's output is compared as; see output_kind
EMBEDDING, LOGITS, TOKEN_LOGITS, OUTPUT = "embedding", "logits", "token-logits", "output"
METRIC_NAMES = {EMBEDDING: "embedding cosine", LOGITS: "logits cosine",
                TOKEN_LOGITS: "token logits cosine", OUTPUT: "output cosine"}


def _first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "keys"):
        out = [out[k] for k in out.keys()]
    if isinstance(out, (tuple, list)):
        for v in out:
            if isinstance(v, torch.Tensor):
                return v
    raise QuantkitError(f"the model returned no tensor ({type(out).__name__}); it must return a tensor, "
                        "or a tuple or dict holding one")


def _mask(batch):
    return batch.get("attention_mask") if isinstance(batch, dict) else None


def output_kind(out, batch) -> str:
    """How outputs are compared: ``"embedding"`` (an encoder's ``last_hidden_state``, mean-pooled
    over the real tokens: sentence embeddings), ``"logits"`` (one row per sample, e.g. a
    classifier's ``[batch, labels]``), ``"token-logits"`` (``[batch, tokens, vocab]`` logits of
    an LM or token classifier, compared per real token) or ``"output"`` (the first output
    tensor, flattened per sample)."""
    mask = _mask(batch)
    keys = list(out.keys()) if hasattr(out, "keys") else []
    if "logits" in keys and isinstance(out["logits"], torch.Tensor):
        t = out["logits"]
        if t.dim() == 3 and mask is not None and tuple(mask.shape) == tuple(t.shape[:2]):
            return TOKEN_LOGITS
        return LOGITS
    if "last_hidden_state" in keys and mask is not None:
        return EMBEDDING
    return OUTPUT


def _rows(kind: str, out, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [R, D] float64, owner [R])``: the vectors compared by cosine and the sample
    (within the batch) each belongs to."""
    if kind == EMBEDDING:
        rows = _hf.embed(out, batch["attention_mask"])
    elif kind == TOKEN_LOGITS:
        real = batch["attention_mask"].bool()
        t = out["logits"]
        rows = t[real]
        owner = torch.arange(t.shape[0], device=t.device).unsqueeze(1).expand(real.shape)[real]
        return rows.double(), owner
    else:
        t = out["logits"] if kind == LOGITS else _first_tensor(out)
        rows = t.reshape(t.shape[0], -1)
    return rows.double(), torch.arange(rows.shape[0], device=rows.device)


class _Score:
    """Running per-sample cosines, top-1 agreement and SQNR of one candidate against the reference."""

    def __init__(self) -> None:
        self.cos: list[torch.Tensor] = []
        self.top1 = [0, 0]
        self.signal = self.noise = 0.0

    def add(self, ref: torch.Tensor, approx: torch.Tensor, owner: torch.Tensor, n: int, top1: bool) -> None:
        tok = torch.nn.functional.cosine_similarity(ref, approx, dim=-1)
        per_sample = torch.zeros(n, dtype=tok.dtype, device=tok.device).index_add_(0, owner, tok)
        counts = torch.zeros(n, dtype=tok.dtype, device=tok.device).index_add_(0, owner, torch.ones_like(tok))
        self.cos.append((per_sample / counts.clamp(min=1)).cpu())
        if top1:
            self.top1[0] += int((ref.argmax(-1) == approx.argmax(-1)).sum())
            self.top1[1] += int(ref.shape[0])
        self.signal += float(ref.pow(2).sum())
        self.noise += float((ref - approx).pow(2).sum())

    def result(self, kind: str) -> dict:
        cos = torch.cat(self.cos)
        out = {"name": METRIC_NAMES[kind], "samples": int(cos.numel()), "mean_cosine": float(cos.mean()),
               "min_cosine": float(cos.min()),
               "sqnr_db": math.inf if self.noise == 0 else 10 * math.log10(max(self.signal, 1e-300) / self.noise)}
        if self.top1[1]:
            out["top1_agreement"] = self.top1[0] / self.top1[1]
        return out


def _check_finite(rows: torch.Tensor, owner: torch.Tensor, origins: list[str], who: str) -> None:
    bad = ~torch.isfinite(rows).all(dim=-1)
    if bool(bad.any()):
        i = int(owner[bad.nonzero()[0, 0]])
        raise QuantkitError(
            f"{who} produced NaN or inf for sample {origins[i]}; "
            + ("check the model and its weights (quantkit measures against finite outputs only)" if who == "the float model"
               else "keep the offending layers float with --skip, or try --scheme w8a8-dynamic"))


def compare_models(reference, candidates: dict, batches: list, *, origins: list[list[str]], progress: bool,
                   desc: str = "evaluating") -> tuple[str, dict]:
    """Run the reference and each candidate on every batch; returns ``(kind, {name: metric})``.

    Each metric has the per-sample cosine (``mean_cosine``, ``min_cosine``: for encoders the
    sentence embeddings', for token logits the mean over a sample's real tokens), the SQNR of
    the compared outputs and, for logits, the fraction of rows whose argmax agrees.

    Raises:
        QuantkitError: a model produced NaN or inf (naming the sample, from ``origins``).
    """
    from tqdm.auto import tqdm

    scores = {name: _Score() for name in candidates}
    kind = None
    with torch.no_grad():
        for b, where in tqdm(list(zip(batches, origins)), desc=desc, unit="batch", disable=not progress, leave=False):
            ref_out = call_model(reference, b)
            kind = kind or output_kind(ref_out, b)
            ref, owner = _rows(kind, ref_out, b)
            real = owner < len(where)  # rows past the batch's samples fill it up to a static shape
            ref, owner = ref[real], owner[real]
            _check_finite(ref, owner, where, "the float model")
            for name, model in candidates.items():
                approx = _rows(kind, call_model(model, b), b)[0][real]
                if approx.shape != ref.shape:
                    raise QuantkitError(f"the {name} model's output has shape {tuple(approx.shape)} where the float "
                                        f"model's has {tuple(ref.shape)}; they must be the same model")
                _check_finite(approx, owner, where, f"the {name} model")
                scores[name].add(ref, approx, owner, len(where), top1=kind in (LOGITS, TOKEN_LOGITS))
    return kind, {name: sc.result(kind) for name, sc in scores.items()}


def time_interleaved(models: dict, batches: list, *, min_calls: int = 12, max_s: float = 30.0) -> dict:
    """Median wall time per batch of each model, measured interleaved.

    After one untimed warm-up call each (compilation, allocator), the models take turns batch
    by batch, the first of each turn rotating, so drifts of the machine (frequency, other load)
    fall on all of them alike. Rounds over the batches repeat until every model has ``min_calls``
    timed calls, or stop after the round that passes ``max_s`` seconds. Every model after the
    first gets a ``speedup`` over the first: the median of the per-batch time ratios.
    """
    names = list(models)
    times = {n: [] for n in names}
    rows = {n: [] for n in names}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    with torch.no_grad():
        for n in names:
            call_model(models[n], batches[0])
        turn, start = 0, time.perf_counter()
        while len(times[names[0]]) < min_calls and (turn == 0 or time.perf_counter() - start < max_s):
            for b in batches:
                order = names[turn % len(names):] + names[:turn % len(names)]
                turn += 1
                for n in order:
                    sync()
                    t0 = time.perf_counter()
                    call_model(models[n], b)
                    sync()
                    times[n].append(time.perf_counter() - t0)
                    rows[n].append(_batch_size(b))
    out = {n: {"median_ms_per_batch": round(1e3 * statistics.median(times[n]), 3),
               "samples_per_s": round(statistics.median(r / t for r, t in zip(rows[n], times[n])), 1),
               "batches": len(times[n])} for n in names}
    # the median of per-batch ratios: each pair ran back to back on one batch, and a median
    # is not moved by the odd call another process slowed down
    base = names[0]
    for n in names[1:]:
        out[n]["speedup"] = round(statistics.median(a / b for a, b in zip(times[base], times[n]) if b > 0), 3)
    return out


def json_safe(value):
    """``value`` with every non-finite float replaced by None, so that it is standard JSON
    (an infinite SQNR — identical outputs — is written as null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


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
        raise QuantkitError(f"the batch has no input(s) {missing} that the int8 graph takes; "
                            "give every sample the inputs the model was quantized with")
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
        weight = f"{w['dtype']} {w['qscheme'].replace('_', '-')}" if w else "float"
        if w and w.get("float_input"):  # a fallback layer: its input unrounded, its weight int8
            weight += ", float input"
        rows.append({
            "layer": name,
            "op": _LAYER_OPS[node.target],
            "weight": weight,
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
