"""Interop with torchao's PT2E flow: {static, dynamic, per-token} x {W8A8Quantizer,
X86InductorQuantizer} x {quantkit prepare/convert, torchao prepare_pt2e/convert_pt2e}.

Where torchao can run a combination, both flows must give the same model (max abs diff
<= 1e-6 on the same inputs after the same calibration, and the same q/dq op counts).
Combinations torchao cannot express are listed with the reason in their test ids.
"""

import collections
import copy
import functools
import warnings

import pytest
import torch
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)

import quantkit
from quantkit._qmath import sqnr
from quantkit.quantizers import QuantConfig, W8A8Quantizer
from tests.models import make_transformer

SCHEMES = {
    "static": {},
    "dynamic": {"dynamic": True},
    "per-token": {"dynamic": True, "granularity": "per-token"},
}


def _w8a8(scheme):
    return W8A8Quantizer(QuantConfig(**SCHEMES[scheme]))


def _x86(scheme):
    assert scheme != "per-token"
    return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_dynamic=scheme == "dynamic"))


QUANTIZERS = {"w8a8": _w8a8, "x86": _x86}

CASES = [
    pytest.param("static", "w8a8", id="static-w8a8"),
    pytest.param("static", "x86", id="static-x86"),
    pytest.param("dynamic", "w8a8", id="dynamic-w8a8"),
    pytest.param("dynamic", "x86", id="dynamic-x86"),
    pytest.param("per-token", "w8a8", id="per-token-w8a8"),
    pytest.param("per-token", "x86", id="per-token-x86-not-applicable",
                 marks=pytest.mark.skip(reason="not applicable: X86InductorQuantizer has no per-token mode")),
]


@functools.lru_cache(maxsize=1)
def _captured():
    model, x = make_transformer(d=32)  # linears and attention matmuls
    x = x[:16]
    return model, quantkit.capture(model, (x[:4],)), x


def _data():
    """The float model, a fresh copy of its captured graph, inputs and calibration batches."""
    model, gm, x = _captured()
    return model, copy.deepcopy(gm), x, [(b,) for b in x.split(8)]


def _quantkit_flow(gm, calib, quantizer):
    prepared = quantkit.prepare(gm, quantizer)
    quantkit.calibrate(prepared, calib, progress=False)
    return quantkit.convert(prepared)


def _torchao_flow(gm, calib, quantizer, *, calibrate=None, convert=convert_pt2e):
    prepared = prepare_pt2e(copy.deepcopy(gm), quantizer)  # prepare_pt2e rewrites its input
    if calibrate is None:
        with torch.no_grad():
            for (b,) in calib:
                prepared(b)
    else:
        calibrate(prepared, calib, progress=False)
    return convert(prepared)


def _qdq_counts(gm):
    return collections.Counter(str(n.target) for n in gm.graph.nodes
                               if n.op == "call_function" and "quantized_decomposed" in str(n.target))


def _max_diff(a, b, x):
    with torch.no_grad():
        return (a(x) - b(x)).abs().max().item()


@pytest.mark.parametrize("scheme,quantizer", CASES)
def test_quantkit_and_torchao_flows_agree(scheme, quantizer):
    model, gm, x, calib = _data()
    ours = _quantkit_flow(gm, calib, QUANTIZERS[quantizer](scheme))
    with torch.no_grad():
        assert sqnr(model(x), ours(x)) >= 30
    if scheme == "per-token":
        # torchao's convert_pt2e has no per-token choose_qparams: a one-line error says so
        with pytest.raises(quantkit.ConvertError) as info:
            _torchao_flow(gm, calib, QUANTIZERS[quantizer](scheme))
        msg = str(info.value)
        assert "\n" not in msg and "per-token" in msg and "convert_pt2e" in msg and "quantkit.convert" in msg
        return
    theirs = _torchao_flow(gm, calib, QUANTIZERS[quantizer](scheme))
    diff = _max_diff(ours, theirs, x)
    assert diff <= 1e-6, f"{scheme}/{quantizer}: max abs diff {diff:.3g} between quantkit and torchao"
    assert _qdq_counts(ours) == _qdq_counts(theirs)
    if scheme == "dynamic":
        chooses = sum(v for k, v in _qdq_counts(ours).items() if "choose_qparams" in k)
        assert chooses > 0


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
@pytest.mark.parametrize("quantizer", ["w8a8", "x86"])
def test_torchao_prepared_graph_through_quantkit_calibrate_and_convert(scheme, quantizer):
    _, gm, x, calib = _data()
    mixed = _torchao_flow(gm, calib, QUANTIZERS[quantizer](scheme), calibrate=quantkit.calibrate, convert=quantkit.convert)
    theirs = _torchao_flow(gm, calib, QUANTIZERS[quantizer](scheme))
    diff = _max_diff(mixed, theirs, x)
    assert diff <= 1e-6, f"{scheme}/{quantizer}: max abs diff {diff:.3g}"
    assert _qdq_counts(mixed) == _qdq_counts(theirs)


