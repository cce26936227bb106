"""ONEDNN_MAX_CPU_ISA caps what quantkit.compile's "auto" assumes about the CPU."""

from __future__ import annotations

import pytest
import torch

from quantkit.lowering import _bf16, _onednn

_SAPPHIRE_RAPIDS = {"avx2": True, "avx512": True, "avx512_vnni": True, "avx512_bf16": True,
                    "amx_int8": True, "amx_bf16": True, "avx_vnni": True}


@pytest.fixture
def amx_cpu(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: dict(_SAPPHIRE_RAPIDS))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    return monkeypatch


@pytest.mark.parametrize("var, isa, vnni, bf16", [
    (None, None, True, True),
    ("ONEDNN_MAX_CPU_ISA", "AVX2", False, False),          # oneDNN runs its AVX2 kernels: 7-bit data only
    ("ONEDNN_MAX_CPU_ISA", "avx512_core", False, False),   # AVX-512 without VNNI
    ("DNNL_MAX_CPU_ISA", "AVX512_CORE_VNNI", True, False),  # the older name; VNNI but no BF16
    ("ONEDNN_MAX_CPU_ISA", "avx2_vnni", True, False),
    ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", True, True),
    ("ONEDNN_MAX_CPU_ISA", "ALL", True, True),
])
def test_onednn_isa_cap_is_honoured(amx_cpu, var, isa, vnni, bf16):
    if var:
        amx_cpu.setenv(var, isa)
    assert _onednn.exact_on_this_cpu() is vnni
    assert _bf16.bf16_supported() is bf16


def test_the_cap_never_adds_what_the_cpu_lacks(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    assert not _onednn.exact_on_this_cpu()
    assert not _bf16.bf16_supported()
