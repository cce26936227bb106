"""quantize: capture → prepare → calibrate → convert in one call."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.fx import GraphModule

from quantkit._errors import CaptureError
from quantkit.quantizers._scheme import CONFIG_META_KEY, SchemeConfig, SchemeError, as_config
from quantkit.quantizers._w8a8 import W8A8Quantizer

from ._calibrate import calibrate
from ._capture import capture
from ._convert import convert_in_place
from ._kv_cache import calibrate_kv_scales
from ._kv_capture import example_batch_size, lm_calibration_batches
from ._prepare import prepare, prepare_in_place

__all__ = ["quantize", "resolve_quantizer"]


def resolve_quantizer(quantizer=None, scheme: "str | SchemeConfig | None" = None, *, what: str = "quantizer"):
    """``(quantizer, config)`` from a quantizer or a scheme (a preset name or a ``SchemeConfig``),
    at most one of them; neither: ``W8A8Quantizer()`` (the ``w8a8`` preset) with no config recorded.

    Raises:
        SchemeError: both given, or an unknown preset name (one line naming the known ones).
    """
    if quantizer is not None and scheme is not None:
        raise SchemeError(f"pass {what}= or scheme=, not both (a scheme builds its own quantizer)")
    if scheme is None:
        return (W8A8Quantizer() if quantizer is None else quantizer), None
    config = as_config(scheme)
    return config.quantizer(), config


def quantize(model: torch.nn.Module, example_inputs: Any, calib_data: Iterable, quantizer=None, *,
             scheme: "str | SchemeConfig | None" = None, dynamic_shapes=None, progress: bool = True,
             max_batches: int | None = None, max_cache_len: int | None = None, kv_cache: str | None = None,
             kv_scales=None, kv_granularity: str = "per-tensor") -> GraphModule:
    """Quantize ``model`` end to end and return the converted q/dq GraphModule.

    Ownership: ``model`` is never modified; the result is a new module. Only one float copy
    of the weights exists throughout (the caller's): the captured graph shares them, and the
    private prepared model is converted in place, its float weights replaced by int8 ones.

    Args:
        model: the float model.
        example_inputs: one batch (tensor, tuple or dict) used to capture the model.
        calib_data: an iterable of calibration batches.
        quantizer: defaults to ``W8A8Quantizer()`` (static int8).
        scheme: instead of ``quantizer``: a registered preset name (``"w4a16"``, ...; see
            ``quantkit.quantizers.available_schemes()``) or a ``SchemeConfig``; the result's
            ``meta["quantkit_config"]`` holds the config, and ``quantkit.save`` records it.
        dynamic_shapes, progress, max_batches: see :func:`capture` and :func:`calibrate`.
        max_cache_len: capture an HF causal LM with a static KV cache of this many positions
            (:func:`capture`), so the result generates (``quantkit.generate``). Calibration then runs
            full sequences at ``cache_position = arange(L)``: ``calib_data`` holds token ids ``[B, L]``
            (tensors, ``(ids,)`` tuples, tokenizer dicts or ``(ids, cache_position)`` pairs), ``B``
            the example's batch (a batch-1 program takes each row on its own, padding dropped) and
            ``L <= max_cache_len``.
        kv_cache: with ``max_cache_len``: store the cache as ``"int8"``, ``"fp8_e4m3"`` or
            ``"fp8_e5m2"``; its scales are ``kv_scales`` or, if None, calibrated on ``calib_data``
            (``calibrate_kv_scales``, ``kv_granularity`` ``"per-tensor"`` or ``"per-head"``).

    Raises:
        SchemeError: both ``quantizer`` and ``scheme``, or an unknown scheme name.
        CaptureError / CalibrationError: with ``max_cache_len``: a model that is not a causal LM,
            or calibration batches that do not fit the cache (one line).

    Example:
        >>> qmodel = quantkit.quantize(model, (x[:8],), [(b,) for b in x.split(32)], scheme="w4a16")
    """
    quantizer, config = resolve_quantizer(quantizer, scheme)
    if max_cache_len is not None:
        if isinstance(model, GraphModule):
            raise CaptureError("max_cache_len captures the model with its KV cache: pass the HF causal LM, "
                               "not a captured graph")
        calib_data = lm_calibration_batches(calib_data, batch_size=example_batch_size(example_inputs),
                                            max_cache_len=max_cache_len)
        if kv_cache is not None and kv_scales is None:
            kv_scales = calibrate_kv_scales(model, [ids for ids, _ in calib_data], kv_cache=kv_cache,
                                            granularity=kv_granularity)
        gm = capture(model, example_inputs, dynamic_shapes=dynamic_shapes, max_cache_len=max_cache_len,
                     kv_cache=kv_cache, kv_scales=kv_scales)
        prepared = prepare_in_place(gm, quantizer)
    elif kv_cache is not None or kv_scales is not None:
        raise CaptureError("kv_cache and kv_scales need max_cache_len=N (a program with a static KV cache)")
    elif isinstance(model, GraphModule):
        prepared = prepare(model, quantizer)  # the caller's graph: prepare a copy
    else:  # a graph of our own: prepare it in place
        prepared = prepare_in_place(capture(model, example_inputs, dynamic_shapes=dynamic_shapes), quantizer)
    calibrate(prepared, calib_data, progress=progress, max_batches=max_batches)
    converted = convert_in_place(prepared)
    if config is not None:
        converted.meta[CONFIG_META_KEY] = config
    return converted
