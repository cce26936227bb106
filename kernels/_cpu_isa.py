"""What this CPU's int8 and bf16 kernels may use: the CPU's flags, capped by ``ONEDNN_MAX_CPU_ISA``.

oneDNN honours ``ONEDNN_MAX_CPU_ISA`` (or the older ``DNNL_MAX_CPU_ISA``): with ``AVX2`` on a
VNNI machine its int8 GEMMs use the AVX2 kernels, whose ``vpmaddubsw`` saturates int16 sums with
8-bit activations, and a fused binary-add qlinear has no primitive at all (measured here:
"could not create a primitive descriptor for the matmul primitive"). ``torch.cpu.get_capabilities``
reads the CPU flags only, so deciding from it alone picked 8-bit oneDNN int8 under that cap.
"""

from __future__ import annotations

import os

import torch

__all__ = ["cpu_has"]

# oneDNN ISA names (case-insensitive; aliases included) whose kernels use each feature
_VNNI = {"AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_FP16",
         "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX",
         "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL", "DEFAULT"}
_BF16 = _VNNI - {"AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE_VNNI"}
_AMX = {"AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16",
        "AVX10_2_512_AMX_2", "ALL", "DEFAULT"}
_ALLOWED = {"avx512_vnni": _VNNI, "avx_vnni": _VNNI, "amx_int8": _AMX, "avx512_bf16": _BF16, "amx_bf16": _AMX}


def cpu_has(feature: str) -> bool:
    """Whether ``feature`` (a ``torch.cpu.get_capabilities`` key, e.g. ``"avx512_vnni"``) is on
    this CPU and not excluded by ``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA``."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if not caps.get(feature, False):
        return False
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return not cap or feature not in _ALLOWED or cap in _ALLOWED[feature]
