"""Choosing the next token from a step's logits: greedy, or sampling with temperature, top-k and top-p.

Sampling runs outside the captured program, in eager float32 (the logits of a bf16 or quantized
program are cast first): it is a few vector ops on ``[batch, vocab]`` per token, and keeping it out
of the graph lets one compiled program serve greedy and sampled generation alike. The processors
run in transformers' order (temperature, then top-k, then top-p), so ``top_k=1`` is greedy and a
seeded ``torch.Generator`` makes a run reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._errors import QuantkitError

__all__ = ["SamplingConfig", "GenerationError", "next_tokens", "top_k_filter", "top_p_filter"]


class GenerationError(QuantkitError):
    """generate() was called with arguments it cannot run (bad sampling settings, inputs, program)."""


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen.

    Args:
        do_sample: False: the most likely token (greedy; the other fields are ignored). True:
            a draw from the filtered, tempered distribution.
        temperature: logits are divided by it before the softmax (> 0; 1.0 leaves them as they are).
        top_k: keep only the ``top_k`` most likely tokens (None: all).
        top_p: keep the smallest set of most likely tokens whose probabilities sum to at least
            ``top_p`` (nucleus sampling; None or 1.0: all).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise GenerationError(f"do_sample must be True or False, got {self.do_sample!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature > 0 or self.temperature == float("inf"):
            raise GenerationError(f"temperature must be a finite number > 0, got {self.temperature!r}; "
                                  "use do_sample=False for greedy decoding")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise GenerationError(f"top_k must be an int >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
                                       or not 0 < self.top_p <= 1):
            raise GenerationError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits`` with everything below each row's ``k``-th largest value set to -inf (ties kept)."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``logits`` with each row cut to its nucleus: the most likely tokens, in order, up to and
    including the first one at which their probabilities sum to ``p`` or more (at least one token)."""
    if p >= 1.0:
        return logits
    ordered, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
    drop_sorted = before >= p  # the first token is never dropped: its "before" is 0 < p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_tokens(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row of ``logits`` ``[batch, vocab]``: a LongTensor ``[batch]``."""
    scores = logits.float()
    if not config.do_sample:
        return scores.argmax(dim=-1)
    scores = scores / config.temperature
    if config.top_k is not None:
        scores = top_k_filter(scores, config.top_k)
    if config.top_p is not None:
        scores = top_p_filter(scores, config.top_p)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
