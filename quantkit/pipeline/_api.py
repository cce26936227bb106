"""quantize: capture → prepare → calibrate → convert in one call."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.fx import GraphModule

from ._calibrate import calibrate
from ._capture import capture
from ._convert import convert_in_place
from ._prepare import prepare, prepare_in_place

__all__ = ["quantize"]


def quantize(model: torch.nn.Module, example_inputs: Any, calib_data: Iterable, quantizer=None, *,
             dynamic_shapes=None, progress: bool = True, max_batches: int | None = None) -> GraphModule:
    """Quantize ``model`` end to end and return the converted q/dq GraphModule.

    Ownership: ``model`` is never modified; the result is a new module. Only one float copy
    of the weights exists throughout (the caller's): the captured graph shares them, and the
    private prepared model is converted in place, its float weights replaced by int8 ones.

    Args:
        model: the float model.
        example_inputs: one batch (tensor, tuple or dict) used to capture the model.
        calib_data: an iterable of calibration batches.
        quantizer: defaults to ``W8A8Quantizer()`` (static int8).
        dynamic_shapes, progress, max_batches: see :func:`capture` and :func:`calibrate`.

    Example:
        >>> qmodel = quantkit.quantize(model, (x[:8],), [(b,) for b in x.split(32)])
    """
    if quantizer is None:
        from quantkit.quantizers import W8A8Quantizer

        quantizer = W8A8Quantizer()
    if isinstance(model, GraphModule):
        prepared = prepare(model, quantizer)  # the caller's graph: prepare a copy
    else:  # a graph of our own: prepare it in place
        prepared = prepare_in_place(capture(model, example_inputs, dynamic_shapes=dynamic_shapes), quantizer)
    calibrate(prepared, calib_data, progress=progress, max_batches=max_batches)
    return convert_in_place(prepared)
