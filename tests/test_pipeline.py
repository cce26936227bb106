"""prepare → calibrate → convert with W8A8Quantizer: numerics, graph shape, configuration, errors."""

import collections
import warnings

import pytest
import torch

import quantkit
from quantkit._qmath import sqnr
from quantkit.quantizers import QuantConfig, W8A8Quantizer
from tests.models import make_cnn, make_mlp, make_transformer

MODELS = {"mlp": make_mlp, "cnn": make_cnn, "transformer": make_transformer}
Q = torch.ops.quantized_decomposed


def _calib(x):
    return [(b,) for b in x.split(32)]


def _counts(gm):
    c = collections.Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function" and "quantized_decomposed" in str(n.target):
            c[str(n.target).split(".", 1)[1]] += 1
    return c


def _observers(prepared):
    from torchao.quantization.pt2e.observer import ObserverBase

    return {id(m) for m in prepared.modules() if isinstance(m, ObserverBase)}


@pytest.mark.parametrize("name", list(MODELS))
def test_prepared_equals_float(name):
    model, x = MODELS[name]()
    prepared = quantkit.prepare(quantkit.capture(model, (x[:8],)), W8A8Quantizer())
    with torch.no_grad():
        torch.testing.assert_close(prepared(x), model(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,min_db", [("mlp", 35.0), ("cnn", 35.0), ("transformer", 35.0)])
def test_w8a8_sqnr(name, min_db):
    model, x = MODELS[name]()
    qmodel = quantkit.quantize(model, (x[:8],), _calib(x), progress=False)
    with torch.no_grad():
        db = sqnr(model(x), qmodel(x))
    assert db >= min_db, f"{name}: W8A8 SQNR {db:.1f} dB < {min_db} dB"


def test_mlp_graph_counts_and_int8_weights():
    model, x = make_mlp()
    qmodel = quantkit.quantize(model, (x[:8],), _calib(x), progress=False)
    # 3 linears: one q/dq pair per activation input, one per-channel dequantize per folded weight
    assert _counts(qmodel) == {
        "quantize_per_tensor.default": 3, "dequantize_per_tensor.default": 3, "dequantize_per_channel.default": 3,
    }
    assert not any(n.target == Q.quantize_per_channel.default for n in qmodel.graph.nodes)
    state = qmodel.state_dict()
    int8 = [v for v in state.values() if v.dtype == torch.int8]
    assert sorted(t.shape for t in int8) == sorted(
        [model.fc1.weight.shape, model.fc2.weight.shape, model.fc3.weight.shape])
    for k, v in state.items():
        assert not (v.is_floating_point() and v.dim() == 2), f"float weight {k} left in the converted model"
    # the int8 weight is exactly the reference quantization of the float weight
    from quantkit._qmath import choose_qparams, quantize

    w = model.fc1.weight.detach()
    s, z = choose_qparams(w.amin(1), w.amax(1), qscheme=torch.per_channel_symmetric, dtype=torch.int8,
                          quant_min=-128, quant_max=127)
    expected = quantize(w, s, z, -128, 127, torch.int8, axis=0)
    assert any(torch.equal(t, expected) for t in int8)


def test_cnn_graph_counts():
    model, x = make_cnn()
    qmodel = quantkit.quantize(model, (x[:8],), _calib(x), progress=False)
    c = _counts(qmodel)
    # 5 convs + 1 linear have int8 weights; their 6 activation inputs are quantized, plus
    # the flatten before the head (propagated: its only consumer quantizes its output)
    assert c["dequantize_per_channel.default"] == 6
    assert c["quantize_per_tensor.default"] == 7 and c["dequantize_per_tensor.default"] == 7
    assert not any("batch_norm" in str(n.target) for n in qmodel.graph.nodes), "batch norm was not folded"


def test_residual_adds_optional():
    model, x = make_cnn()
    base = _counts(quantkit.quantize(model, (x[:8],), _calib(x), progress=False))
    cfg = QuantConfig(ops=frozenset({"linear", "conv", "matmul", "add"}))
    with_add = quantkit.quantize(model, (x[:8],), _calib(x), W8A8Quantizer(cfg), progress=False)
    assert _counts(with_add)["quantize_per_tensor.default"] > base["quantize_per_tensor.default"]
    with torch.no_grad():
        assert sqnr(model(x), with_add(x)) >= 30


def test_transformer_attention_matmuls_quantized():
    model, x = make_transformer()
    qmodel = quantkit.quantize(model, (x[:4],), _calib(x), progress=False)
    matmuls = [n for n in qmodel.graph.nodes if n.target == torch.ops.aten.matmul.default]
    assert len(matmuls) == 2
    for mm in matmuls:
        for a in mm.args[:2]:
            assert a.target == Q.dequantize_per_tensor.default, f"{mm.name} input {a.name} is not dequantized int8"


def test_other_batch_sizes_for_calibration_and_inference():
    model, x = make_mlp()
    prepared = quantkit.prepare(quantkit.capture(model, (x[:8],)), W8A8Quantizer())
    quantkit.calibrate(prepared, [(x[:5],), (x[5:70],), x[70:71]], progress=False)
    qmodel = quantkit.convert(prepared)
    for n in (1, 7, 200):
        assert qmodel(x[:n]).shape == (n, 32)


def test_shared_tensor_gets_one_observer():
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            h = torch.relu(x)
            return self.a(h) + self.b(h)

    x = torch.randn(16, 8)
    prepared = quantkit.prepare(quantkit.capture(TwoHeads(), (x,)), W8A8Quantizer())
    # relu output shared by both linears: 1 activation observer + 2 weight observers
    assert len(_observers(prepared)) == 3
    quantkit.calibrate(prepared, [(x,)], progress=False)
    qmodel = quantkit.convert(prepared)
    # one quantize, its dequantize duplicated for each consumer
    c = _counts(qmodel)
    assert c["quantize_per_tensor.default"] == 1 and c["dequantize_per_tensor.default"] == 2


def test_module_name_and_type_filters_keep_float():
    model, x = make_mlp()
    q = W8A8Quantizer().set_module_name("fc3", None)
    qmodel = quantkit.quantize(model, (x[:8],), _calib(x), q, progress=False)
    assert _counts(qmodel)["dequantize_per_channel.default"] == 2
    fc3 = [n for n in qmodel.graph.nodes if n.target == torch.ops.aten.linear.default][-1]
    assert fc3.args[0].target == torch.ops.aten.relu.default  # float input, no dequantize

    model, x = make_cnn()
    q = W8A8Quantizer().set_module_type(torch.nn.Conv2d, None)
    qmodel = quantkit.quantize(model, (x[:8],), _calib(x), q, progress=False)
    assert _counts(qmodel)["dequantize_per_channel.default"] == 1  # only the linear head

    q = W8A8Quantizer().set_global(None).set_module_name("block2", QuantConfig())
    qmodel = quantkit.quantize(model, (x[:8],), _calib(x), q, progress=False)
    assert _counts(qmodel)["dequantize_per_channel.default"] == 2  # block2's two convs


def test_symmetric_int8_activations():
    model, x = make_mlp()
    q = W8A8Quantizer(QuantConfig(activation="symmetric-int8"))
    qmodel = quantkit.quantize(model, (x[:8],), _calib(x), q, progress=False)
    qnodes = [n for n in qmodel.graph.nodes if n.target == Q.quantize_per_tensor.default]
    assert qnodes and all(n.args[2] == 0 and n.args[5] == torch.int8 for n in qnodes)
    with torch.no_grad():
        assert sqnr(model(x), qmodel(x)) >= 30


def test_uint7_activations():
    # reduced-range activations (for oneDNN on CPUs without VNNI): every q/dq carries 0..127
    model, x = make_mlp()
    q = W8A8Quantizer(QuantConfig(activation="affine-uint7"))
    qmodel = quantkit.quantize(model, (x[:8],), _calib(x), q, progress=False)
    act = [n for n in qmodel.graph.nodes if n.target in (Q.quantize_per_tensor.default, Q.dequantize_per_tensor.default)]
    assert len(act) == 6  # a quantize and a dequantize in front of each of the 3 linears
    assert {tuple(n.args[3:6]) for n in act} == {(0, 127, torch.uint8)}
    assert all(0 <= n.args[2] <= 127 for n in act)
    with torch.no_grad():
        db = sqnr(model(x), qmodel(x))
    assert db >= 30, f"uint7 activations: SQNR {db:.1f} dB < 30 dB"


def test_dynamic_variant():
    model, x = make_mlp()
    qmodel = quantkit.quantize(model, (x[:8],), [(x[:8],)], W8A8Quantizer(dynamic=True), progress=False)
    c = _counts(qmodel)
    assert c["choose_qparams_symmetric.tensor"] == 3
    assert c["quantize_per_tensor.tensor"] == 3 and c["dequantize_per_channel.default"] == 3
    with torch.no_grad():
        assert sqnr(model(x), qmodel(x)) >= 30


def test_dynamic_needs_no_calibration_data_for_weights():
    model, x = make_mlp()
    prepared = quantkit.prepare(quantkit.capture(model, (x[:8],)), W8A8Quantizer(dynamic=True))
    qmodel = quantkit.convert(prepared)  # nothing to calibrate: weights are observed at convert
    with torch.no_grad():
        assert sqnr(model(x), qmodel(x)) >= 30


def test_quant_config_validation():
    with pytest.raises(ValueError, match="unknown observer 'bogus'"):
        QuantConfig(act_observer="bogus")
    with pytest.raises(ValueError, match="unknown op families"):
        QuantConfig(ops=frozenset({"linear", "softmax"}))
    with pytest.raises(ValueError, match="unknown activation scheme"):
        QuantConfig(activation="int4")
    with pytest.raises(Exception):
        QuantConfig().dynamic = True  # frozen


# --- errors -------------------------------------------------------------------------

def _prepared_mlp():
    model, x = make_mlp()
    return quantkit.prepare(quantkit.capture(model, (x[:8],)), W8A8Quantizer()), x


def test_nan_in_calibration_data_names_the_node():
    prepared, x = _prepared_mlp()
    bad = x[:8].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(quantkit.CalibrationError, match=r"node 'x -> linear'.*NaN or inf"):
        quantkit.calibrate(prepared, [(bad,)], progress=False)


def test_calibrating_with_no_data():
    prepared, _ = _prepared_mlp()
    with pytest.raises(quantkit.CalibrationError, match="calibration data is empty"):
        quantkit.calibrate(prepared, [], progress=False)
    with pytest.raises(TypeError, match="iterable of batches"):
        quantkit.calibrate(prepared, torch.randn(4, 64), progress=False)


def test_convert_before_calibrate():
    prepared, x = _prepared_mlp()
    with pytest.raises(quantkit.ConvertError, match="never calibrated.*quantkit.calibrate"):
        quantkit.convert(prepared)
    # the failed convert left the prepared model usable
    quantkit.calibrate(prepared, [(x,)], progress=False)
    quantkit.convert(prepared)


def test_wrong_shape_batch_gets_clear_error():
    prepared, x = _prepared_mlp()
    with pytest.raises(quantkit.CalibrationError, match="does not match the captured shapes"):
        quantkit.calibrate(prepared, [(torch.randn(4, 10),)], progress=False)


def test_prepare_needs_a_graph_module():
    model, _ = make_mlp()
    with pytest.raises(TypeError, match="quantkit.capture"):
        quantkit.prepare(model, W8A8Quantizer())


def test_calibrate_max_batches():
    prepared, x = _prepared_mlp()
    quantkit.calibrate(prepared, [(x[:8],), (x * 100,)], progress=False, max_batches=1)
    assert prepared.meta["quantkit_calibrated_batches"] == 1


def test_prepare_leaves_the_captured_graph_untouched():
    model, x = make_cnn()
    gm = quantkit.capture(model, (x[:8],))
    before = [(n.name, n.target) for n in gm.graph.nodes]
    a = quantkit.prepare(gm, W8A8Quantizer())
    b = quantkit.prepare(gm, W8A8Quantizer(dynamic=True))
    assert [(n.name, n.target) for n in gm.graph.nodes] == before
    assert not any("quantization_annotation" in n.meta for n in gm.graph.nodes)
    assert a is not gm and b is not gm


def test_dynamic_per_token_variant():
    model, x = make_transformer()
    cfg = QuantConfig(dynamic=True, granularity="per-token")
    qmodel = quantkit.quantize(model, (x[:4],), [(x[:4],)], W8A8Quantizer(cfg), progress=False)
    c = _counts(qmodel)
    # per token where the last dim is the GEMM's K: 4 linear inputs + the 2 attention matmuls'
    # left operands; their right operands (K is not last) stay per-tensor dynamic
    assert c["choose_qparams_per_token.default"] == 6
    assert c["quantize_per_token.default"] == 6 and c["dequantize_per_token.default"] == 6
    assert c["choose_qparams_symmetric.tensor"] == 2
    assert c["dequantize_per_channel.default"] == 4
    per_tensor = quantkit.quantize(model, (x[:4],), [(x[:4],)], W8A8Quantizer(dynamic=True), progress=False)
    with torch.no_grad():
        ref = model(x)
        db_token, db_tensor = sqnr(ref, qmodel(x)), sqnr(ref, per_tensor(x))
    assert db_token >= 35 and db_token > db_tensor, (db_token, db_tensor)


def test_per_token_config_validation():
    with pytest.raises(ValueError, match="per-token activation quantization is dynamic"):
        QuantConfig(granularity="per-token")
    with pytest.raises(ValueError, match="per-token activations are symmetric int8"):
        QuantConfig(dynamic=True, granularity="per-token", activation="affine-uint8")
    with pytest.raises(ValueError, match="unknown granularity"):
        QuantConfig(granularity="per-row")


def test_per_token_never_applies_to_conv_inputs():
    model, x = make_cnn()
    cfg = QuantConfig(dynamic=True, granularity="per-token")
    qmodel = quantkit.quantize(model, (x[:8],), [(x[:8],)], W8A8Quantizer(cfg), progress=False)
    c = _counts(qmodel)
    # 5 convs quantize per tensor (a scale per row of the last dim would vary along the channels
    # they reduce over); only the linear head's input is per token
    assert c["choose_qparams_per_token.default"] == 1
    assert c["choose_qparams_symmetric.tensor"] == 5
    with torch.no_grad():
        assert sqnr(model(x), qmodel(x)) >= 30


# --- ownership: prepare/convert return new modules, never modify their input ------------

def test_convert_twice_leaves_prepared_usable():
    model, x = make_mlp()
    gm = quantkit.capture(model, (x[:8],))
    prepared = quantkit.prepare(gm, W8A8Quantizer())
    quantkit.calibrate(prepared, _calib(x), progress=False)
    n_obs = len(_observers(prepared))
    a, b = quantkit.convert(prepared), quantkit.convert(prepared)
    assert a is not prepared and b is not prepared and a is not b
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
        # prepared still has every observer and still computes the float function
        assert len(_observers(prepared)) == n_obs
        torch.testing.assert_close(prepared(x), model(x), atol=1e-5, rtol=0)
    # calibrating further changes what the next convert gives, and only that one
    quantkit.calibrate(prepared, [(x * 3,)], progress=False)
    c = quantkit.convert(prepared)
    with torch.no_grad():
        assert not torch.equal(a(x), c(x))
        assert torch.equal(a(x), b(x))


def test_prepare_and_convert_share_unmodified_parameters():
    # no weight is copied: the prepared model holds the captured graph's parameter tensors,
    # and the converted one keeps the float biases as those same tensors (int8 weights are new)
    model, x = make_mlp()
    gm = quantkit.capture(model, (x[:8],))
    ptrs = {p.data_ptr() for p in gm.parameters()}
    prepared = quantkit.prepare(gm, W8A8Quantizer())
    assert {p.data_ptr() for p in prepared.parameters()} == ptrs
    quantkit.calibrate(prepared, _calib(x), progress=False)
    qmodel = quantkit.convert(prepared)
    biases = [t for t in list(qmodel.parameters()) + list(qmodel.buffers()) if t.is_floating_point() and t.dim() == 1
              and t.numel() in (128, 32) and t.data_ptr() in ptrs]
    assert len(biases) == 3, "the three float biases should be shared, not copied"
    assert all(t.data_ptr() not in ptrs for t in qmodel.buffers() if t.dtype == torch.int8)


def test_quantize_leaves_the_model_untouched():
    model, x = make_cnn()  # batch norms get folded: on the copy, never on the model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(x)
    quantkit.quantize(model, (x[:8],), _calib(x), progress=False)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(model(x), ref)


# --- behaviour declared by attributes, not class names ------------------------------

class _RowAbsMax(quantkit.observers.QuantkitObserver):
    """A user's per-channel observer that is no subclass of quantkit's per-channel ones and
    whose name says nothing: it declares a per-channel qscheme and a ch_axis."""

    def __init__(self, ch_axis=0, dtype=torch.int8, qscheme=torch.per_channel_symmetric, **kwargs):
        super().__init__(dtype=dtype, qscheme=qscheme, **kwargs)
        self.ch_axis = ch_axis
        self.register_buffer("amax", torch.tensor([]))

    @property
    def calibrated(self):
        return self.amax.numel() > 0

    def _observe(self, x):
        a = x.transpose(0, self.ch_axis).flatten(1).abs().amax(1)
        self.amax = a if not self.calibrated else torch.maximum(a, self.amax)

    def _min_max(self):
        return -self.amax, self.amax

    def _merge(self, other):
        self.amax = torch.maximum(self.amax, other.amax)


class PerChannelLookalikeObserver(quantkit.observers.MinMaxObserver):
    """Per tensor, whatever its name says."""


quantkit.observers.register("test_row_abs_max", _RowAbsMax)
quantkit.observers.register("test_per_channel_lookalike", PerChannelLookalikeObserver)


def test_custom_per_channel_observer_by_any_name_gives_per_channel_weights():
    model, x = make_mlp()
    q = W8A8Quantizer(QuantConfig(weight_observer="test_row_abs_max"))
    qmodel = quantkit.quantize(model, (x[:8],), _calib(x), q, progress=False)
    assert _counts(qmodel)["dequantize_per_channel.default"] == 3
    # independent reference: symmetric int8 per row, scale = absmax / 127.5 (torchao's
    # symmetric rule: (quant_max - quant_min) / 2), zero point 0; x * (1 / scale) as the
    # quantized_decomposed ops define rounding (x / scale differs by one on ties)
    w = model.fc1.weight.detach()
    scale = w.abs().amax(1, keepdim=True) / 127.5
    expected = torch.clamp(torch.round(w * (1.0 / scale)), -128, 127).to(torch.int8)
    int8 = [t for t in qmodel.buffers() if t.dtype == torch.int8 and t.shape == w.shape]
    assert any(torch.equal(t, expected) for t in int8)

    lookalike = W8A8Quantizer(QuantConfig(weight_observer="test_per_channel_lookalike"))
    qmodel = quantkit.quantize(model, (x[:8],), _calib(x), lookalike, progress=False)
    c = _counts(qmodel)
    assert "dequantize_per_channel.default" not in c and c["dequantize_per_tensor.default"] == 6


def test_dynamic_observers_declare_what_they_are():
    from quantkit.observers import PlaceholderObserver

    tok = PlaceholderObserver(per_token=True)
    assert tok.is_dynamic and tok.granularity == "per-token" and isinstance(tok.eps, float)
    assert PlaceholderObserver().granularity == "per-tensor"
    assert quantkit.observers.get("per_channel_minmax")().granularity == "per-channel"
    with pytest.raises(ValueError, match="per tensor or per token"):
        PlaceholderObserver(qscheme=torch.per_channel_symmetric)


class _Masked(torch.nn.Module):
    """Attention over 2 heads: [B, S, H] linear inputs; keys observed as [B, 2, S, 4] and,
    through the shared observer of the transpose, as [B, 2, 4, S]."""

    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, attention_mask):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 2, 4).transpose(1, 2)
        k = self.k(x).view(b, s, 2, 4).transpose(1, 2)
        return torch.matmul(q, k.transpose(2, 3)) * attention_mask[:, None, None, :]


