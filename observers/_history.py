"""The per-batch statistics a moving-average observer saw, kept so that distributed
calibration can replay them in one order on every process (see :mod:`._sync`).

A moving average depends on the order of its batches, so it cannot be reduced like a
minimum or a sum. Instead each observer keeps the batch minima and maxima it averaged, as
runs of equal values (a weight, observed once per batch, is one run whatever the number
of batches); :func:`quantkit.observers.sync` concatenates the ranks' runs in rank order and
replays the average over them. Memory: two floats (per channel) per batch of
activations, one run in all for a weight.
"""

from __future__ import annotations

import torch

__all__ = ["BatchHistory"]


class BatchHistory:
    """Runs ``[batch_min, batch_max, count]`` in the order they were observed.

    ``synced`` counts the batches (from the start) that the last sync already combined
    across ranks: a later sync takes only the batches after them from ranks other than 0.
    """

    def __init__(self) -> None:
        self.runs: list[list] = []
        self.synced = 0  # batches at the front already combined by a sync
        self._frozen = 0  # runs at the front that new batches may not extend (synced ones)

    def record(self, mn: torch.Tensor, mx: torch.Tensor) -> None:
        """Append one batch's statistics (kept as they are; the caller must not modify them)."""
        if len(self.runs) > self._frozen:
            last = self.runs[-1]
            if last[0].shape == mn.shape and torch.equal(last[0], mn) and torch.equal(last[1], mx):
                last[2] += 1
                return
        self.runs.append([mn.detach().clone(), mx.detach().clone(), 1])

    @property
    def batches(self) -> int:
        return sum(r[2] for r in self.runs)

    def after(self, skip: int) -> list[list]:
        """The runs of the batches after the first ``skip``."""
        out = []
        for mn, mx, n in self.runs:
            drop = min(n, skip)
            skip -= drop
            take = n - drop
            if take:
                out.append([mn, mx, take])
        return out

    def reset(self, runs: list[list]) -> None:
        """Replace the history with ``runs`` (a sync's combined history), all of it synced."""
        self.runs = [list(r) for r in runs]
        self.synced = self.batches
        self._frozen = len(self.runs)
