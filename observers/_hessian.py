"""Hessian observer: the input second moment ``XᵀX`` of a linear layer, for GPTQ."""

from __future__ import annotations

import torch

from quantkit._errors import CalibrationError

from ._base import QuantkitObserver
from ._registry import register

__all__ = ["HessianObserver"]


@register("hessian")
class HessianObserver(QuantkitObserver):
    """Accumulates ``Σ x xᵀ`` over the rows ``x`` (last dimension = input features) of a
    linear layer's input, and the number of rows, in float64.

    GPTQ's layer Hessian is ``H = 2 XᵀX / n`` (Frantar et al. 2022, eq. 2); its constant
    factor cancels in the algorithm, so :attr:`hessian` returns the mean ``XᵀX / n``.
    Padding tokens are left out when calibration masks them (as every observer).

    Merging adds the sums and the row counts, which is exact up to float64 summation order:
    the merge of two observers equals one observer that saw both streams.

    It gives no qparams: it measures what a rounding algorithm needs, not a range.

    Across processes (:func:`quantkit.observers.sync`) the sums and row counts are summed:
    every rank gets the same ``XᵀX``, equal to merging the ranks' observers in rank order.

    Args:
        product_dtype: dtype of each batch's one ``xᵀx`` matmul, added to the float64 sum.
            float64 (default) makes the sum exact to float64 rounding (the reference tests);
            GPTQ's passes use float32: about 2x faster on AVX-512 CPUs, relative error of an
            entry ~1e-6, far below what changes a rounding decision (llm-compressor keeps the
            whole Hessian in float32).
    """

    sync_ops = {"xtx": "sum", "rows": "sum"}

    def __init__(self, dtype=torch.quint8, qscheme=torch.per_tensor_affine, *,
                 product_dtype: torch.dtype = torch.float64, **kwargs) -> None:
        kwargs.pop("ch_axis", None)
        super().__init__(dtype=dtype, qscheme=qscheme, **kwargs)
        if product_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"product_dtype must be torch.float32 or torch.float64, got {product_dtype!r}")
        self.product_dtype = product_dtype
        self.register_buffer("xtx", torch.zeros(0, 0, dtype=torch.float64))
        self.register_buffer("rows", torch.zeros((), dtype=torch.int64))

    @property
    def calibrated(self) -> bool:
        return bool(self.rows > 0)

    def _observe(self, x: torch.Tensor) -> None:
        from ._tokens import real_tokens

        x = real_tokens(x)  # no-op unless a padding mask is active
        flat = x.reshape(-1, x.shape[-1]).to(self.product_dtype)
        if flat.shape[0] == 0:
            return
        if not bool(torch.isfinite(flat).all()):
            raise CalibrationError(
                f"observer at node '{self.node_name}' saw NaN or inf values; "
                "check the calibration data (and the float model's outputs) for NaN/inf"
            )
        if self.xtx.numel() == 0:
            self.xtx = torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float64, device=flat.device)
        elif self.xtx.shape[0] != flat.shape[1]:
            raise CalibrationError(
                f"observer at node '{self.node_name}' saw {flat.shape[1]} features after {self.xtx.shape[0]}; "
                "a Hessian observer watches one linear layer's input"
            )
        if flat.dtype == torch.float64:
            self.xtx.addmm_(flat.T, flat)
        else:  # one float32 matmul per batch, summed in float64 (no float32 drift across batches)
            self.xtx.add_(flat.T @ flat)
        self.rows += flat.shape[0]

    @property
    def hessian(self) -> torch.Tensor:
        """``XᵀX / n`` (float64, ``[in_features, in_features]``)."""
        self._check_calibrated()
        return self.xtx / int(self.rows)

    def _min_max(self):
        raise TypeError("a HessianObserver gives no qparams; read .hessian")

    def _merge(self, other: "HessianObserver") -> None:
        if not self.calibrated:
            self.xtx = other.xtx.clone()
            self.rows = other.rows.clone()
            return
        if other.xtx.shape != self.xtx.shape:
            raise ValueError(f"cannot merge Hessians of shapes {tuple(other.xtx.shape)} and {tuple(self.xtx.shape)}")
        self.xtx.add_(other.xtx.to(self.xtx.device))
        self.rows += other.rows.to(self.rows.device)