def test_quantkit_compile_accepts_a_torchao_converted_graph():
    # symmetric int8 activations: quantkit's oneDNN pre-pass must shift each of them to uint8;
    # the eager backend runs the lowered graph as it is, so it must equal the reference exactly
    _, gm, x, calib = _data()
    quantizer = W8A8Quantizer(QuantConfig(activation="symmetric-int8", ops=frozenset({"linear"})))
    theirs = _torchao_flow(gm, calib, quantizer)
    n_quantize = _qdq_counts(theirs)["quantized_decomposed.quantize_per_tensor.default"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the oneDNN saturation warning on CPUs without VNNI
        fast = quantkit.compile(theirs, cpu_kernels="onednn", backend="eager", float_dtype="fp32")
    assert fast._orig_mod.meta["quantkit_lowering"]["int8_to_uint8"] == n_quantize > 0
    with torch.no_grad():
        assert torch.equal(fast(x), theirs(x))


def test_compile_refuses_a_graph_without_quantization():
    _, gm, _, _ = _data()
    with pytest.raises(TypeError, match="returned by quantkit.convert .or torchao's convert_pt2e"):
        quantkit.compile(gm)


def test_calibrate_refuses_a_graph_without_observers():
    _, gm, _, calib = _data()
    with pytest.raises(TypeError, match="returned by quantkit.prepare .or torchao's prepare_pt2e"):
        quantkit.calibrate(gm, calib, progress=False)


def test_uncalibrated_foreign_observers_follow_their_own_contract():
    """torchao's observers declare no ``requires_calibration``: an uncalibrated one converts to
    the defaults its ``calculate_qparams`` returns (scale 1, zero point 0, with torchao's
    warning), exactly as torchao's convert_pt2e; quantkit's own observers are refused."""
    from torchao.quantization.pt2e.observer import MinMaxObserver as AoMinMaxObserver
    from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec, Quantizer

    from quantkit.observers import MinMaxObserver

    class LinearInputQuantizer(Quantizer):
        def __init__(self, ctr):
            super().__init__()
            self.ctr = ctr

        def annotate(self, model):
            spec = QuantizationSpec(dtype=torch.uint8, quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine,
                                    is_dynamic=False, observer_or_fake_quant_ctr=self.ctr)
            for node in model.graph.nodes:
                if node.target is torch.ops.aten.linear.default:
                    node.meta["quantization_annotation"] = QuantizationAnnotation(
                        input_qspec_map={node.args[0]: spec}, _annotated=True)
            return model

        def validate(self, model):
            pass

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    exported = torch.export.export(model, (x,)).module()
    assert not getattr(AoMinMaxObserver(), "requires_calibration", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchao: "must run observer before calling calculate_qparams"
        ours = quantkit.convert(quantkit.prepare(exported, LinearInputQuantizer(AoMinMaxObserver)))
        theirs = convert_pt2e(prepare_pt2e(copy.deepcopy(exported), LinearInputQuantizer(AoMinMaxObserver)))
    Q = torch.ops.quantized_decomposed

    def qdq_args(gm):
        return [n.args[1:] for n in gm.graph.nodes if n.target in (Q.quantize_per_tensor.default,
                                                                     Q.dequantize_per_tensor.default)]

    assert qdq_args(ours) == qdq_args(theirs) == [(1.0, 0, 0, 255, torch.uint8)] * 2
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=0, rtol=0)
    # quantkit's observer of the same spec declares requires_calibration and is refused
    assert MinMaxObserver().requires_calibration is True
    with pytest.raises(quantkit.ConvertError, match="input_1 -> linear.*has seen no data.*quantkit.calibrate"):
        quantkit.convert(quantkit.prepare(exported, LinearInputQuantizer(MinMaxObserver)))


# --- float8 activations (and weights): torchao's test_quantization_dtype_*_float8_* case, checked here ---

_F8 = [torch.float8_e4m3fn, torch.float8_e5m2]


class _Float8Quantizer:
    """Annotates every conv2d and linear: float8 per-tensor affine activation specs in and out
    (range = the dtype's finite range, as torchao's test), weights int8 or float8 per-tensor
    symmetric (or float8 per-channel, which convert refuses)."""

    def __new__(cls, act_dtype, weight, act_ctr):
        from torchao.quantization.pt2e.observer import MinMaxObserver as AoMinMaxObserver
        from torchao.quantization.pt2e.observer import PerChannelMinMaxObserver as AoPerChannel
        from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec, Quantizer

        fi = torch.finfo(act_dtype)
        act = QuantizationSpec(dtype=act_dtype, quant_min=int(fi.min), quant_max=int(fi.max),
                               qscheme=torch.per_tensor_affine, is_dynamic=False, observer_or_fake_quant_ctr=act_ctr)
        if weight == "int8":
            w = QuantizationSpec(dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric,
                                 is_dynamic=False, observer_or_fake_quant_ctr=AoMinMaxObserver)
        elif weight == "float8":
            w = QuantizationSpec(dtype=act_dtype, quant_min=int(fi.min), quant_max=int(fi.max),
                                 qscheme=torch.per_tensor_symmetric, is_dynamic=False,
                                 observer_or_fake_quant_ctr=AoMinMaxObserver)
        else:
            assert weight == "float8-per-channel"
            w = QuantizationSpec(dtype=act_dtype, quant_min=int(fi.min), quant_max=int(fi.max), ch_axis=0,
                                 qscheme=torch.per_channel_symmetric, is_dynamic=False,
                                 observer_or_fake_quant_ctr=AoPerChannel)

        class Q(Quantizer):
            def annotate(self, model):
                for node in model.graph.nodes:
                    if node.target in (torch.ops.aten.conv2d.default, torch.ops.aten.linear.default):
                        node.meta["quantization_annotation"] = QuantizationAnnotation(
                            input_qspec_map={node.args[0]: act, node.args[1]: w}, output_qspec=act, _annotated=True)
                return model

            def validate(self, model):
                pass

        return Q()


def _float8_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Linear(6, 5)).eval()
    x = torch.randn(2, 3, 8, 8) * 3
    return model, torch.export.export(model, (x,)).module(), x