def test_token_axes_recorded_at_prepare():
    torch.manual_seed(0)
    x, mask = torch.randn(4, 6, 8), torch.ones(4, 6, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    x[mask == 0] = 50.0  # padding positions stand out
    prepared = quantkit.prepare(quantkit.capture(_Masked(), {"x": x, "attention_mask": mask}), W8A8Quantizer())
    modules = dict(prepared.named_modules(remove_duplicate=False))
    observer_nodes = [n for n in prepared.graph.nodes
                      if n.op == "call_module" and isinstance(modules[n.target], quantkit.observers.QuantkitObserver)]
    recorded = {n.args[0].name: modules[n.target].token_axes for n in observer_nodes}
    # the input x [B, 6, 8]: tokens at axis 1 (batch symbolic); the keys' shared observer
    # watches four layouts, with the tokens at axis 1, 1, 2 and (after k^T) 3
    assert recorded["x"] == (((None, 6, 8), 1),)
    obs_k = modules[next(n.target for n in observer_nodes if n.args[0].name == "transpose_2")]
    assert set(obs_k.token_axes) == {((None, 6, 8), 1), ((None, 6, 2, 4), 1), ((None, 2, 6, 4), 2),
                                     ((None, 2, 4, 6), 3)}
    assert obs_k._token_axis((3, 2, 4, 6)) == 3 and obs_k._token_axis((3, 2, 6, 4)) == 2
    assert obs_k._token_axis((3, 8, 6)) is None  # a layout no call site has: observed whole
    weights = [m for n, m in recorded.items() if n.endswith("weight")]
    assert weights == [(), ()]
    quantkit.calibrate(prepared, [{"x": x, "attention_mask": mask}], progress=False)
    obs_x = modules[next(n.target for n in observer_nodes if n.args[0].name == "x")]
    real = x[mask.bool()]
    assert float(obs_x.max_val) == float(real.max()) < 50.0


# --- behaviours torchao's PT2E suite checks (benchmarks/run_torchao_pt2e_suite.py) -------

def test_linear_batch_norm_folded_for_2d_outputs_only():
    torch.manual_seed(0)
    for x, fold in ((torch.randn(16, 8), True), (torch.randn(4, 5, 8), False)):
        model = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.BatchNorm1d(5)).eval()
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prepared = quantkit.prepare(quantkit.capture(model, (x,)), W8A8Quantizer())
        bns = [n for n in prepared.graph.nodes if "batch_norm" in str(n.target)]
        assert (len(bns) == 0) == fold
        assert fold or any("Not fusing linear+bn" in str(w.message) for w in caught)
        with torch.no_grad():
            torch.testing.assert_close(prepared(x), model(x), atol=1e-5, rtol=1e-5)


