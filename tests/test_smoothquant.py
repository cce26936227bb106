"""smooth_quant: float no-op, the scale formula, folding vs explicit mul, and the SQNR gain."""

import copy

import pytest
import torch
from torch import nn

import quantkit
from quantkit._qmath import sqnr
from quantkit.accuracy._smoothquant import SMOOTHQUANT_META_KEY, parse_alpha
from tests.models import make_transformer
from tests.outlier_models import make_channel_outliers

aten = torch.ops.aten


class _Chain(nn.Module):
    """fc_a feeds fc_b alone (fold into fc_a's rows); fc_b's output feeds fc_c and a residual (mul)."""

    def __init__(self, d=32):
        super().__init__()
        self.fc_a, self.fc_b, self.fc_c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        with torch.no_grad():
            self.fc_a.weight[:3] *= 30

    def forward(self, x):
        y = self.fc_b(self.fc_a(x))
        return y + self.fc_c(y)


def _count(gm, op):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is op)


def _split(x):
    return list(x[:128].split(32)), x[128:]


@pytest.mark.parametrize("alpha", [0.5, "auto"])
def test_smoothquant_raises_w8a8_sqnr_and_is_a_float_noop(alpha):
    model, x = make_channel_outliers()
    calib, test = _split(x)
    smoothed = quantkit.smooth_quant(model, calib, alpha=alpha)
    with torch.no_grad():
        ref = model(test)
        diff = (smoothed(test) - ref).abs().max().item()
        assert diff <= 1e-5, f"smoothed float model differs by {diff:.3g}"
        base = sqnr(ref, quantkit.quantize(model, (x[:8],), calib, progress=False)(test))
        smooth = sqnr(ref, quantkit.quantize(smoothed, (x[:8],), calib, progress=False)(test))
    assert smooth - base >= 6.0, f"W8A8 SQNR {base:.2f} dB -> {smooth:.2f} dB with SmoothQuant (alpha={alpha})"
    records = smoothed.meta[SMOOTHQUANT_META_KEY]
    assert [r["modules"] for r in records] == [["fc1"], ["fc2"]]
    assert all(r["alpha"] is None or 0 <= r["alpha"] <= 1 for r in records)


