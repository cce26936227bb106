"""autotune's per-kernel latency model (quantkit/accuracy/_costmodel.py) and the Meter around it.

Structure, not speed (no timed assertions): which kernels a graph's plan enumerates, at which shapes
and how many times, as ``quantkit.compile`` would run them on this CPU or on a patched VNNI/BF16 one;
that each distinct kernel is timed once per machine (cache) and never twice per run; that bf16 is
never timed where the CPU has no native BF16; and that measure=True compiles a lowered graph once.
How close the estimates are to compiled timings: benchmarks/bench_costmodel.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import quantkit
from quantkit.accuracy import _costmodel, _latency
from quantkit.quantizers import QuantConfig, W8A8Quantizer
from tests.models import make_transformer

# the test block (d=64, 4 heads, MLP 4x) on a 32x16 batch: (M, K, N) of qkv, proj, fc1, fc2
M = 32 * 16
BLOCK_LINEARS = {(M, 64, 192), (M, 64, 64), (M, 64, 256), (M, 256, 64)}
BLOCK_MATMULS = 2  # q @ k^T and attn @ v, each (32, 4, 16, 16)


@pytest.fixture(scope="module")
def block():
    model, x = make_transformer()
    gm = quantkit.capture(model, (x,))
    q = {name: quantkit.quantize(gm, (x,), [(x,)], W8A8Quantizer(cfg), progress=False) for name, cfg in {
        "static": QuantConfig(), "histogram": QuantConfig(act_observer="histogram"),
        "per-token": QuantConfig(dynamic=True, granularity="per-token")}.items()}
    return model, x, gm, q


@pytest.fixture
def timer(tmp_path, monkeypatch):
    """A private cache and a stand-in kernel timer: 1 ms per kernel, every kernel asked for recorded."""
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path / "qk"))
    timed = []
    monkeypatch.setattr(_costmodel, "time_kernel", lambda fn, threads: timed.append(fn) or 1.0)
    asked = []
    real = _costmodel.kernel_runner
    monkeypatch.setattr(_costmodel, "kernel_runner", lambda k: asked.append(k) or real(k))
    return timed, asked, tmp_path / "qk" / "latency.json"


def _linears(p, op):
    return sorted(k.shape for k, n in p.kernels for _ in range(n) if k.op == op)


def _vnni_bf16(monkeypatch, vnni: bool, bf16: bool):
    from quantkit.lowering import _bf16, _onednn

    for mod in (_costmodel, _onednn, _latency):
        monkeypatch.setattr(mod, "exact_on_this_cpu", lambda: vnni)
    for mod in (_costmodel, _bf16, _latency):
        monkeypatch.setattr(mod, "bf16_supported", lambda: bf16)


def test_float_plan_enumerates_the_gemms_and_attention(block):
    _, x, gm, _ = block
    p = _costmodel.plan(gm, (x,))
    assert p.target == "float" and p.float_dtype == "fp32"
    assert set(_linears(p, "linear")) == BLOCK_LINEARS and len(_linears(p, "linear")) == 4
    assert p.gemms() == {("linear", "fp32"): 4, ("matmul", "fp32"): BLOCK_MATMULS}
    [(mm, count)] = [(k, n) for k, n in p.kernels if k.op == "matmul"]
    assert count == 2 and mm.shape == ((32, 4, 16, 16), (32, 4, 16, 16))
    assert p.elementwise_ops > 0 and p.elementwise_bytes > 0


def test_shapes_follow_the_inputs_not_the_capture(block):
    _, x, gm, _ = block
    p = _costmodel.plan(gm, (x[:4],))
    assert set(_linears(p, "linear")) == {(4 * 16, k, n) for _, k, n in BLOCK_LINEARS}


def test_static_int8_runs_the_reference_graph_here_and_onednn_where_exact(block, monkeypatch):
    _, x, gm, q = block
    _vnni_bf16(monkeypatch, vnni=False, bf16=False)
    ref = _costmodel.plan(q["static"], (x,))
    assert ref.target == "reference" and ref.gemms() == {("linear", "fp32"): 4, ("matmul", "fp32"): 2}
    forced = _costmodel.plan(q["static"], (x,), cpu_kernels="onednn")
    assert forced.target == "onednn" and forced.gemms() == {("qlinear", "fp32"): 4, ("matmul", "fp32"): 2}
    assert set(_linears(forced, "qlinear")) == BLOCK_LINEARS
    # the reference graph also dequantizes each int8 weight every call and runs the activation q/dq
    assert ref.elementwise_bytes > forced.elementwise_bytes
    assert ref.elementwise_bytes > _costmodel.plan(gm, (x,)).elementwise_bytes
    _vnni_bf16(monkeypatch, vnni=True, bf16=False)
    assert _costmodel.plan(q["static"], (x,)).gemms() == forced.gemms()


def test_per_token_is_int8_only_where_onednn_is_exact(block, monkeypatch):
    _, x, _, q = block
    _vnni_bf16(monkeypatch, vnni=False, bf16=False)
    here = _costmodel.plan(q["per-token"], (x,))
    assert here.gemms()[("linear", "fp32")] == 4 and ("qlinear", "fp32") not in here.gemms()
    # the reference per-token chain of each linear's activation is timed as it runs
    assert here.gemms()[("pertoken_qdq", "fp32")] == 4
    assert sorted(k.shape for k, n in here.kernels if k.op == "pertoken_qdq" for _ in range(n)) == \
        sorted((m, k) for m, k, _ in BLOCK_LINEARS)
    _vnni_bf16(monkeypatch, vnni=True, bf16=False)
    vnni = _costmodel.plan(q["per-token"], (x,))
    assert vnni.target == "onednn" and vnni.gemms()[("qlinear", "fp32")] == 4
    assert ("pertoken_qdq", "fp32") not in vnni.gemms()


def test_per_token_quantize_is_a_timed_kernel_with_its_activation(block, monkeypatch):
    # on VNNI each per-token GEMM input's quantize is planned as one timed kernel, GELU included where
    # it feeds fc2 (an erf per element is compute-bound: bytes alone put per-token ahead of bf16 on an
    # AMX Xeon where compiled it was 0.84x bf16, issue 28)
    _, x, _, q = block
    _vnni_bf16(monkeypatch, vnni=True, bf16=False)
    p = _costmodel.plan(q["per-token"], (x,))
    quants = sorted(k.shape for k, n in p.kernels if k.op == "pertoken_quant" for _ in range(n))
    assert quants == sorted([(M, 64, ""), (M, 64, ""), (M, 64, ""), (M, 256, "gelu")])
    # the kernel runs: uint8 integers and one scale per row, GELU applied first
    run = _costmodel.kernel_runner(_costmodel.Kernel("pertoken_quant", "fp32", (8, 32, "gelu")))()
    assert run[0].dtype == torch.uint8 and run[0].shape == (8, 32) and run[1].shape == (8, 1)


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_fallback_layers_are_planned_bf16_where_compile_runs_them_so(block, monkeypatch, weights):
    # compile's float_layers_bf16 runs a fallback layer (bf16 or int8 weight, float input) in bf16 on a
    # BF16 CPU wherever oneDNN int8 runs; the plan must say so (fp32 there made the fallback recipe look
    # 3x slower than it runs on an AMX Xeon, issue 28)
    from quantkit.pipeline._float_fallback import finish_float_layers
    from quantkit.pipeline._variants import Variants

    model, x, _, _ = block
    gm = Variants(model, (x[:4],), [(x[i:i + 8],) for i in range(0, 32, 8)], None).build(["linear_2"])
    finish_float_layers(gm, ["linear_2"], weights=weights)
    fc1 = (M, 64, 256)
    _vnni_bf16(monkeypatch, vnni=True, bf16=True)
    p = _costmodel.plan(gm, (x,))
    assert [k.dtype for k, n in p.kernels if k.op == "linear" for _ in range(n)] == ["bf16"]
    assert _linears(p, "linear") == [fc1] and len(_linears(p, "qlinear")) == 3
    assert [k.dtype for k, _ in _costmodel.plan(gm, (x,), float_dtype="fp32").kernels if k.op == "linear"] == ["fp32"]
    _vnni_bf16(monkeypatch, vnni=True, bf16=False)
    assert [k.dtype for k, _ in _costmodel.plan(gm, (x,)).kernels if k.op == "linear"] == ["fp32"]


def test_bf16_where_native_and_large_attention_only(block, monkeypatch):
    _, x, gm, q = block
    _vnni_bf16(monkeypatch, vnni=True, bf16=True)
    # compile's "auto" keeps this block's small attention in fp32 (lowering/_bf16._MIN_BF16_MACS)
    assert _costmodel.plan(q["static"], (x,)).float_dtype == "fp32"
    forced = _costmodel.plan(q["static"], (x,), float_dtype="bf16")
    assert forced.gemms() == {("qlinear", "bf16"): 4, ("matmul", "bf16"): 2}
    assert _costmodel.plan(gm, (x,), float_dtype="bf16").gemms() == {("linear", "bf16"): 4, ("matmul", "bf16"): 2}


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 16).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, t, 32))


def test_sdpa_is_one_kernel_with_its_mask():
    x, mask = torch.randn(3, 8, 32), torch.zeros(3, 1, 8, 8)
    gm = quantkit.capture(_Attention().eval(), (x, mask))
    p = _costmodel.plan(gm, (x, mask))
    [sdpa] = [k for k, n in p.kernels if k.op == "sdpa"]
    assert sdpa.shape == ((3, 2, 8, 16),) * 3 + ((3, 1, 8, 8),)
    assert set(_linears(p, "linear")) == {(24, 32, 96), (24, 32, 32)}
    # the kernel it times runs (random data of those shapes)
    assert _costmodel.kernel_runner(sdpa)().shape == (3, 2, 8, 16)


def test_int8_attention_is_the_int8_sdpa_kernel_where_it_builds():
    from quantkit.lowering._qsdpa import kernel_status

    if not kernel_status().available:
        pytest.skip(f"quantkit::int8_sdpa_cpu does not build here: {kernel_status().reason}")
    x, mask = torch.randn(3, 8, 32), torch.zeros(3, 1, 8, 8)
    gm = quantkit.capture(_Attention().eval(), (x, mask))
    cfg = QuantConfig(ops=frozenset({"linear", "attention"}))
    q = quantkit.quantize(gm, (x, mask), [(x, mask)], W8A8Quantizer(cfg), progress=False)
    p = _costmodel.plan(q, (x, mask))
    assert p.gemms()[("qsdpa", "fp32")] == 1 and ("sdpa", "fp32") not in p.gemms()
    [k] = [k for k, _ in p.kernels if k.op == "qsdpa"]
    assert k.shape == ((3, 2, 8, 16),) * 3 + ((3, 1, 8, 8),)
    assert _costmodel.kernel_runner(k)().shape == (3, 2, 8, 16)
    assert _costmodel.plan(q, (x, mask), cpu_kernels="reference").gemms()[("sdpa", "fp32")] == 1


def test_each_kernel_is_timed_once_per_machine(block, timer, monkeypatch):
    model, x, gm, q = block
    timed, asked, path = timer
    _vnni_bf16(monkeypatch, vnni=False, bf16=False)  # the kernel set of an AVX2-only CPU (VNNI/BF16 add kernels)
    meter = _latency.Meter(gm, (x,))
    meter.int8(q["static"], "static")
    meter.floats(model)
    meter.int8(q["histogram"], "static")
    # 4 linear shapes + 1 matmul shape (run twice) + bandwidth + op overhead; fp32 shares them with static here
    assert len(timed) == 7 and meter.kernel_timings == {"measured": 7} and meter.measured == 7
    assert meter.sources == {f"int8:static:{_latency.structure_key(q['static'])}": "estimated",
                             f"int8:static:{_latency.structure_key(q['histogram'])}": "estimated",
                             "fp32": "estimated"}
    assert meter.noise == _latency.NOISE_ESTIMATED
    entries = json.loads(path.read_text())
    assert len(entries) == 7 and all(k.startswith("costmodel|") for k in entries)
    again = _latency.Meter(gm, (x,))
    assert again.int8(q["static"], "static") == meter.int8(q["static"], "static")
    assert len(timed) == 7 and again.kernel_timings == {"cache": 7} and again.measured == 0


def test_bad_kernel_entries_are_timed_again_with_a_note(block, timer, monkeypatch):
    _, x, gm, q = block
    timed, _, path = timer
    _vnni_bf16(monkeypatch, vnni=False, bf16=False)  # the reference graph's fp32 linears (VNNI times qlinears)
    _latency.Meter(gm, (x,)).int8(q["static"], "static")
    doc = json.loads(path.read_text())
    bad = next(k for k in doc if "|kernel|linear|" in k)
    path.write_text(json.dumps({**doc, bad: "fast"}))
    meter = _latency.Meter(gm, (x,))
    meter.int8(q["static"], "static")
    assert meter.kernel_timings == {"cache": 6, "measured": 1}
    [note] = meter.notes
    assert "kernel|linear|fp32" in note and "ignored and measured again" in note, note
    assert json.loads(path.read_text())[bad] == 1.0


def test_no_bf16_timing_without_native_bf16(block, timer, monkeypatch):
    model, x, gm, _ = block
    _, asked, _ = timer
    _vnni_bf16(monkeypatch, vnni=False, bf16=False)
    out = _latency.Meter(gm, (x,)).floats(model)
    assert out["bf16_ms"] is None and out["bf16_native"] is False and out["fp32_ms"] > 0
    assert asked and all(k.dtype == "fp32" for k in asked)
    _vnni_bf16(monkeypatch, vnni=True, bf16=True)
    out = _latency.Meter(gm, (x,)).floats(model)
    assert out["bf16_native"] is True and out["bf16_ms"] > 0
    assert {k.dtype for k in asked} == {"fp32", "bf16"}


def test_measure_compiles_each_lowered_graph_once(block, tmp_path, monkeypatch):
    _, x, gm, q = block
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path))
    timed = []
    monkeypatch.setattr(_latency, "_time", lambda fn, inputs, dtype=None: timed.append(fn) or 3.0)
    meter = _latency.Meter(gm, (x,), measure=True, cache=False)
    assert meter.noise == _latency.NOISE_MEASURED
    meter.int8(q["static"], "static")
    meter.int8(q["histogram"], "static")  # other ranges, same lowered graph: not compiled again
    assert len(timed) == 1
    meter.int8(q["per-token"], "per-token")
    assert len(timed) == 2 and set(meter.sources.values()) == {"measured"}
    forced = _latency.Meter(gm, (x,), measure=True, cache=False, cpu_kernels="onednn")
    forced.int8(q["static"], "static")  # the same graph run as oneDNN int8 (Inductor freezing): another timing
    assert len(timed) == 3
    assert not (tmp_path / "latency.json").exists()  # cache=False writes nothing


@pytest.mark.parametrize("vnni, bf16, needles", [
    (True, True, None),
    (False, True, ["no VNNI/AMX", "reference q/dq graph"]),
    (True, False, ["no native BF16"]),
    (False, False, ["no VNNI/AMX", "no native BF16"]),
])
def test_cpu_support_line(monkeypatch, vnni, bf16, needles):
    _vnni_bf16(monkeypatch, vnni=vnni, bf16=bf16)
    line = _costmodel.cpu_support_line()
    if needles is None:
        assert line is None
    else:
        assert "\n" not in line and all(n in line for n in needles), line
        assert ("BF16" in line) == (not bf16) and ("VNNI" in line) == (not vnni)


@pytest.mark.parametrize("times, expect, calls", [
    ([1.55, 1.60, 0.78], 0.78, 3),  # a moment without the second core: timed again, its real time
    ([1.55, 1.60, 1.58, 1.57], 1.55, 4),  # a kernel that does not parallelise: two retries, then the best
    ([0.80, 1.60], 0.80, 2),  # parallel as expected: no retry
    ([0.05, 0.06], 0.05, 2),  # too small to doubt
])
def test_a_parallel_kernel_timed_no_faster_than_one_thread_is_timed_again(monkeypatch, times, expect, calls):
    """time_kernel: the threads' time, the one-thread time, then (threads no faster than 0.75x one
    thread, on a kernel of >= 0.1 ms) up to two more timings with the threads; the fastest counts."""
    seen = []
    feed = iter(times)
    monkeypatch.setattr(_costmodel, "time_call", lambda fn: seen.append(torch.get_num_threads()) or next(feed))
    monkeypatch.setattr(_costmodel, "RETRY_PAUSE_S", 0.0)
    assert _costmodel.time_kernel(lambda: None, 2) == expect
    assert len(seen) == calls and seen[:2] == [2, 1] and all(t == 2 for t in seen[2:])