def test_buffer_written_in_place_is_state_not_a_folded_constant():
    class Cache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.zeros(4))
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, idx):
            return self.lin(self.buf.index_put_((idx,), x).clone()[None])

    ex = (torch.tensor([1.0, 2.0]), torch.tensor([1, 3]))
    gm = torch.export.export(Cache(), ex, strict=True).module()
    prepared = quantkit.prepare(gm, W8A8Quantizer())
    quantkit.calibrate(prepared, [ex], progress=False)
    qmodel = quantkit.convert(prepared)
    assert "buf" in dict(qmodel.named_buffers())  # the linear's weight is folded, the buffer is not
    index_put = next(n for n in qmodel.graph.nodes if n.target == torch.ops.aten.index_put_.default)
    assert index_put.args[0].op == "get_attr" and index_put.args[0].target == "buf"
    assert _counts(qmodel)["dequantize_per_channel.default"] == 1


def test_convert_without_observers():
    model, x = make_mlp()
    gm = quantkit.capture(model, (x[:8],))
    with pytest.raises(quantkit.ConvertError, match="no observers; call quantkit.prepare"):
        quantkit.convert(gm)  # never prepared
    prepared = quantkit.prepare(gm, W8A8Quantizer().set_global(None))  # nothing to quantize
    qmodel = quantkit.convert(prepared)
    assert not _counts(qmodel)
    with torch.no_grad():
        assert torch.equal(qmodel(x), model(x))


