"""7-bit weights on CPUs without VNNI (AVX2): oneDNN's int8 GEMMs exact with 8-bit activations.

Without VNNI, oneDNN multiplies with ``vpmaddubsw``, which adds two u8 x s8 products into a
saturating int16. With int8 weights in -64..63 (``QuantConfig(weight_bits=7)``) a pair sums to at
most 2 * 255 * 64 = 32640 < 32767, so 8-bit activations (static, per-token) stay exact; with
full-range weights they do not. The compiled checks run in a child process with
``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN then uses its AVX2 kernels on any x86 CPU (VNNI or not), and
quantkit decides as on an AVX2-only CPU (``kernels/_cpu_isa.cpu_has`` reads the cap).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

import quantkit
from quantkit.accuracy import _autotune as at
from quantkit.cli import main
from quantkit.quantizers import QuantConfig, W8A8Quantizer
from tests.cli_factories import mlp_quantize_args, write_mlp_inputs
from tests.models import make_mlp

Q = torch.ops.quantized_decomposed


def _converted(config, make=make_mlp):
    m, x = make()
    p = quantkit.prepare(quantkit.capture(m, (x[:8],)), W8A8Quantizer(config))
    quantkit.calibrate(p, [(b,) for b in x.split(32)], progress=False)
    return quantkit.convert(p), x


@pytest.fixture
def no_vnni(monkeypatch):
    monkeypatch.setattr(quantkit.lowering._onednn, "exact_on_this_cpu", lambda: False)


def _weight_dqs(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == Q.dequantize_per_channel.default]


def test_seven_bit_weights_are_stored_in_minus_64_63_and_make_the_graph_exact(no_vnni):
    exact = quantkit.lowering._onednn.exact_for_graph
    for config in (QuantConfig(weight_bits=7), QuantConfig(dynamic=True, granularity="per-token", weight_bits=7)):
        c, _ = _converted(config)
        dqs = _weight_dqs(c)
        assert len(dqs) == 3 and all(tuple(d.args[4:7]) == (-64, 63, torch.int8) for d in dqs)
        for d in dqs:  # the stored integers themselves, not only the declared range
            w = getattr(c, d.args[0].target)
            assert w.dtype == torch.int8 and int(w.min()) >= -64 and int(w.max()) <= 63 and int(w.abs().max()) >= 60
        assert exact(c) and quantkit.lowering._onednn.why_reference(c) is None
    for config in (QuantConfig(), QuantConfig(dynamic=True, granularity="per-token")):
        c, _ = _converted(config)
        assert not exact(c)  # full-range weights with 8-bit activations saturate without VNNI
    # one 8-bit layer among 7-bit ones: the whole graph stays reference (Inductor rewrites every match)
    mixed = W8A8Quantizer(QuantConfig(weight_bits=7)).set_module_name("fc3", QuantConfig())
    m, x = make_mlp()
    p = quantkit.prepare(quantkit.capture(m, (x[:8],)), mixed)
    quantkit.calibrate(p, [(x[:32],)], progress=False)
    assert not exact(quantkit.convert(p))


_CHILD = textwrap.dedent("""
    import json, warnings
    import torch
    import quantkit
    from quantkit._qmath import sqnr
    from quantkit.lowering._onednn import exact_for_graph, exact_on_this_cpu
    from quantkit.quantizers import QuantConfig, W8A8Quantizer

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                            torch.nn.Linear(128, 32)).eval()
    x = torch.randn(256, 64)
    configs = {"static-w7": QuantConfig(weight_bits=7),
               "per-token-w7": QuantConfig(dynamic=True, granularity="per-token", weight_bits=7),
               "static-w8": QuantConfig(), "per-token-w8": QuantConfig(dynamic=True, granularity="per-token")}
    one = torch.nn.Linear(64, 32).eval()  # one layer: no re-rounded per-token inputs downstream
    out = {"exact_on_this_cpu": exact_on_this_cpu()}
    for name, cfg in {**configs, "per-token-w7-one": configs["per-token-w7"]}.items():
        model = one if name.endswith("-one") else m
        p = quantkit.prepare(quantkit.capture(model, (x[:8],)), W8A8Quantizer(cfg))
        quantkit.calibrate(p, [(b,) for b in x.split(32)], progress=False)
        c = quantkit.convert(p)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # the 8-bit ones forced onto oneDNN: what "auto" avoids on this ISA
            fast = quantkit.compile(c, cpu_kernels="onednn" if name.endswith("w8") else "auto")
            with torch.no_grad():
                y, ref = fast(x), c(x)
        out[name] = {"exact": exact_for_graph(c), "rel": float((y - ref).norm() / ref.norm()),
                     "sqnr": float(sqnr(ref, y)), "lowering": fast._orig_mod.meta.get("quantkit_lowering", {}),
                     "prepacked": torch._dynamo.utils.counters["inductor"]["qlinear_weight_prepack_matcher_count"]}
    print(json.dumps(out))
