"""Import torchao without its import-time noise.

torchao logs "Failed to load ..._C_*.so" for kernels built for other CUDA/Python
versions, and registering its enums makes torch's pytree warn. Neither matters to
quantkit (it uses only torchao's PT2E protocol classes), and both would land on the
CLI's stderr, which is reserved for errors. Levels are restored after the import.
"""

from __future__ import annotations

import logging

__all__ = []

_NOISY = ("torchao", "torch.utils._pytree")


def _import_torchao_quietly() -> None:
    loggers = [logging.getLogger(name) for name in _NOISY]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
        import torchao.quantization.pt2e.quantizer  # noqa: F401
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_import_torchao_quietly()