def test_prepared_and_converted_graphs_refuse_train_eval_like_exported_ones():
    prepared, x = _prepared_mlp()
    quantkit.calibrate(prepared, [(x,)], progress=False)
    for gm in (prepared, quantkit.convert(prepared)):
        for call in (gm.eval, gm.train):
            with pytest.raises(NotImplementedError, match="move_exported_model_to_eval"):
                call()


class _ScanLinear(torch.nn.Module):
    """A linear layer applied to each row by ``scan`` (its body is a subgraph of the export)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x, init):
        from torch._higher_order_ops.scan import scan

        def combine_fn(carry, row):
            out = self.linear(row)
            return carry + out, out

        return scan(combine_fn, init=init, xs=x, dim=0)[1]


class _WhileLinear(torch.nn.Module):
    """``x = tanh(linear(x))`` three times by ``while_loop`` (body and condition are subgraphs)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        from torch._higher_order_ops.while_loop import while_loop

        def body(i, x):
            return i + 1, torch.tanh(self.linear(x))

        return while_loop(lambda i, x: i < 3, body, (torch.tensor(0), x))[1]


def _subgraph(gm, op, index):
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is op)
    return gm.get_submodule(node.args[index].target)


@pytest.mark.parametrize("kind", ["scan", "while_loop"])
def test_control_flow_bodies_are_observed_calibrated_and_converted(kind):
    torch.manual_seed(0)
    if kind == "scan":
        model, inputs = _ScanLinear().eval(), (torch.randn(6, 16), torch.zeros(16))
        op, index = torch.ops.higher_order.scan, 0
        # what the linear layer sees: every row of x
        seen = inputs[0]
    else:
        model, inputs = _WhileLinear().eval(), (torch.randn(4, 16),)
        op, index = torch.ops.higher_order.while_loop, 1
        # what the linear layer sees: x and the first two iterates, computed by an own loop
        with torch.no_grad():
            steps = [inputs[0].double()]
            w, b = model.linear.weight.double(), model.linear.bias.double()
            for _ in range(2):
                steps.append(torch.tanh(steps[-1] @ w.T + b))
        seen = torch.cat(steps)
    prepared = quantkit.prepare(quantkit.capture(model, inputs), W8A8Quantizer())
    body = _subgraph(prepared, op, index)
    # activation and weight observers of the linear inside the body, none in the parent graph
    assert len(_observers(body)) == 2
    assert not any(n.op == "call_module" and "activation_post_process" in str(n.target) for n in prepared.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(prepared(*inputs), model(*inputs), atol=1e-5, rtol=0)
    quantkit.calibrate(prepared, [inputs], progress=False)
    qmodel = quantkit.convert(prepared)
    assert _counts(_subgraph(qmodel, op, index)) == {
        "quantize_per_tensor.default": 1, "dequantize_per_tensor.default": 1,
        "quantize_per_channel.default": 1, "dequantize_per_channel.default": 1,
    }
    # uint8 affine min/max over every iteration (the observer ran inside the loop each time)
    act = next(r for r in qmodel.meta["quantkit_qparams"] if r["qscheme"] == "per_tensor_affine")
    lo, hi = min(float(seen.min()), 0.0), max(float(seen.max()), 0.0)
    assert act["scale"][0] == pytest.approx((hi - lo) / 255, rel=1e-5)
    with torch.no_grad():  # scan/while_loop re-trace their body when autograd is on
        db = sqnr(model(*inputs), qmodel(*inputs))
    assert db >= 35.0, f"{kind}: W8A8 SQNR {db:.1f} dB < 35 dB"


def test_folded_weights_use_torchao_names_and_fold_quantize_false_keeps_them_float():
    prepared, x = _prepared_mlp()
    quantkit.calibrate(prepared, [(x,)], progress=False)
    folded = quantkit.convert(prepared)
    kept = quantkit.convert(prepared, fold_quantize=False)
    n_weights = 3  # fc1..fc3 of make_mlp
    # torchao's constant_fold names: _frozen_param0, 1, 2 (int8, one per linear weight)
    names = sorted(n for n, b in folded.named_buffers() if b.dtype == torch.int8)
    assert names == [f"_frozen_param{i}" for i in range(n_weights)]
    assert {str(n.target) for n in folded.graph.nodes if n.op == "get_attr"} >= set(names)
    assert _counts(folded)["quantize_per_channel.default"] == 0
    # not folded: the float weights stay, quantized by a quantize_per_channel op in the graph
    assert not any(n.startswith("_frozen_param") for n, _ in kept.named_buffers())
    assert _counts(kept)["quantize_per_channel.default"] == n_weights
    assert _counts(kept)["dequantize_per_channel.default"] == _counts(folded)["dequantize_per_channel.default"]
    with torch.no_grad():  # the same integers either way: folding changes where they are computed
        torch.testing.assert_close(kept(x), folded(x), atol=0, rtol=0)
    with pytest.raises(TypeError, match="fold_quantize must be True or False"):
        quantkit.convert(prepared, fold_quantize="yes")


class _AllInputsQuantizer:
    """Annotates every input and output of every call_function (as torchao's kwargs test)."""

    def __init__(self):
        from torchao.quantization.pt2e.quantizer import QuantizationSpec

        from quantkit.observers import MinMaxObserver

        self.spec = QuantizationSpec(dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric,
                                     is_dynamic=False, observer_or_fake_quant_ctr=MinMaxObserver)

    def transform_for_annotation(self, model):
        return model

    def annotate(self, model):
        from torchao.quantization.pt2e.quantizer import QuantizationAnnotation

        for node in model.graph.nodes:
            if node.op == "call_function":
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={n: self.spec for n in node.all_input_nodes}, output_qspec=self.spec)
        return model

    def validate(self, model):
        pass