def test_scales_follow_the_formula_and_fold_into_layernorm():
    model, x = make_channel_outliers()
    calib, _ = _split(x)
    alpha = 0.5
    smoothed = quantkit.smooth_quant(model, calib, alpha=alpha)
    with torch.no_grad():
        acts = torch.cat([model.ln(b).reshape(-1, 64) for b in calib])
    act_max = acts.abs().amax(0).double()
    w = model.fc1.weight.detach()
    s_ref = act_max.pow(alpha) / w.abs().amax(0).double().pow(1 - alpha)
    s = smoothed.get_parameter("fc1.weight") / w  # column j scaled by s_j
    torch.testing.assert_close(s, s_ref.float().expand_as(s), rtol=1e-5, atol=0)
    torch.testing.assert_close(smoothed.get_parameter("ln.weight"), model.ln.weight / s_ref.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(smoothed.get_parameter("ln.bias"), model.ln.bias / s_ref.float(), rtol=1e-6, atol=0)
    # fc1 folded into the LayerNorm (no op added); fc2 (after a ReLU) needs one mul
    assert _count(smoothed, aten.mul.Tensor) == 1
    assert [r["folded_into"] for r in smoothed.meta[SMOOTHQUANT_META_KEY]] == ["norm:layer_norm", "mul"]
    # the original model is untouched
    assert model.ln.weight[:4].eq(50).all() and model.ln.weight[4:].eq(1).all()


def test_fold_into_linear_and_mul_for_shared_inputs():
    torch.manual_seed(0)
    model, x = _Chain().eval(), torch.randn(160, 32)
    calib, test = _split(x)
    smoothed = quantkit.smooth_quant(model, calib, alpha=0.5)
    kinds = {tuple(r["modules"]): r["folded_into"] for r in smoothed.meta[SMOOTHQUANT_META_KEY]}
    assert kinds == {("fc_a",): "mul", ("fc_b",): "linear:linear", ("fc_c",): "mul"}
    assert _count(smoothed, aten.mul.Tensor) == 2
    with torch.no_grad():
        assert (smoothed(test) - model(test)).abs().max().item() <= 1e-5
    # the inserted muls are quantized like any linear input
    q = quantkit.quantize(copy.deepcopy(smoothed), (x[:8],), calib, progress=False)  # prepare consumes its input
    report = quantkit.debug.compare(smoothed, q, [test])
    assert [r.layer.module for r in report.rows] == ["fc_a", "fc_b", "fc_c"]


def test_transformer_graph_input_and_auto():
    model, x = make_transformer()
    gm = quantkit.capture(model, (x[:8],))
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    smoothed = quantkit.smooth_quant(gm, [x[:16], x[16:]], alpha="auto")
    assert all(torch.equal(before[k], v) for k, v in gm.state_dict().items())  # input not modified
    with torch.no_grad():
        assert (smoothed(x) - model(x)).abs().max().item() <= 1e-5
    assert len(smoothed.meta[SMOOTHQUANT_META_KEY]) == 4  # qkv, proj, fc1, fc2


def test_parse_alpha_and_errors():
    assert parse_alpha("auto") == "auto" and parse_alpha(" AUTO ") == "auto"
    assert parse_alpha("0.75") == 0.75
    with pytest.raises(ValueError, match=r"--smoothquant expects a number in \[0, 1\] or 'auto', got 'half'"):
        parse_alpha("half")
    with pytest.raises(ValueError, match="alpha must be in"):
        parse_alpha("1.5")
    model, x = make_channel_outliers()
    with pytest.raises(ValueError, match="alpha must be in"):
        quantkit.smooth_quant(model, [x[:8]], alpha=-0.1)
    with pytest.raises(TypeError, match="alpha must be a number"):
        quantkit.smooth_quant(model, [x[:8]], alpha="0.5")
    with pytest.raises(ValueError, match="calibration data is empty"):
        quantkit.smooth_quant(model, [])
    q = quantkit.quantize(model, (x[:8],), [x[:8]], progress=False)
    with pytest.raises(TypeError, match="before quantkit.prepare"):
        quantkit.smooth_quant(q, [x[:8]])


def test_auto_alpha_scores_the_quantization_it_is_given():
    """alpha="auto" simulates the QuantConfig passed as ``config``: per-token activations
    (the quantized_decomposed ops convert emits) and the config's weight observer."""
    from quantkit.accuracy._smoothquant import _quantized_acts, _quantized_weight
    from quantkit.quantizers import QuantConfig, W8A8Quantizer

    per_token = QuantConfig(dynamic=True, granularity="per-token")
    model, x = make_channel_outliers()
    calib, test = _split(x)
    # the simulation is the converted model's math, bit for bit
    lin = nn.Sequential(nn.Linear(16, 8)).eval()
    xs = torch.randn(5, 16) * torch.linspace(0.1, 20, 16)
    qlin = quantkit.quantize(lin, (xs,), [xs], W8A8Quantizer(per_token), progress=False)
    expect = nn.functional.linear(_quantized_acts(xs, None, None, per_token),
                                  _quantized_weight(lin[0].weight.detach(), per_token), lin[0].bias)
    with torch.no_grad():
        assert torch.allclose(qlin(xs), expect, atol=1e-6)
    # scored under per-token, the chosen alphas differ and per-token SQNR is at least as good
    default_auto = quantkit.smooth_quant(model, calib, alpha="auto")
    token_auto = quantkit.smooth_quant(model, calib, alpha="auto", config=per_token)
    alphas = lambda g: [r["alpha"] for r in g.meta[SMOOTHQUANT_META_KEY]]  # noqa: E731
    assert alphas(default_auto) != alphas(token_auto)
    with torch.no_grad():
        ref = model(test)
        scores = {}
        for name, g in (("none", model), ("default", default_auto), ("per-token", token_auto)):
            q = quantkit.quantize(g, (x[:8],), calib, W8A8Quantizer(per_token), progress=False)
            scores[name] = sqnr(ref, q(test))
    assert scores["per-token"] >= max(scores["default"], scores["none"]) - 0.1, scores
    with pytest.raises(TypeError, match="config must be a QuantConfig"):
        quantkit.smooth_quant(model, calib, alpha="auto", config="per-token")


def test_one_statistics_pass_serves_several_configs_with_the_same_factors(monkeypatch):
    """smoothquant_statistics runs the data once; smooth_quant(statistics=...) under two activation
    schemes gives exactly the graphs (weights, folded norms, alphas) of two plain calls."""
    from quantkit.accuracy import _smoothquant as sq
    from quantkit.quantizers import QuantConfig

    model, x = make_transformer()
    gm = quantkit.capture(model, (x[:8],))
    calib = [x[:16], x[16:]]
    configs = (QuantConfig(), QuantConfig(dynamic=True, granularity="per-token"))
    plain = [quantkit.smooth_quant(gm, calib, alpha="auto", config=c) for c in configs]
    passes = []
    real = sq._collect
    monkeypatch.setattr(sq, "_collect", lambda *a, **k: passes.append(1) or real(*a, **k))
    stats = sq.smoothquant_statistics(gm, calib)
    shared = [quantkit.smooth_quant(gm, calib, alpha="auto", config=c, statistics=stats) for c in configs]
    assert len(passes) == 1
    for a, b in zip(plain, shared):
        assert a.meta[SMOOTHQUANT_META_KEY] == b.meta[SMOOTHQUANT_META_KEY]
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    other = quantkit.capture(model, (x[:8],))
    with pytest.raises(ValueError, match="smoothquant_statistics\\(\\) of this very graph"):
        quantkit.smooth_quant(other, calib, alpha="auto", statistics=stats)
    few = sq.smoothquant_statistics(gm, calib, rows=0)
    with pytest.raises(ValueError, match="collect them with rows=1024"):
        quantkit.smooth_quant(gm, calib, alpha="auto", statistics=few)
    fixed = quantkit.smooth_quant(gm, calib, alpha=0.5, statistics=few)  # ranges are all a fixed alpha needs
    assert fixed.meta[SMOOTHQUANT_META_KEY] == quantkit.smooth_quant(gm, calib, alpha=0.5).meta[SMOOTHQUANT_META_KEY]


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=50)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # outlier channels in every norm's output, as in real LLMs
        for layer in model.model.layers:
            layer.input_layernorm.weight[:2] = 20.0
            layer.post_attention_layernorm.weight[3] = 15.0
    gen = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 50, (2, 10), generator=gen),
                "attention_mask": torch.ones(2, 10, dtype=torch.long)} for _ in range(2)]
    return model, batches


