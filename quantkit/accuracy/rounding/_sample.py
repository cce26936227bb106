"""A uniform, seeded sample of activation rows across every calibration batch, for AWQ's searches.

Bottom-k sampling (a reservoir of the ``keep`` rows with the smallest random keys): every row
gets a key uniform in [0, 1) and the rows with the ``keep`` smallest keys form the sample, a
uniform sample without replacement of all the rows seen, whatever the batch sizes and order.
Memory stays at ``keep`` rows (each batch's candidates are cut to its own bottom ``keep``
first).

A batch's keys come from a generator seeded by ``seed`` and an exact integer fingerprint of the
batch's values (its float32 bits), not by the batch's position: the sample is a function of the
multiset of batches. That is what makes it shard-invariant: under a process group each rank
keeps its own bottom ``keep``, and the bottom ``keep`` of their union
(:meth:`RowSample.merge`) is ``torch.equal`` to one process's on all the batches. (A batch passed
twice gets the same keys twice: its rows are in or out together.)
"""

from __future__ import annotations

import torch

__all__ = ["RowSample", "batch_keys", "value_key"]

_MOD = 65521  # largest prime below 2**16: position weights 1..65521 keep every product below 2**36


def _fingerprint(x: torch.Tensor) -> int:
    """An integer hash of ``x``'s float32 bits and positions, exact (integer sums: independent of
    the summation order, hence of thread counts and machines)."""
    bits = x.detach().float().contiguous().view(torch.int32).reshape(-1).long()
    weight = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) % _MOD + 1
    low = int(((bits & 0xFFFFF) * weight).sum())   # < 2**36 per element
    high = int(((bits >> 20) * weight).sum())      # |.| < 2**27 per element
    return (low * 1_000_003 + high) % (1 << 62)


def batch_keys(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Keys uniform in [0, 1) (float64), one per row of ``x`` (``[T, C]``), from ``seed`` and ``x``'s values."""
    gen = torch.Generator().manual_seed((int(seed) * 0x9E3779B1 + _fingerprint(x)) % (1 << 63))
    return torch.rand(x.shape[0], generator=gen, dtype=torch.float64)


def value_key(tensors: list[torch.Tensor], seed: int) -> float:
    """One key uniform in [0, 1) for a whole batch (its input tensors), from ``seed`` and their values."""
    fp = 0
    for t in tensors:
        fp = (fp * 1_000_003 + _fingerprint(t)) % (1 << 62)
    gen = torch.Generator().manual_seed((int(seed) * 0x9E3779B1 + fp) % (1 << 63))
    return float(torch.rand(1, generator=gen, dtype=torch.float64))


class RowSample:
    """The ``keep`` rows with the smallest keys among every row :meth:`add`-ed (sorted by key)."""

    def __init__(self, keep: int, seed: int = 0) -> None:
        self.keep, self.seed = int(keep), int(seed)
        self.keys = torch.zeros(0, dtype=torch.float64)
        self.rows: torch.Tensor | None = None  # [m, C] float32, m <= keep

    def add(self, x: torch.Tensor) -> None:
        """Offer the rows of ``x`` (``[T, C]``)."""
        if x.shape[0] == 0:
            return
        keys = batch_keys(x, self.seed)
        if x.shape[0] > self.keep:
            keys, idx = torch.topk(keys, self.keep, largest=False)
            x = x[idx]
        self.merge(keys, x.float().cpu())

    def merge(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Take in rows with their keys (another sample's: a rank's, in :mod:`._sync`)."""
        if rows.shape[0] == 0:
            return
        if self.rows is not None:
            keys, rows = torch.cat([self.keys, keys]), torch.cat([self.rows, rows])
        order = torch.argsort(keys, stable=True)[:self.keep]
        self.keys, self.rows = keys[order], rows[order]

    def __len__(self) -> int:
        return 0 if self.rows is None else self.rows.shape[0]