def test_out_argument_gets_no_observer_and_is_still_written():
    class ClampOut(torch.nn.Module):
        def forward(self, t):
            torch.clamp(t, max=0.5, out=t)
            return t

    torch.manual_seed(0)
    x = torch.randn(2, 8)
    gm = torch.export.export(ClampOut(), (x.clone(),)).module()
    clamp = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.clamp.out)
    assert clamp.kwargs["out"] is clamp.args[0]  # out= the input itself
    prepared = quantkit.prepare(gm, _AllInputsQuantizer())
    clamp = next(n for n in prepared.graph.nodes if n.target is torch.ops.aten.clamp.out)
    assert clamp.kwargs["out"].op == "placeholder"  # the out edge is not observed
    assert clamp.args[0].op == "call_module"  # the read input is
    quantkit.calibrate(prepared, [(x.clone(),)], progress=False)
    qmodel = quantkit.convert(prepared)
    assert _counts(qmodel) == {"quantize_per_tensor.default": 2, "dequantize_per_tensor.default": 2}
    t = x.clone()
    with torch.no_grad():
        y = qmodel(t)
    # the op still writes into the caller's tensor: clamp of the quantized input (one step off)
    step = float(x.abs().max()) / 127
    assert float((t - x.clamp(max=0.5)).abs().max()) <= step / 2 + 1e-6
    assert float((y - x.clamp(max=0.5)).abs().max()) <= step + 1e-6


