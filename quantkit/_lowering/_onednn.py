"""CPU target: prepare q/dq graphs for oneDNN int8 through Inductor's freezing path.

With ``freezing=True`` Inductor's own quantization patterns (torch/_inductor/fx_passes/
quantization.py, the ones torchao's x86 flow relies on) rewrite ``dq -> linear <- dq(w)`` into
``onednn.qlinear_pointwise`` with the weight prepack folded to a constant and relu/gelu/requant
fused. The prepack must be inserted *during* freezing to be folded: emitted by an FX pre-pass
it makes Dynamo split the graph and the packed weight arrives as a runtime input, which
Inductor's qlinear lowering rejects. So on CPU the pre-pass only does what those patterns do
not: oneDNN's fast x86 kernels want uint8 activations, so int8 activations (symmetric static,
dynamic) are re-expressed as uint8 with the zero point moved by 128 -- the same values, exactly.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node


__all__ = ["int8_activations_to_uint8", "exact_on_this_cpu"]

aten = torch.ops.aten
_Q = torch.ops.quantized_decomposed
_QUANT = (_Q.quantize_per_tensor.default, _Q.quantize_per_tensor.tensor)
_DEQUANT = (_Q.dequantize_per_tensor.default, _Q.dequantize_per_tensor.tensor)


def exact_on_this_cpu() -> bool:
    """Whether oneDNN's int8 GEMM accumulates exactly on this CPU (VNNI or AMX).

    Without VNNI, x86 int8 kernels multiply with ``vpmaddubsw``, which adds two u8*s8 products
    into a saturating int16: ``255*127 + 255*127`` does not fit, so full-range uint8
    activations times full-range int8 weights (what quantkit produces) come out wrong -- on
    an AVX2-only CPU the MLP test model drops from 37 dB to 23 dB SQNR. oneDNN documents this
    as the "int8 saturation" nuance and expects 7-bit data there.
    """
    caps = torch.cpu.get_capabilities()
    return any(caps.get(k, False) for k in ("avx512_vnni", "avx_vnni", "amx_int8"))


def int8_activations_to_uint8(gm: GraphModule) -> int:
    """Turn each int8 ``quantize_per_tensor`` (full range) and its dequantizes into uint8, zero point + 128.

    ``clamp(round(x/s) + z, -128, 127) + 128 == clamp(round(x/s) + z + 128, 0, 255)``, and the
    dequantize subtracts the moved zero point, so every dequantized value is unchanged.
    Returns the number of quantize nodes rewritten.
    """
    count = 0
    for q in list(gm.graph.nodes):
        if q.op != "call_function" or q.target not in _QUANT:
            continue
        src, scale, zp, qmin, qmax, dtype = q.args[:6]
        if dtype != torch.int8 or (qmin, qmax) != (-128, 127):
            continue
        dqs = list(q.users)
        if not dqs or any(d.target not in _DEQUANT or d.args[1:6] != q.args[1:6] or d.args[0] is not q for d in dqs):
            continue
        if isinstance(zp, Node):
            with gm.graph.inserting_after(zp):
                new_zp = gm.graph.call_function(aten.add.Scalar, (zp, 128))
        else:
            new_zp = int(zp) + 128
        q.args = (src, scale, new_zp, 0, 255, torch.uint8)
        for d in dqs:
            d.args = (q, scale, new_zp, 0, 255, torch.uint8) + tuple(d.args[6:])
        count += 1
    return count