def test_folds_into_decomposed_rmsnorm_and_the_gated_mlp():
    """On a captured HF Llama the RMSNorm is decomposed (its last op ``w * x̂``) and the MLP is
    ``down(silu(gate(x)) * up(x))``: 1/s folds into the norm's ``w`` and into ``up``'s rows; only
    grouped-query attention's o_proj (and lm_head, behind a slice) needs an inserted mul (none with
    fold_only). The factors
    are the paper's formula on activations read by hooks on the HF model, and the smoothed graph
    computes the float model."""
    from quantkit import _hf

    model, batches = _tiny_llama()
    gm = quantkit.capture(model, batches[0], dynamic_shapes=_hf.dynamic_shapes(batches[0]))
    muls = _count(gm, aten.mul.Tensor)
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, name=name: seen.setdefault(name, []).append(
        a[0].detach().reshape(-1, a[0].shape[-1]))) for name, m in model.named_modules()
        if name.endswith(("q_proj", "gate_proj", "down_proj"))]
    with torch.no_grad():
        for b in batches:
            ref = model(**b)
    for h in hooks:
        h.remove()

    def s_ref(inp, *weights):  # alpha 0.5: sqrt(max|x_j|) / sqrt(max_i |W_ij|), in float64
        act = torch.cat(seen[inp]).abs().amax(0).double()
        w = torch.stack([model.get_parameter(f"{n}.weight").abs().amax(0) for n in weights]).amax(0).double()
        return (act.sqrt() / w.sqrt()).float()

    for fold_only in (False, True):
        smoothed = quantkit.smooth_quant(gm, batches, alpha=0.5, fold_only=fold_only)
        kinds = [r["folded_into"].split(":")[0] for r in smoothed.meta[SMOOTHQUANT_META_KEY]]
        mul = "unscaled" if fold_only else "mul"
        # per layer: q/k/v, o_proj, gate/up, down; then lm_head (it reads the final norm through a slice)
        assert kinds == ["norm", mul, "norm", "gate"] * 2 + [mul], kinds
        assert _count(smoothed, aten.mul.Tensor) == muls + (0 if fold_only else 3)
        with torch.no_grad():
            got = smoothed(**batches[1])["logits"]
        assert (got - ref.logits).abs().max() <= 1e-4 * ref.logits.abs().max()
        p = "model.layers.1"
        s_qkv = s_ref(f"{p}.self_attn.q_proj", *(f"{p}.self_attn.{n}_proj" for n in "qkv"))
        s_gu = s_ref(f"{p}.mlp.gate_proj", f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")
        s_down = s_ref(f"{p}.mlp.down_proj", f"{p}.mlp.down_proj")
        torch.testing.assert_close(smoothed.get_parameter(f"{p}.input_layernorm.weight"),
                                   model.get_parameter(f"{p}.input_layernorm.weight") / s_qkv, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(smoothed.get_parameter(f"{p}.mlp.up_proj.weight"),
                                   model.get_parameter(f"{p}.mlp.up_proj.weight") * s_gu / s_down[:, None],
                                   rtol=1e-4, atol=1e-6)
    assert model.model.layers[1].input_layernorm.weight[0] == 20.0  # the float model untouched