def test_implicit_sharing_with_a_shared_input_edge_is_one_observer():
    """x -> clone -> eq(clone, x): clone's output shares (x, clone); eq's (x, eq) shares
    (clone, eq); implicit sharing joins the two uses of x. One observer for all four (the
    case that made torchao's resolution recurse forever)."""
    from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, QuantizationSpec, SharedQuantizationSpec

    from quantkit.observers import MinMaxObserver

    class Quantizer(_AllInputsQuantizer):
        def annotate(self, model):
            spec = QuantizationSpec(dtype=torch.uint8, quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine,
                                    is_dynamic=False, observer_or_fake_quant_ctr=MinMaxObserver)
            for node in model.graph.nodes:
                if node.target in (torch.ops.aten.clone.default, torch.ops.aten.eq.Tensor):
                    shared = SharedQuantizationSpec((node.args[0], node))
                    clone = node.target is torch.ops.aten.clone.default
                    node.meta["quantization_annotation"] = QuantizationAnnotation(
                        input_qspec_map={node.args[0]: spec} if clone else {node.args[0]: spec, node.args[1]: shared},
                        output_qspec=shared if clone else None, allow_implicit_sharing=True, _annotated=True)
            return model

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.eq(x.clone(), x)

    x = torch.randn(1, 5)
    prepared = quantkit.prepare(torch.export.export(M(), (x,)).module(), Quantizer())
    modules = dict(prepared.named_modules(remove_duplicate=False))
    obs_nodes = [n for n in prepared.graph.nodes if n.op == "call_module" and "activation_post_process" in str(n.target)]
    assert len(obs_nodes) == 2  # x's and clone's outputs are observed ...
    assert len({id(modules[str(n.target)]) for n in obs_nodes}) == 1  # ... by one observer
    eq = next(n for n in prepared.graph.nodes if n.target is torch.ops.aten.eq.Tensor)
    assert all(a.op == "call_module" for a in eq.args)
