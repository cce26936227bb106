"""Metrics: comparisons for :func:`quantkit.sensitivity`, and perplexity for causal LMs.

A comparison metric is ``metric(float_output, quantized_output) -> float``, higher is better.
The APIs also take these by name (``"cosine"``, ``"kl"``, ``"top1"``) or as
``"module:function"`` for your own.

:func:`perplexity` scores one model (an HF causal LM or a quantkit program) on held-out text.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Sequence

import torch

from ._errors import QuantkitError
from .accuracy._metrics import METRICS, embedding_cosine, logits_kl, resolve_metric, top1_agreement
from .pipeline import kv_cache_info

__all__ = ["embedding_cosine", "logits_kl", "top1_agreement", "METRICS", "resolve_metric", "perplexity",
           "resolve_window", "DEFAULT_WINDOW"]


def _token_stream(token_ids) -> torch.Tensor:
    ids = torch.as_tensor(token_ids) if not isinstance(token_ids, torch.Tensor) else token_ids
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise QuantkitError(f"perplexity needs one stream of token ids ([N] or [1, N] integers), got "
                            f"{ids.dtype} of shape {list(ids.shape)}; concatenate the documents first")
    if ids.numel() < 2:
        raise QuantkitError(f"perplexity needs at least 2 tokens, got {ids.numel()}")
    return ids.to(torch.long)


def _device(model) -> torch.device:
    for t in (*model.parameters(), *model.buffers()) if isinstance(model, torch.nn.Module) else ():
        return t.device
    return torch.device("cpu")


def _fixed_length(program) -> int | None:
    """The sequence length a captured full-sequence program is fixed to (its first integer input's
    dim 1, when that is a number rather than a symbol), or None."""
    graph = getattr(program, "graph", None)
    for node in getattr(graph, "nodes", ()):
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not val.dtype.is_floating_point and val.dim() == 2:
            return val.shape[1] if isinstance(val.shape[1], int) else None
    return None


def _logits(out, what: str) -> torch.Tensor:
    """The logits of a call: a tensor, a ModelOutput / object with ``logits``, a dict, or a tuple's first."""
    if isinstance(out, dict) and "logits" in out:
        out = out["logits"]
    elif not isinstance(out, torch.Tensor) and isinstance(getattr(out, "logits", None), torch.Tensor):
        out = out.logits
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise QuantkitError(f"perplexity needs next-token logits [batch, length, vocab] from {what}, got {shape}; "
                            "pass a causal LM (AutoModelForCausalLM) or a program captured from one")
    return out


def _keyword_inputs(program) -> list[str]:
    """The keyword inputs an exported program was captured with (its input tree spec), else []."""
    spec = getattr(program, "_in_spec", None)
    try:
        kwargs = spec.children_specs[1]
        return list(kwargs.context) if kwargs.type is dict else []
    except (AttributeError, IndexError, TypeError):
        return []


def _runner(model):
    """``run(ids [B, L]) -> logits [B, L, V]`` for an HF causal LM, a full-sequence program or a KV
    program (called with ``cache_position = arange(L)``: each window is a fresh sequence)."""
    info = kv_cache_info(model)
    if info is not None:
        return lambda ids: model(ids, torch.arange(ids.shape[1], device=ids.device)), info
    names = _keyword_inputs(model)
    if names:  # a program captured from keyword inputs (quantkit quantize's: input_ids, attention_mask)
        if "input_ids" not in names or not set(names) <= {"input_ids", "attention_mask"}:
            raise QuantkitError(f"this program takes the inputs {names}; perplexity feeds input_ids (and an "
                                "all-ones attention_mask) only: capture the causal LM from its input_ids")
        mask = "attention_mask" in names
        return lambda ids: model(input_ids=ids, **({"attention_mask": torch.ones_like(ids)} if mask else {})), None
    if getattr(model, "config", None) is not None:  # an HF model: no KV cache for a scored window
        params = inspect.signature(model.forward).parameters
        if "use_cache" in params:
            return lambda ids: model(input_ids=ids, use_cache=False), None
        return lambda ids: model(input_ids=ids), None
    return lambda ids: model(ids), None


DEFAULT_WINDOW = 256


def resolve_window(model_or_program: Any) -> int:
    """The window :func:`perplexity` uses with ``window=None``: the sequence length a full-sequence
    program was captured with, else 256 tokens, at most a KV program's ``max_cache_len``."""
    info = kv_cache_info(model_or_program)
    if info is not None:
        return min(DEFAULT_WINDOW, int(info["max_cache_len"]))
    return _fixed_length(model_or_program) or DEFAULT_WINDOW


