"""Triton int8 kernels (filled in by the lowering work)."""

__all__: list[str] = []
