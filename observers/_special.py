"""Observers whose qparams are fixed or derived from other observers."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ._base import StatelessObserver

__all__ = ["FixedQParamsObserver", "DerivedObserver"]


class FixedQParamsObserver(StatelessObserver):
    """Qparams given up front (e.g. sigmoid outputs in [0, 1]); observes nothing."""

    def __init__(self, scale: float, zero_point: int, dtype=torch.quint8,
                 qscheme=torch.per_tensor_affine, **kwargs) -> None:
        kwargs.pop("is_dynamic", None)
        super().__init__(dtype=dtype, qscheme=qscheme, **kwargs)
        if not scale > 0:
            raise ValueError(f"fixed scale must be positive, got {scale}")
        self.register_buffer("scale", torch.tensor([float(scale)], dtype=torch.float32))
        self.register_buffer("zero_point", torch.tensor([int(zero_point)], dtype=torch.int64))

    def calculate_qparams(self):
        return self.scale, self.zero_point


class DerivedObserver(StatelessObserver):
    """Qparams computed from other observers by ``derive_qparams_fn(observers)``.

    Used for ``DerivedQuantizationSpec``, typically an int32 bias whose scale is
    ``activation_scale * weight_scale``.
    """

    def __init__(self, obs_or_fqs: Sequence[torch.nn.Module],
                 derive_qparams_fn: Callable, dtype=torch.int32,
                 qscheme=torch.per_tensor_affine, ch_axis: int | None = None,
                 **kwargs) -> None:
        kwargs.pop("is_dynamic", None)
        super().__init__(dtype=dtype, qscheme=qscheme, **kwargs)
        # plain list: the source observers are owned by the graph module, not by us
        self._sources = list(obs_or_fqs)
        self.derive_qparams_fn = derive_qparams_fn
        self.ch_axis = ch_axis

    @property
    def calibrated(self) -> bool:
        return all(getattr(o, "calibrated", True) for o in self._sources)

    def calculate_qparams(self):
        scale, zero_point = self.derive_qparams_fn(self._sources)
        return scale, zero_point
