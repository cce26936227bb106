"""Padding-aware calibration: observers skip the padding tokens of a batch.

Padded batches (every sentence padded to one length) feed the observers activations of
tokens that carry no data. Most of a batch can be padding (88% for 128-token batches of
short sentences), and their activations skew a histogram's range search towards them.
While :func:`token_mask` is active, an activation observer (``padding_aware``, set by
``quantkit.prepare``) observes only the positions the mask marks as real.

The token dimension of each observed tensor is decided once, by ``quantkit.prepare``, from
the graph's symbolic shapes (:func:`token_dim`): dim 0 is the mask's batch size and the
token dimension its token count, looked for at dim 1 of ``[B, S, ...]`` and at dims 2, 3,
then 1 of a 4-D tensor (attention's ``[B, heads, S, d]`` and ``[B, heads, d, S]``); or dim 0
is ``B * S``, rows flattened before a GEMM (:data:`FLAT`). Prepare records the answer on the
observer (``token_axes``: a ``(layout, axis)`` pair per call site, since one observer may
watch one tensor in several layouts, e.g. before and after a transpose); at run time the
observer takes the axis of the call site whose layout the tensor has and passes it to
:func:`real_tokens`, which only checks that the sizes agree with the mask.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

__all__ = ["FLAT", "token_mask", "token_dim", "real_tokens"]

_MASK: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("quantkit_token_mask", default=None)


@contextlib.contextmanager
def token_mask(mask: torch.Tensor | None):
    """Within the block, observers see only the tokens where ``mask`` (``[batch, tokens]``)
    is true; ``None`` turns masking off."""
    token = _MASK.set(None if mask is None else mask.to(torch.bool))
    try:
        yield
    finally:
        _MASK.reset(token)


FLAT = -1  # token_dim's answer for [batch * tokens, ...] (rows flattened before a GEMM)


def token_dim(shape, batch, tokens) -> int | None:
    """The token dimension of an activation ``shape`` for a ``[batch, tokens]`` mask, by
    the rule in the module docstring; :data:`FLAT` when dim 0 is ``batch * tokens``
    (GPT-2's Conv1D flattens its input to rows); None if there is none."""
    if len(shape) < 2:
        return None
    if shape[0] != batch:
        return FLAT if shape[0] == batch * tokens else None
    order = (2, 3, 1) if len(shape) == 4 else (1,)
    return next((d for d in order if shape[d] == tokens), None)


def _fits(shape, d: int, batch: int, tokens: int) -> bool:
    if d == FLAT:
        return len(shape) >= 1 and shape[0] == batch * tokens
    return len(shape) > d >= 1 and shape[0] == batch and shape[d] == tokens


def real_tokens(x: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """``x`` without the masked-out tokens: ``[n_real, ...]`` with the batch and token
    dimensions merged (the others keep their order), or ``x`` itself when no mask is
    active or ``x`` has no ``[batch, tokens]`` layout.

    Args:
        axis: the token axis recorded at prepare time (:data:`FLAT` for ``[batch * tokens,
            ...]``); its sizes must agree with the mask, else ``x`` is returned as it is.
            None: find it with :func:`token_dim` (for callers without a prepared graph).
    """
    mask = _MASK.get()
    if mask is None:
        return x
    batch, tokens = mask.shape
    d = token_dim(x.shape, batch, tokens) if axis is None else axis
    if d is None or not _fits(x.shape, d, batch, tokens):
        return x
    if mask.device != x.device:
        mask = mask.to(x.device)
    return x[mask.reshape(-1)] if d == FLAT else x.movedim(d, 1)[mask]