def perplexity(model_or_program: Any, token_ids: torch.Tensor | Sequence[int], *, window: int | None = DEFAULT_WINDOW,
               stride: int | None = None, batch_size: int = 1) -> float:
    """Perplexity of a causal LM on a token stream: exp of the mean next-token negative log-likelihood.

    Hugging Face's strided method (transformers docs, "Perplexity of fixed-length models"): windows
    of ``window`` tokens start every ``stride`` tokens; each scores only the tokens the previous
    window did not (the last ``end - previous_end``), with the rest as context, so every token after
    the first is scored once (with ``stride == window``, windows are disjoint and each window's first
    token has no context and is not scored). Log-probabilities are taken in float64.

    Args:
        model_or_program: an HF causal LM (its output's ``logits``), a program from
            :func:`quantkit.capture`/``convert``/``load`` returning logits ``[B, L, vocab]`` (or a
            ModelOutput), or a program captured with ``max_cache_len`` (called with
            ``cache_position = arange(L)`` per window; ``window`` must fit its cache, and the
            batch is its cache's).
        token_ids: ``[N]`` or ``[1, N]`` token ids, ``N >= 2`` (the text concatenated).
        window: tokens per forward (context + scored), ``>= 2``. ``None``: the length a full-sequence
            program was captured with, else 256 (at most a KV program's ``max_cache_len``).
        stride: tokens between window starts, ``1..window``; ``None`` means ``window`` (disjoint).
            A smaller stride gives each scored token more context, at ``window / stride`` times the work.
        batch_size: windows per forward (a KV program uses its own cache's batch).

    Returns:
        The perplexity (a float; ``inf`` only if a model gives a target probability 0).

    Raises:
        QuantkitError: bad arguments, a window longer than a KV program's cache, or a model whose
            output is not next-token logits.

    Example:
        >>> ids = tokenizer(text, return_tensors="pt").input_ids
        >>> quantkit.metrics.perplexity(model, ids, window=256)
    """
    run, info = _runner(model_or_program)
    fixed = _fixed_length(model_or_program)
    window = resolve_window(model_or_program) if window is None else window
    for name, v in (("window", window), ("batch_size", batch_size)) + ((("stride", stride),) if stride is not None else ()):
        if isinstance(v, bool) or not isinstance(v, int):
            raise QuantkitError(f"perplexity's {name} must be an int, got {type(v).__name__}")
    stride = window if stride is None else stride
    if window < 2:
        raise QuantkitError(f"perplexity's window must be at least 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise QuantkitError(f"perplexity's stride must be 1..window ({window}), got {stride}")
    if batch_size < 1:
        raise QuantkitError(f"perplexity's batch_size must be at least 1, got {batch_size}")
    ids = _token_stream(token_ids)
    if info is not None:
        if window > info["max_cache_len"]:
            raise QuantkitError(f"window={window} does not fit the program's KV cache of max_cache_len="
                                f"{info['max_cache_len']}; pass window <= {info['max_cache_len']}")
        batch_size = int(info["batch_size"])
    ids = ids.to(_device(model_or_program))
    if fixed is not None and fixed != window:
        raise QuantkitError(f"this program takes exactly {fixed} tokens per sequence (the length it was captured "
                            f"with); pass window={fixed}, or capture with max_cache_len for any length")
    # every forward has this length: a short last window is padded (to the fixed length, if any)
    length = window if fixed is not None else min(window, ids.numel())

    # (begin, end, scored): window ids[begin:end] scores its last `scored` tokens
    spans, prev_end = [], 0
    for begin in range(0, ids.numel(), stride):
        end = min(begin + window, ids.numel())
        spans.append((begin, end, end - prev_end))
        prev_end = end
        if end == ids.numel():
            break
    nll, count = 0.0, 0
    what = type(model_or_program).__name__
    with torch.no_grad():
        for i in range(0, len(spans), batch_size):
            group = spans[i:i + batch_size]
            # right padding (the last token repeated) changes no logit before it in a causal LM
            rows = [torch.cat([ids[b:e], ids[e - 1:e].expand(length - (e - b))]) for b, e, _ in group]
            rows += [rows[0]] * (batch_size - len(rows) if info is not None else 0)  # a KV program's fixed batch
            logits = _logits(run(torch.stack(rows)), what)
            if logits.shape[:2] != (len(rows), length):
                raise QuantkitError(f"perplexity needs logits for every position from {what}: a window "
                                    f"[{len(rows)}, {length}] gave {list(logits.shape)}")
            for row, (b, e, scored) in enumerate(group):
                # logits at t predict token t + 1; a window's first token is never a target
                first = max(e - b - scored, 1)
                logp = torch.log_softmax(logits[row, first - 1:e - b - 1].double(), dim=-1)
                target = ids[b + first:e]
                nll -= logp.gather(-1, target[:, None]).sum().item()
                count += target.numel()
    return math.exp(nll / count) if nll / count < 709 else math.inf