""")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="oneDNN's AVX2 kernels: x86 only")
def test_compiled_under_avx2_seven_bit_weights_are_exact_and_eight_bit_ones_saturate(tmp_path):
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["exact_on_this_cpu"] is False  # the cap reaches quantkit's decision
    static, per_token = out["static-w7"], out["per-token-w7"]
    assert static["exact"] and per_token["exact"]
    assert static["prepacked"] == 3  # Inductor's qlinear patterns took all three linears: oneDNN ran them
    assert per_token["lowering"].get("per_token_linears") == 3
    # int32-exact GEMMs: only float rounding in the epilogues (measured 1.6e-7 static). Per token, one
    # layer is as close; three re-round each next layer's input (Inductor's fused x * (1/s) against
    # the reference's x / s flips a few values by one step: measured 1.5e-4, 77 dB)
    one = out["per-token-w7-one"]
    assert one["exact"] and one["lowering"].get("per_token_linears") == 1
    assert static["rel"] < 1e-5 and one["rel"] < 1e-5 and per_token["sqnr"] > 60, out
    # the same models with 8-bit weights on the same kernels saturate (measured ~20 dB): the check can fail
    for name in ("static-w8", "per-token-w8"):
        assert not out[name]["exact"] and out[name]["sqnr"] < 35, out


def test_auto_offers_the_seven_bit_recipes_only_without_vnni(monkeypatch):
    w7 = {r.name for r in at.RECIPES.values() if r.only_without_vnni}
    assert w7 == {"histogram-w7", "per-token-w7", "per-token-smoothquant-w7", "per-token-fallback-w7", "fallback-w7"}
    assert all(at.RECIPES[n].weight_bits == 7 and at.RECIPES[n].lowering.endswith("-w7") for n in w7)
    monkeypatch.setattr(quantkit.lowering._onednn, "exact_on_this_cpu", lambda: True)
    assert [r.name for r in at.auto_recipes()] == [n for n in at.RECIPES if n not in w7]
    monkeypatch.setattr(quantkit.lowering._onednn, "exact_on_this_cpu", lambda: False)
    # fallback-w7 only when named (measured slower and less accurate than per-token-fallback-w7)
    assert [r.name for r in at.auto_recipes()] == [n for n in at.RECIPES if n != "fallback-w7"]
    assert not at.RECIPES["fallback-w7"].in_auto and all(r.in_auto for r in at.RECIPES.values()
                                                          if r.name != "fallback-w7")


def test_every_fallback_keeps_a_base_of_its_own_lowering():
    trials = [at.Trial(name, "below target", 0.99 + i * 1e-4) for i, name in enumerate(at.RECIPES)
              if not at.RECIPES[name].fallback]
    for r in at.RECIPES.values():
        if not r.fallback:
            continue
        for seen in ([], trials):
            base = at.best_base(seen, r)
            assert base.lowering == r.lowering and not base.fallback, (r.name, base.name)
    assert at.best_base(trials, at.RECIPES["per-token-fallback-w7"]).name == "per-token-smoothquant-w7"
    assert at.best_base(trials, at.RECIPES["fallback-w7"]).name == "histogram-w7"


def test_the_cost_model_plans_seven_bit_weights_on_onednn(no_vnni):
    from quantkit.accuracy import _latency

    w7, x = _converted(QuantConfig(dynamic=True, granularity="per-token", weight_bits=7))
    w8, _ = _converted(QuantConfig(dynamic=True, granularity="per-token"))
    assert _latency.structure_key(w7) == _latency.structure_key(w8)  # only their integer ranges differ
    meter = _latency.Meter(w7, (x[:32],))
    p7, p8 = meter.plan(w7), meter.plan(w8)
    assert (p7.target, p8.target) == ("onednn", "reference")
    assert p7.gemms()[("qlinear", "fp32")] == 3 and ("qlinear", "fp32") not in p8.gemms()


@pytest.fixture(scope="module")
def mlp_files(tmp_path_factory):
    return write_mlp_inputs(tmp_path_factory.mktemp("mlp"), calib_rows=24)


def _mlp_args(files, out, *extra):
    return mlp_quantize_args(*files, out, *extra)


def test_cli_weight_bits_seven_is_recorded_in_the_artifact(mlp_files, tmp_path):
    out = tmp_path / "w7"
    assert main(_mlp_args(mlp_files, out, "--scheme", "w8a8-per-token", "--weight-bits", "7")) == 0
    doc = json.loads((out / "quantization.json").read_text())
    assert doc["recipe"]["weight_bits"] == 7 and doc["config"]["fields"]["weight_bits"] == 7
    graph = quantkit.load(out)
    dqs = _weight_dqs(graph)
    assert dqs and all(tuple(d.args[4:6]) == (-64, 63) for d in dqs)
    out8 = tmp_path / "w8"
    assert main(_mlp_args(mlp_files, out8, "--scheme", "w8a8-per-token")) == 0
    assert "weight_bits" not in json.loads((out8 / "quantization.json").read_text())["recipe"]  # default: unchanged


@pytest.mark.parametrize("extra,message", [
    (["--scheme", "w4a16", "--weight-bits", "7"], "--weight-bits has no effect with --scheme w4a16"),
    (["--scheme", "fp8", "--weight-bits", "7"], "--weight-bits has no effect with --scheme fp8"),
    (["--recipe", "per-token", "--weight-bits", "7"], "--recipe per-token conflicts with --weight-bits"),
    (["--weight-bits", "9"], "argument --weight-bits: invalid choice: 9"),
])
def test_cli_weight_bits_usage_errors(mlp_files, tmp_path, capsys, extra, message):
    capsys.readouterr()
    rc = main(_mlp_args(mlp_files, tmp_path / "bad", *extra))
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "bad").exists()


def test_a_smoothquant_base_keeps_its_float_layers_in_bf16_not_int8():
    assert at.fallback_weights(at.RECIPES["per-token-smoothquant-w7"]) == ("bf16",)
    assert at.fallback_weights(at.RECIPES["per-token-smoothquant"]) == ("bf16",)
    assert at.fallback_weights(at.RECIPES["histogram"]) == at.FALLBACK_WEIGHTS == ("int8", "bf16")
    # why: one int8 scale per output channel of W diag(s) rounds the columns that s made small away
    # (float64, independent of quantkit: the int8 rounding written out here)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen, dtype=torch.float64)
    s = torch.ones(256, dtype=torch.float64)
    s[:4] = 40.0  # SmoothQuant migrates four outlier activation channels into the weight

    def int8_per_channel(m):
        scale = m.abs().amax(1, keepdim=True) / 127
        return (m / scale).round().clamp(-127, 127) * scale
    plain = (int8_per_channel(w) - w).norm() / w.norm()
    smoothed = (int8_per_channel(w * s) / s - w).norm() / w.norm()
    assert smoothed > 5 * plain, (float(plain), float(smoothed))


def test_fallback_with_weights_tries_only_the_weights_it_is_given():
    seen = []

    class _Evaluator:
        reference = 1.0

    def variants_for(w):
        seen.append(w)
        raise ValueError("stop")  # fallback_search is not reached: variants_for is the first call

    with pytest.raises(ValueError, match="stop"):
        at.fallback_with_weights(variants_for, _Evaluator(), 0.999, weights=("bf16",))
    assert seen == ["bf16"]