def _ref_fake_quant_f64(x, scale, zero_point, qmin, qmax, dtype, axis=None):
    """Independent float64 fake quantization with the quantized_decomposed ops' semantics:
    round half to even to an integer, add the zero point, clamp to [qmin, qmax], cast to the
    float8 dtype (round to nearest) and back, subtract the zero point, times the scale."""
    x = x.double()
    # scales are stored as float32 (torchao's observers): round the float64 value once to it
    scale = torch.as_tensor(scale, dtype=torch.float64).float().double()
    zero_point = torch.as_tensor(zero_point, dtype=torch.float64)
    if axis is not None:
        shape = [1] * x.dim()
        shape[axis] = -1
        scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
    v = torch.clamp(torch.round(x / scale) + zero_point, qmin, qmax)
    return (v.to(dtype).double() - zero_point) * scale


@pytest.mark.parametrize("weight", ["int8", "float8"])
@pytest.mark.parametrize("act_dtype", _F8, ids=str)
@pytest.mark.parametrize("observer", ["torchao", "quantkit"])
def test_float8_specs_convert_like_torchao(act_dtype, weight, observer):
    from torchao.quantization.pt2e.observer import MinMaxObserver as AoMinMaxObserver

    from quantkit.observers import MinMaxObserver

    model, exported, x = _float8_model()
    calib = [(x,)]
    ctr = AoMinMaxObserver if observer == "torchao" else MinMaxObserver
    ours = _quantkit_flow(copy.deepcopy(exported), calib, _Float8Quantizer(act_dtype, weight, ctr))
    theirs = _torchao_flow(exported, calib, _Float8Quantizer(act_dtype, weight, AoMinMaxObserver))
    Q = torch.ops.quantized_decomposed
    # conv in/out, linear in/out: 4 quantizes; their dequantizes plus the two folded weights'
    expected = collections.Counter({str(Q.quantize_per_tensor.default): 4, str(Q.dequantize_per_tensor.default): 6})
    assert _qdq_counts(ours) == _qdq_counts(theirs) == expected
    nodes = [n for n in ours.graph.nodes if n.op == "call_function" and "quantized_decomposed" in str(n.target)]
    wdtype = torch.int8 if weight == "int8" else act_dtype
    act_nodes = [n for n in nodes if n.args[0].op != "get_attr"]
    assert len(act_nodes) == 8 and all(n.args[-1] == act_dtype for n in act_nodes)
    assert all(n.args[-1] == wdtype and getattr(ours, n.args[0].target).dtype == wdtype
               for n in nodes if n.args[0].op == "get_attr")
    with torch.no_grad():
        got = ours(x)
        torch.testing.assert_close(got, theirs(x), atol=0, rtol=0)

    # independent float64 reference, op by op (a whole-model comparison cannot have a float
    # tolerance: float8 steps near +-448 are 32 units wide, and an affine zero point puts values
    # there). Activation qparams from each edge's own float64 min/max over the calibration data
    # (float model), weights' from their own range; inputs are the ones the converted model feeds
    # each quantize.
    fi = torch.finfo(act_dtype)
    qmin, qmax = int(fi.min), int(fi.max)

    def act_fq(t, ranged):
        lo, hi = min(ranged.min().item(), 0.0), max(ranged.max().item(), 0.0)
        scale = float(torch.tensor(max((hi - lo) / (qmax - qmin), torch.finfo(torch.float32).eps)).float())
        zp = min(max(qmin - round(lo / scale), qmin), qmax)
        return _ref_fake_quant_f64(t, scale, zp, qmin, qmax, act_dtype)

    def weight_fq(w):
        w = w.detach().double()
        wmin, wmax, wdt = (-128, 127, torch.int8) if weight == "int8" else (qmin, qmax, act_dtype)
        return _ref_fake_quant_f64(w, w.abs().max().item() / ((wmax - wmin) / 2), 0, wmin, wmax, wdt)

    with torch.no_grad():
        h = model[0](x)
        edges = {"input": x, "conv2d": h, "relu": torch.relu(h), "linear": model(x)}
        seen = {}

        class Record(torch.fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                seen[n] = out
                return out

        Record(ours).run(x)
    checked = 0
    for dq in (n for n in nodes if "dequantize" in str(n.target)):
        src = dq.args[0]
        if src.op == "get_attr":  # a folded weight: its dequantize against the weight's reference
            user = next(iter(dq.users))
            ref = weight_fq((model[0] if user.target is torch.ops.aten.conv2d.default else model[2]).weight)
        else:
            edge = "input" if src.args[0].op == "placeholder" else src.args[0].name
            ref = act_fq(seen[src.args[0]], edges[edge])
        torch.testing.assert_close(seen[dq].double(), ref, rtol=1e-6, atol=1e-7, msg=f"{dq.name} vs float64 reference")
        checked += 1
    assert checked == 6


@pytest.mark.parametrize("act_dtype", _F8, ids=str)
def test_float8_per_channel_weights_are_refused_before_any_rewrite(act_dtype):
    """torch's dequantize_per_channel cannot run on float8 (it subtracts int64 zero points, a
    promotion torch refuses): convert says so in one line and leaves the prepared model as it was."""
    from torchao.quantization.pt2e.observer import MinMaxObserver as AoMinMaxObserver

    from quantkit.pipeline._convert import convert_in_place

    _, exported, x = _float8_model()
    prepared = quantkit.prepare(exported, _Float8Quantizer(act_dtype, "float8-per-channel", AoMinMaxObserver))
    quantkit.calibrate(prepared, [(x,)], progress=False)
    before = str(prepared.graph)
    name = str(act_dtype).replace("torch.", "")
    with pytest.raises(quantkit.ConvertError) as info:
        quantkit.convert(prepared)
    msg = str(info.value)
    assert "\n" not in msg and f"per-channel {name} quantization" in msg and "per-tensor" in msg
    with pytest.raises(quantkit.ConvertError):
        convert_in_place(prepared)  # the in-place flavour refuses before rewriting anything
    assert str(prepared.graph) == before
    # torchao's own ops fail on it at run time, as the comment in quantkit.pipeline._convert says
    fi = torch.finfo(act_dtype)
    q = torch.ops.quantized_decomposed.quantize_per_channel.default(
        torch.ones(2, 3), torch.ones(2), torch.zeros(2, dtype=torch.int64), 0, int(fi.min), int(fi.max), act_dtype)
    with pytest.raises(RuntimeError, match="Promotion for Float8"):
        torch.ops.quantized_decomposed.dequantize_per_channel.default(
            q, torch.ones(2), torch.zeros(2, dtype=torch.int64), 0, int(fi.min), int(fi.max), act_dtype)
