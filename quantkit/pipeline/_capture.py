"""capture: torch.export a float model into an FX GraphModule with a dynamic batch dimension."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.export import Dim

from .._errors import CaptureError
from .._text import summarise
from ._inputs import as_args_kwargs
from ._kv_capture import capture_with_cache

__all__ = ["capture"]

# where capture() keeps what save() needs to re-export the converted graph
CAPTURE_META_KEY = "quantkit_capture"


def _batch_dynamic(value: Any):
    """``{0: Dim.AUTO}`` for every tensor with a batch dimension, ``None`` elsewhere."""
    if isinstance(value, torch.Tensor):
        return {0: Dim.AUTO} if value.dim() > 0 else None
    if isinstance(value, (tuple, list)):
        return type(value)(_batch_dynamic(v) for v in value)
    if isinstance(value, dict):
        return {k: _batch_dynamic(v) for k, v in value.items()}
    return None


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _double_batch(value: Any):
    if isinstance(value, torch.Tensor):
        return torch.cat([value, value]) if value.dim() > 0 else value
    if isinstance(value, (tuple, list)):
        return type(value)(_double_batch(v) for v in value)
    if isinstance(value, dict):
        return {k: _double_batch(v) for k, v in value.items()}
    return value


def _hint(exc: BaseException) -> str:
    text = str(exc)
    if "data-dependent" in text or "Could not guard on data-dependent" in text:
        return ("the model branches on tensor values; replace that Python control flow "
                "with torch.cond/torch.where, or capture a wrapper that avoids it")
    if "Constraints violated" in text or "specialized" in text:
        return "a dimension you marked dynamic is fixed by the model; pass dynamic_shapes explicitly"
    if isinstance(exc, (TypeError, ValueError)) and "argument" in text:
        return "check that example_inputs match the model's forward() signature"
    return "make the model torch.export-able (see torch.export's docs), or pass dynamic_shapes explicitly"


def _export(model, args, kwargs, dynamic_shapes):
    return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)


@contextlib.contextmanager
def _without_kv_cache(model: torch.nn.Module, kwargs: dict):
    """Trace HF models with ``config.use_cache`` off (restored afterwards): a KV cache
    (``DynamicCache``) in the output is not an exportable type, and a quantization graph
    computes one forward pass, not generation. An explicit ``use_cache`` input is kept."""
    config = getattr(model, "config", None)
    if "use_cache" in kwargs or getattr(config, "use_cache", None) is not True:
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def capture(model: torch.nn.Module, example_inputs: Any, *, dynamic_shapes=None, max_cache_len: int | None = None,
            kv_cache: str | None = None, kv_scales=None) -> torch.fx.GraphModule:
    """Export ``model`` (in eval mode) with torch.export, non-strict.

    Args:
        model: the float model. It is switched to eval mode.
        example_inputs: a tensor, a tuple of positional arguments, or a dict of keyword
            arguments (an HF tokenizer's output works as it is).
        dynamic_shapes: passed to torch.export. By default dim 0 of every tensor input is
            dynamic (``Dim.AUTO``), so calibration and inference batches may have any size.

    HF models with ``config.use_cache`` (causal LMs) are traced without their KV cache
    (the config is restored afterwards), unless ``use_cache`` is one of the inputs.

    With ``max_cache_len=N`` (opt-in, for generation) an HF causal LM is captured with a static
    KV cache instead (``quantkit.pipeline._kv_capture``): the program is
    ``gm(input_ids, cache_position) -> logits``, the sequence length is dynamic (1..N) so one
    program serves prefill and decode, the batch is the example's, the cache is buffers of
    ``gm`` updated in place, and ``gm.meta["quantkit_kv_cache"]`` describes it.

    Args (with ``max_cache_len`` only):
        max_cache_len: positions the cache holds (prompt + generated tokens).
        kv_cache: ``None`` (a cache in the model's dtype), ``"int8"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"``.
        kv_scales: the ``KVScales`` a quantized cache stores with
            (``quantkit.pipeline._kv_cache.calibrate_kv_scales``).

    Returns:
        The exported ``torch.fx.GraphModule``, ready for :func:`quantkit.prepare`.

    Raises:
        CaptureError: if torch.export fails; the message summarises why, with a hint. With
            ``max_cache_len``, also for a model without a causal LM head, a ``max_cache_len``
            outside ``1..config.max_position_embeddings`` or an example longer than it.

    Example:
        >>> gm = quantkit.capture(model, (torch.randn(8, 16),))
        >>> lm = quantkit.capture(llm, tokenizer("Hello", return_tensors="pt"), max_cache_len=256)
        >>> logits = lm(input_ids, torch.arange(input_ids.shape[1]))   # prefill, then one token at a time
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"capture expects a torch.nn.Module, got {type(model).__name__}")
    if max_cache_len is not None:
        if dynamic_shapes is not None:
            raise CaptureError("dynamic_shapes cannot be combined with max_cache_len: the sequence length is "
                               "dynamic (1..max_cache_len) and the batch is fixed to the example's")
        gm, record = capture_with_cache(model, example_inputs, max_cache_len=max_cache_len,
                                        kv_cache=kv_cache, kv_scales=kv_scales)
        gm.meta[CAPTURE_META_KEY] = record
        return gm
    if kv_cache is not None or kv_scales is not None:
        raise CaptureError("kv_cache and kv_scales need max_cache_len=N (a program with a static KV cache)")
    model.eval()
    args, kwargs = as_args_kwargs(example_inputs)
    user_shapes = dynamic_shapes is not None
    if not user_shapes:
        # as_args_kwargs gives either positional or keyword inputs, never both
        dynamic_shapes = _batch_dynamic(kwargs) if kwargs else _batch_dynamic(args)
    try:
        with _without_kv_cache(model, kwargs):
            ep = None
            tensors = list(_tensors((args, kwargs)))
            if not user_shapes and tensors and all(t.dim() > 0 and t.shape[0] == 1 for t in tensors):
                # Dim.AUTO specialises a size-1 batch to 1; trace with the batch doubled so it stays dynamic
                try:
                    ep = _export(model, _double_batch(args), _double_batch(kwargs), dynamic_shapes)
                except Exception:
                    ep = None
            if ep is None:
                ep = _export(model, args, kwargs, dynamic_shapes)
    except Exception as exc:  # torch.export raises many types; summarise them all
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {summarise(exc)}. Hint: {_hint(exc)}"
        ) from exc
    gm = ep.module()
    gm.meta[CAPTURE_META_KEY] = {"args": args, "kwargs": kwargs, "dynamic_shapes": dynamic_shapes}
    return gm
