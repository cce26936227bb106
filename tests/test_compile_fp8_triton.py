"""FP8 lowering with kernel="triton": FP8 linears become quantkit::fp8_linear (op counts) with the
reference q/dq graph's numerics (SQNR), eagerly for every scale layout, through quantkit.compile,
and on CUDA (skipped without an sm_89+ GPU)."""

import copy
from collections import Counter

import pytest
import torch

import quantkit
from quantkit._qmath import sqnr
from quantkit.lowering._fp8 import lower_fp8
from tests.test_compile_fp8 import _LAYOUTS as ALL_LAYOUTS
from tests.test_compile_fp8 import _converted, block  # noqa: F401  (the block fixture)

# activation scales x weight scales: three of test_compile_fp8's layouts
_LAYOUTS = {k: v for k, v in ALL_LAYOUTS.items()
            if k in ("static-tensor x channel", "token x tensor", "dynamic-tensor x channel")}
_CUDA_FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("kwargs", list(_LAYOUTS.values()), ids=list(_LAYOUTS))
def test_fp8_linears_become_triton_fp8_linear(block, kwargs):
    _, x, _ = block
    conv = _converted(block, kwargs)
    lowered = copy.deepcopy(conv)
    assert lower_fp8(lowered, kernel="triton") == {"fp8_linear": 4}
    ops = Counter(n.target for n in lowered.graph.nodes if n.op == "call_function")
    assert ops[torch.ops.quantkit.fp8_linear.default] == 4
    assert ops[torch.ops.aten.linear.default] == 0 and ops[torch.ops.aten._scaled_mm.default] == 0
    with torch.no_grad():
        for inp in (x, torch.randn(3, 16, 32)):
            db = sqnr(conv(inp), lowered(inp))
            assert db >= 40, f"fp8_linear vs reference q/dq: {db:.1f} dB"


def test_compile_fp8_kernel_choice(block):
    conv = _converted(block, _LAYOUTS["token x tensor"])
    # on CPU the choice is ignored (the Triton op runs only on CUDA under Inductor): _scaled_mm
    compiled = quantkit.compile(conv, fp8_kernel="triton")
    ops = Counter(n.target for n in compiled._orig_mod.graph.nodes if n.op == "call_function")
    assert ops[torch.ops.aten._scaled_mm.default] == 4 and ops[torch.ops.quantkit.fp8_linear.default] == 0
    with pytest.raises(ValueError, match="unknown fp8_kernel 'cutlass'; use one of"):
        quantkit.compile(conv, fp8_kernel="cutlass")


@pytest.mark.skipif(not _CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")
@pytest.mark.parametrize("kwargs", list(_LAYOUTS.values()), ids=list(_LAYOUTS))
def test_cuda_triton_fp8_kernel(block, kwargs):
    _, x, _ = block
    conv = _converted(block, kwargs).to("cuda")
    lowered = copy.deepcopy(conv)
    assert lower_fp8(lowered, "cuda", kernel="triton") == {"fp8_linear": 4}
    with torch.no_grad():
        ref = conv(x.cuda())
        db = sqnr(ref, lowered(x.cuda()))
        db_compiled = sqnr(ref, quantkit.compile(conv, fp8_kernel="triton")(x.cuda()))
    assert db >= 40 and db_compiled >= 40, f"Triton FP8 vs reference q/dq on CUDA: {db:.1f} / {db_compiled:.1f} dB"
