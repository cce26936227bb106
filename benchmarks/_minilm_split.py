"""The all-MiniLM-L6-v2 splits of the bundled sentences that several benchmarks share, written once.

``heldout_split()``: calibrate on the first 128 sentences (batches of 32), score the last 100
(one batch), both padded to 64 tokens; the float reference is the held-out embeddings of
``quantkit._hf.SentenceEmbedder``. Used by ``bench_minilm_recipes.py`` and ``bench_minilm_fp8.py``
(the protocol of tests/test_minilm.py, whose held-out batches are 50).

``interleaved_split(batch_size)``: the 400 sentences split interleaved (the file is grouped by topic):
the even ones calibrate, every fourth from the second tunes, every fourth from the fourth is held
out; every batch is padded to the longest sentence rounded up to a multiple of 8. Used by
``bench_accuracy.py``, ``bench_weight_only_accuracy.py`` and ``bench_gptq_blocks.py``, with
``SentenceEmbedder`` below (the encoder as ``.model``, ``token_type_ids`` before the mask).

Import it from a script run as ``python benchmarks/<script>.py`` (benchmarks/ is then on sys.path).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
from torch import nn

from quantkit import _hf

__all__ = ["HeldoutSplit", "InterleavedSplit", "SentenceEmbedder", "heldout_split", "interleaved_split"]


class HeldoutSplit(NamedTuple):
    embedder: nn.Module  # _hf.SentenceEmbedder around the bundled model, in eval mode
    calib: list[dict]  # the first 128 sentences, 4 batches of 32 x 64 tokens
    held: dict  # the last 100 sentences, one batch of 100 x 64 tokens
    ref: torch.Tensor  # the float embeddings of ``held`` [100, 384]
    tokenizer: object
    sentences: list[str]  # all the bundled sentences; the held-out ones are sentences[-100:]


def heldout_split() -> HeldoutSplit:
    """The bundled model and the first-128 / last-100 split (see the module docstring)."""
    model, tok = _hf.load_hf_model(_hf.default_model_path())
    embedder = _hf.SentenceEmbedder(model).eval()
    sents = _hf.read_sentences(_hf.default_calibration_file())
    calib = _hf.tokenize(tok, sents[:128], seq_len=64, batch_size=32)
    held = _hf.tokenize(tok, sents[-100:], seq_len=64, batch_size=100)[0]
    with torch.no_grad():
        ref = embedder(**held)
    return HeldoutSplit(embedder, calib, held, ref, tok, sents)


class SentenceEmbedder(nn.Module):
    """An HF encoder returning mean-pooled, normalised sentence embeddings (the interleaved split's
    wrapper: the encoder is ``self.model``, and ``forward`` takes ``token_type_ids`` before the mask)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, token_type_ids, attention_mask):
        out = self.model(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
        return _hf.embed(out, attention_mask)


class InterleavedSplit(NamedTuple):
    model: nn.Module  # the bundled encoder (wrap it in SentenceEmbedder)
    sentences: list[str]  # all the bundled sentences, in file order
    seq_len: int  # the longest sentence's token count, rounded up to a multiple of 8
    batches: Callable[[list[str]], list[dict]]  # sentences -> batches of batch_size x seq_len tokens

    @property
    def calibration(self) -> list[str]:
        """The even sentences (200 of 400)."""
        return self.sentences[0::2]

    @property
    def tuning(self) -> list[str]:
        """Every fourth sentence from the second (100 of 400)."""
        return self.sentences[1::4]

    @property
    def heldout(self) -> list[str]:
        """Every fourth sentence from the fourth (100 of 400)."""
        return self.sentences[3::4]


def interleaved_split(batch_size: int) -> InterleavedSplit:
    """The bundled model, its sentences and their padded length (see the module docstring)."""
    model, tokenizer = _hf.load_hf_model(_hf.default_model_path())
    sentences = _hf.read_sentences(_hf.default_calibration_file())
    longest = max(len(ids) for ids in tokenizer(sentences)["input_ids"])
    seq_len = -(-longest // 8) * 8
    batches = functools.partial(_hf.tokenize, tokenizer, seq_len=seq_len, batch_size=batch_size)
    return InterleavedSplit(model, sentences, seq_len, batches)
