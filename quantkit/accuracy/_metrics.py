"""Accuracy metrics comparing a float model's outputs with a quantized model's.

The contract: ``metric(float_output, quantized_output) -> float``, higher is better,
averaged over the batches of the evaluation data. The drop of a quantized model is
``metric(float, float) - metric(float, quantized)`` (see :func:`evaluate`).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable

import torch

from ..pipeline._calibrate import run_batches

__all__ = [
    "embedding_cosine",
    "logits_kl",
    "top1_agreement",
    "METRICS",
    "resolve_metric",
    "Evaluator",
]

Metric = Callable[[Any, Any], float]

# output fields tried, in order, when a model returns a dict / HF ModelOutput
_PRIMARY_KEYS = ("logits", "sentence_embedding", "last_hidden_state")


def primary_tensor(output: Any) -> torch.Tensor:
    """The tensor a metric looks at: the output itself, ``logits`` / ``last_hidden_state``
    of a dict-like output, or the first tensor of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) or hasattr(output, "keys"):
        for key in _PRIMARY_KEYS:
            if key in output.keys() and isinstance(output[key], torch.Tensor):
                return output[key]
        values = [output[k] for k in output.keys()]
    elif isinstance(output, (tuple, list)):
        values = list(output)
    else:
        values = []
    for v in values:
        try:
            return primary_tensor(v)
        except TypeError:
            continue
    raise TypeError(f"model output {type(output).__name__} holds no tensor to compare; return a tensor (or a dict of them)")


def _pair(float_output, quantized_output) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = primary_tensor(float_output), primary_tensor(quantized_output)
    if a.shape != b.shape:
        raise ValueError(f"float and quantized outputs differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    return a.detach().double(), b.detach().double()


def embedding_cosine(float_output, quantized_output) -> float:
    """Mean cosine similarity between float and quantized vectors along the last dimension.

    For ``(batch, dim)`` sentence embeddings this is the mean per-sentence cosine; for
    ``(batch, tokens, dim)`` hidden states it is the mean per-token cosine. 1.0 means equal.
    """
    a, b = _pair(float_output, quantized_output)
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())


def logits_kl(float_output, quantized_output) -> float:
    """Minus the mean KL divergence KL(softmax(float) ‖ softmax(quantized)) over the last dimension.

    Negated so that higher is better, like every metric; 0.0 means equal distributions.
    """
    a, b = _pair(float_output, quantized_output)
    p_log = torch.log_softmax(a.reshape(-1, a.shape[-1]), dim=-1)
    q_log = torch.log_softmax(b.reshape(-1, b.shape[-1]), dim=-1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    return -float(kl.mean())


def top1_agreement(float_output, quantized_output) -> float:
    """Fraction of rows (samples or tokens) whose argmax over the last dimension agrees."""
    a, b = _pair(float_output, quantized_output)
    return float((a.argmax(-1) == b.argmax(-1)).double().mean())


METRICS: dict[str, Metric] = {
    "cosine": embedding_cosine,
    "kl": logits_kl,
    "top1": top1_agreement,
}
_ALIASES = {"embedding-cosine": "cosine", "logits-kl": "kl", "top1-agreement": "top1", "top-1": "top1"}


def resolve_metric(spec: str | Metric) -> Metric:
    """A metric from a callable, a built-in name or ``"module:function"``.

    Built-in names: ``"cosine"`` (embedding cosine), ``"kl"`` (minus logits KL),
    ``"top1"`` (top-1 agreement).

    Raises:
        ValueError: an unknown name, or a ``module:function`` that cannot be imported.
        TypeError: ``spec`` is neither a string nor a callable.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"metric must be a callable or a string, got {type(spec).__name__}")
    name = spec.strip().lower().replace("_", "-")
    name = _ALIASES.get(name, name)
    if name in METRICS:
        return METRICS[name]
    if ":" not in spec:
        raise ValueError(
            f"unknown metric {spec!r}; use one of {sorted(METRICS)} or 'module:function' for your own"
        )
    module_name, _, func_name = spec.strip().partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"metric {spec!r}: cannot import module {module_name!r} ({exc})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"metric {spec!r}: module {module_name!r} has no function {func_name!r}")
    return func


def reiterable(data: Iterable, what: str) -> Iterable:
    """``data`` itself when it can be iterated repeatedly (list, DataLoader), else a list of it."""
    if isinstance(data, Iterator):
        return list(data)
    if not isinstance(data, Iterable) or isinstance(data, (torch.Tensor, Mapping)):
        raise TypeError(
            f"{what} data must be an iterable of batches (e.g. a list of tensors, tuples or dicts), "
            f"got {type(data).__name__}; wrap a single batch in a list"
        )
    return data


class _Record(torch.nn.Module):
    """Calls ``model`` and hands each output to ``fn`` (used with ``run_batches``)."""

    def __init__(self, model: torch.nn.Module, fn: Callable[[Any], None]) -> None:
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.fn(out)
        return out


class Evaluator:
    """Scores models against a float model's outputs on fixed evaluation batches.

    The float outputs are computed once; :meth:`score` then runs only the candidate.

    Args:
        float_model: the float reference.
        eval_data: evaluation batches (iterated once per score).
        metric: a metric callable, a built-in name or ``"module:function"``.
    """

    def __init__(self, float_model: torch.nn.Module, eval_data: Iterable, metric: str | Metric) -> None:
        self.metric = resolve_metric(metric)
        self.data = reiterable(eval_data, "evaluation")
        self.reference_outputs: list = []
        n = run_batches(_Record(float_model, self.reference_outputs.append), self.data, progress=False,
                        max_batches=None, desc="evaluating", what="evaluation")
        if n == 0:
            raise ValueError("evaluation data is empty; pass at least one batch")
        self.reference = self._mean([self._call(o, o) for o in self.reference_outputs])

    def _call(self, float_out, quant_out) -> float:
        value = self.metric(float_out, quant_out)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"metric must return one number, got a tensor of shape {tuple(value.shape)}")
            value = value.item()
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"metric must return a float, got {type(value).__name__}") from None
        if not math.isfinite(value):
            raise ValueError(f"metric returned {value}; it must be a finite number")
        return value

    @staticmethod
    def _mean(values: list[float]) -> float:
        return math.fsum(values) / len(values)

    def score(self, model: torch.nn.Module) -> float:
        """Mean of ``metric(float_output, model_output)`` over the evaluation batches."""
        scores: list[float] = []
        it = iter(self.reference_outputs)

        def record(out):
            scores.append(self._call(next(it), out))

        run_batches(_Record(model, record), self.data, progress=False, max_batches=None,
                    desc="evaluating", what="evaluation")
        if len(scores) != len(self.reference_outputs):
            raise ValueError("evaluation data gave a different number of batches on a second pass; pass a list")
        return self._mean(scores)
