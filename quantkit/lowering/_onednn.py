"""CPU target: prepare q/dq graphs for oneDNN int8 through Inductor's freezing path.

With ``freezing=True`` Inductor's own quantization patterns (torch/_inductor/fx_passes/
quantization.py, the ones torchao's x86 flow relies on) rewrite ``dq -> linear <- dq(w)`` into
``onednn.qlinear_pointwise`` with the weight prepack folded to a constant and relu/gelu/requant
fused. The prepack must be inserted *during* freezing to be folded: emitted by an FX pre-pass
it makes Dynamo split the graph and the packed weight arrives as a runtime input, which
Inductor's qlinear lowering rejects. So on CPU the pre-pass only does what those patterns do
not: oneDNN's fast x86 kernels want uint8 activations, so int8 activations (symmetric static,
dynamic) are re-expressed as uint8 with the zero point moved by 128 -- the same values, exactly;
and a reduced-range quantize (``affine-uint7``: 0..127) gets its clamp made explicit, because
the patterns that fuse a quantize into the preceding qlinear drop its quant_min/quant_max and
oneDNN then clamps to the dtype's full 0..255.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from .._qmath import default_qrange
from quantkit.kernels._cpu_isa import cpu_has


__all__ = ["int8_activations_to_uint8", "clamp_reduced_range_quantizes", "exact_on_this_cpu", "exact_for_graph",
           "why_reference"]

aten = torch.ops.aten
_Q = torch.ops.quantized_decomposed
_QUANT = (_Q.quantize_per_tensor.default, _Q.quantize_per_tensor.tensor)
_DEQUANT = (_Q.dequantize_per_tensor.default, _Q.dequantize_per_tensor.tensor)
# per-token int8 activations (-127..127; lowered by _per_token.py): oneDNN shifts them to uint8
_DEQUANT_PER_TOKEN = _Q.dequantize_per_token.default
# ops whose dequantized activation input Inductor's freezing patterns hand to oneDNN int8
_ONEDNN_CONSUMERS = {
    aten.linear.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
    aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding,
}
# largest uint8 activation for which a vpmaddubsw pair sum fits int16: 2 * 127 * 128 = 32512 <= 32767
_MAX_U8_WITHOUT_VNNI = 127
# largest |int8 weight| for which a pair sum fits int16 with ANY uint8 activation: 2 * 255 * 64 = 32640
# (7-bit weights, ``QuantConfig(weight_bits=7)``: -64..63): 8-bit activations stay exact on AVX2
_MAX_ABS_W8_WITHOUT_VNNI = 64
_WEIGHT_DEQUANT = {_Q.dequantize_per_channel.default: 4, _Q.dequantize_per_tensor.default: 3}  # -> quant_min's index


def exact_on_this_cpu() -> bool:
    """Whether oneDNN's int8 GEMM accumulates exactly on this CPU (VNNI or AMX).

    Without VNNI, x86 int8 kernels multiply with ``vpmaddubsw``, which adds two u8*s8 products
    into a saturating int16: ``255*127 + 255*127`` does not fit, so full-range uint8
    activations times full-range int8 weights (what quantkit produces) come out wrong -- on
    an AVX2-only CPU the MLP test model drops from 37 dB to 23 dB SQNR. oneDNN documents this
    as the "int8 saturation" nuance and expects 7-bit data there.
    """
    return any(cpu_has(k) for k in ("avx512_vnni", "avx_vnni", "amx_int8"))


def _saturating_activation(gm: GraphModule) -> str | None:
    """What kind of activation oneDNN would saturate on in ``gm`` on this CPU (None: none would)."""
    if exact_on_this_cpu():
        return None
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _ONEDNN_CONSUMERS:
            continue
        x = node.args[0]
        if not isinstance(x, Node) or x.op != "call_function" or _narrow_weight(node):
            continue
        if x.target is _DEQUANT_PER_TOKEN:
            return "per-token int8"
        if x.target not in _DEQUANT:
            continue
        _, _, _, qmin, qmax, dtype = x.args[:6]
        if dtype != torch.uint8 or not 0 <= qmin <= qmax <= _MAX_U8_WITHOUT_VNNI:
            return "dynamic 8-bit" if x.target is _Q.dequantize_per_tensor.tensor else "8-bit"
    return None


def _narrow_weight(consumer: Node) -> bool:
    """Whether ``consumer``'s weight is a dequantize of int8 stored within -64..64 (``weight_bits=7``):
    then no uint8 activation can saturate a ``vpmaddubsw`` pair sum (2 * 255 * 64 = 32640)."""
    w = consumer.args[1] if len(consumer.args) > 1 else consumer.kwargs.get("weight")
    if not isinstance(w, Node) or w.op != "call_function" or w.target not in _WEIGHT_DEQUANT:
        return False
    i = _WEIGHT_DEQUANT[w.target]
    if len(w.args) < i + 3 or w.args[i + 2] != torch.int8:
        return False
    qmin, qmax = w.args[i], w.args[i + 1]
    return isinstance(qmin, int) and isinstance(qmax, int) and -_MAX_ABS_W8_WITHOUT_VNNI <= qmin <= qmax <= \
        _MAX_ABS_W8_WITHOUT_VNNI


def exact_for_graph(gm: GraphModule) -> bool:
    """Whether oneDNN int8 gives the reference q/dq results for ``gm`` on this CPU.

    The one place that decides ``cpu_kernels="auto"``. True on VNNI/AMX CPUs (int32
    accumulation), or when every activation that oneDNN would consume -- a per-tensor
    dequantize feeding a linear or conv -- is uint8 within 0..127 (``affine-uint7``): with
    the int8 weights in -128..127, two products then sum to at most 2 * 127 * 128 = 32512 and
    the int16 cannot saturate. The bound is on the stored integers, not on the number of
    levels: a uint8 range 100..227 has 128 levels but still overflows. Int8 activations do not
    qualify: oneDNN (and the pre-pass below) shift them by 128 to uint8 first; that includes
    per-token activations (symmetric int8 in -127..127, ``_per_token.py``), which are therefore
    exact only on VNNI/AMX CPUs -- unless the weight is 7-bit.

    7-bit weights (``QuantConfig(weight_bits=7)``, stored in -64..63) make any uint8 activation
    exact: a pair sums to at most 2 * 255 * 64 = 32640. That keeps 8-bit activations (static,
    dynamic, per-token) and costs one bit of per-channel weight resolution instead, which the
    per-channel weights tolerate far better than per-tensor activations (MiniLM, issue 28).

    A graph mixing 7-bit and 8-bit activations is not exact as a whole; Inductor's freezing
    patterns rewrite every match, with no per-layer opt-out, so such a graph is reported
    not exact and ``auto`` keeps all of it on the reference path.
    """
    return _saturating_activation(gm) is None


def why_reference(gm: GraphModule) -> str | None:
    """One line saying why ``cpu_kernels="auto"`` keeps ``gm``'s int8 layers on the reference q/dq graph
    on this CPU, or None where it lowers them to oneDNN (or there is nothing for oneDNN to run).

    Example:
        >>> why_reference(converted)  # on an AVX2-only CPU, a per-token graph
        'no VNNI/AMX on this CPU: int8 GEMMs of per-token int8 activations and 8-bit weights would saturate; running the reference q/dq graph'
    """
    kind = _saturating_activation(gm)
    if kind is None:
        return None
    return (f"no VNNI/AMX on this CPU: int8 GEMMs of {kind} activations and 8-bit weights would saturate; "
            "running the reference q/dq graph")


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


def clamp_reduced_range_quantizes(gm: GraphModule) -> int:
    """Clamp the float input of each static quantize whose range is narrower than its dtype's.

    ``clamp(round(x/s) + z, lo, hi) == round(clamp(x, (lo - z) s, (hi - z) s) / s) + z``, so
    the values are unchanged; but once Inductor fuses the quantize into the qlinear before it
    (``o_qmin``/``o_qmax`` are matched and ignored there, torch 2.13
    ``fx_passes/quantization.py``), oneDNN clamps to the full dtype range, and an input past the
    calibrated range would give 128..255 -- wrong, and too large for the next int16 pair sum.
    The explicit clamp keeps the range. Dynamic quantizes choose qparams inside the range and
    are not fused. Returns the number of clamps inserted.
    """
    count = 0
    for q in list(gm.graph.nodes):
        if q.op != "call_function" or q.target is not _Q.quantize_per_tensor.default:
            continue
        src, scale, zp, qmin, qmax, dtype = q.args[:6]
        if (qmin, qmax) == default_qrange(dtype):
            continue
        with gm.graph.inserting_before(q):
            lo, hi = (qmin - int(zp)) * float(scale), (qmax - int(zp)) * float(scale)
            clamped = gm.graph.call_function(aten.clamp.default, (src, lo, hi))
        clamped.meta.update({k: v for k, v in src.meta.items() if k == "val"})
        q.args = (clamped,) + tuple(q.args[1:])
        count += 1
    return count
