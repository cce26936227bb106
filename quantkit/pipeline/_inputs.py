"""Normalising user inputs (example inputs, calibration batches) into (args, kwargs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["as_args_kwargs", "call_model"]


def as_args_kwargs(inputs: Any) -> tuple[tuple, dict]:
    """Split one batch into ``(args, kwargs)``.

    A tensor is one positional argument, a tuple/list is the positional arguments,
    a mapping (dict, HF ``BatchEncoding``) is keyword arguments.
    """
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise TypeError(
        f"a batch must be a tensor, a tuple of model arguments or a dict of keyword arguments, got {type(inputs).__name__}"
    )


def call_model(model: torch.nn.Module, inputs: Any):
    args, kwargs = as_args_kwargs(inputs)
    return model(*args, **kwargs)
