"""Per-token dynamic int8 on CPU (lowering/_per_token.py): op counts of the rewrite, the integer GEMM
bit-exact against float64, the quantized integers against torch's own per-token ops, the whole output
against the reference q/dq graph, oneDNN through Inductor, and compile's "auto" choice.

Tolerances. Eager, the rewritten graph computes ``(sum_k q_x q_w) * s_x * s_w`` with an exact int32
sum where the reference rounds each float32 product ``(q_x s_x)(q_w s_w)``: relative error of the
output norm below ``FP32_REL_TOL = 1e-5`` for one layer (K <= 128: about K * 2**-24 worst case;
measured 1.5e-7 to 2.2e-7). In a deeper model such a float32 difference may move the next layer's
per-token quantize across a rounding boundary (measured: one row of 256 in the MLP), so whole models
are held to ``FLIP_REL_TOL = 5e-3``. Compiled with oneDNN on an AVX2-only CPU the GEMM is exact only
while ``|w_int8| <= 64`` (``vpmaddubsw`` int16 pair sums: 2 * 255 * 64 fits), so the compiled tests
clamp the stored int8 weights of the converted graph -- reference and compiled read the same ones.
"""

import copy

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import quantkit
from quantkit.lowering import _onednn, _per_token, registered_lowerings
from quantkit.lowering._compile import LOWERING_META_KEY, REFERENCE_META_KEY
from quantkit.lowering._lower import Target
from quantkit.lowering._registry import LoweringContext
from quantkit.quantizers import QuantConfig, W8A8Quantizer
from tests.models import make_mlp, make_transformer

Q = torch.ops.quantized_decomposed
aten = torch.ops.aten
PER_TOKEN = QuantConfig(dynamic=True, granularity="per-token")
FP32_REL_TOL = 1e-5
FLIP_REL_TOL = 5e-3
BF16_REL_TOL = 2e-2  # as tests/test_bf16_lowering.py: bf16 keeps 8 significant bits
NO_VNNI = "oneDNN int8 accumulates exactly only with VNNI/AMX; this CPU saturates int16 pair sums"


class _Siblings(nn.Module):
    """Three linears reading one input (attention's query / key / value projections)."""

    def __init__(self, d: int = 64, bias: bool = True) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, n, bias=bias) for n in (d, d, 32))

    def forward(self, x):
        return self.q(x), self.k(x), self.v(x)


def _converted(model, x, config=PER_TOKEN):
    p = quantkit.prepare(quantkit.capture(model.eval(), (x[:2],)), W8A8Quantizer(config))
    quantkit.calibrate(p, [(b,) for b in x.split(4)], progress=False)
    return quantkit.convert(p)


def _linear(bias=True, rank=2, d_in=64, d_out=48):
    torch.manual_seed(0)
    x = torch.randn(8, 6, d_in) if rank == 3 else torch.randn(32, d_in)
    return _converted(nn.Sequential(nn.Linear(d_in, d_out, bias=bias)), x), x


def _count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def _gemms(gm):
    """The linears this pass wrote."""
    return [n for n in gm.graph.nodes if n.target is aten.linear.default and _per_token.INT8_KERNEL_META_KEY in n.meta]


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _flat(out):
    return torch.cat([o.reshape(-1) for o in out]) if isinstance(out, (tuple, list)) else out.reshape(-1)


def _small_weights(gm):
    """Clamp the converted graph's int8 weights to -64..64 (exact on any x86 oneDNN); in place."""
    for b in gm.buffers():
        if b.dtype == torch.int8:
            b.clamp_(-64, 64)
    return gm


class _Recorder(torch.fx.Interpreter):
    """Runs a graph eagerly and keeps the value of every node."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        self.values[n] = out = super().run_node(n)
        return out


def test_registered_between_int8_and_weight_only_on_cpu():
    p = next(p for p in registered_lowerings() if p.name == "int8_per_token")
    assert 100 < p.order < 200 and p.devices == ("cpu",)
    c, _ = _linear()
    for target in (None, Target.TRITON):  # nothing without the oneDNN target
        assert _per_token.lower_per_token(copy.deepcopy(c), LoweringContext("cpu", target, "auto", torch.float32,
                                                                            "scaled_mm")) == {}
    gm = copy.deepcopy(c)
    ctx = LoweringContext("cpu", Target.ONEDNN, "onednn", torch.float32, "scaled_mm")
    assert _per_token.lower_per_token(gm, ctx) == {"per_token_linears": 1, "per_token_gemms": 1}


def test_mlp_op_counts_and_one_int8_copy_of_each_weight():
    m, x = make_mlp()
    c = _converted(m, x)
    gm = copy.deepcopy(c)
    assert _per_token.rewrite_per_token_linears(gm) == 3
    mms = _gemms(gm)
    assert len(mms) == 3 and _count(gm, aten.linear.default) == 3
    for op in (Q.dequantize_per_token.default, Q.choose_qparams_per_token.default, Q.quantize_per_token.default):
        assert _count(gm, op) == 0, op
    # every GEMM reads a uint8 activation (zero point 128, scale 1) and a per-channel int8 weight
    assert all(n.args[0].target is Q.dequantize_per_tensor.default and n.args[0].args[1:] == (1.0, 128, 0, 255,
                                                                                             torch.uint8)
               for n in mms)
    int8 = {name: b for name, b in gm.named_buffers() if b.dtype == torch.int8}
    assert sorted(b.shape for b in int8.values()) == sorted([torch.Size([128, 64]), torch.Size([128, 128]),
                                                             torch.Size([32, 128])])
    assert {n.args[1].args[0].target for n in mms} == set(int8)  # the only int8 weights left
    assert _count(gm, aten.relu.default) == 2  # left in place, after the bias add
    with torch.no_grad():
        assert _rel(gm(x), c(x)) < FLIP_REL_TOL


def test_gemm_is_exact_and_reads_the_reference_integers():
    m, x = make_transformer()
    c = _converted(m, x)
    gm = copy.deepcopy(c)
    assert _per_token.rewrite_per_token_linears(gm) == 4  # qkv, proj, fc1, fc2
    rec = _Recorder(gm)
    with torch.no_grad():
        rec.run(x)
    mms = _gemms(gm)
    assert len(mms) == 4
    for n in mms:
        q_u8, w_q = n.args[0].args[0], n.args[1].args[0]
        a, b = rec.values[q_u8], rec.values[w_q]
        assert a.dtype == torch.uint8 and b.dtype == torch.int8
        # the GEMM of the integers, in float64 against the linear's float32 result: (q_x)(q_w) s_w
        s_w = rec.values[n.args[1].args[1]].double()
        exact = (a.double() - 128) @ (b.double() * s_w[:, None]).T
        assert _rel(rec.values[n], exact) < FP32_REL_TOL
        # the integers: torch's own choose_qparams_per_token + quantize_per_token of the same float input
        src = rec.values[q_u8.args[0].args[0].args[0].args[0].args[0]]  # to(u8) <- add <- clamp <- round <- mul
        scale, zp = Q.choose_qparams_per_token(src, torch.int8)
        ref = Q.quantize_per_token(src, scale, zp, -128, 127, torch.int8)
        assert torch.equal(a.to(torch.int16) - 128, ref.to(torch.int16).reshape(a.shape))


def test_transformer_attention_matmuls_keep_their_reference_ops():
    m, x = make_transformer()
    c = _converted(m, x)
    gm = copy.deepcopy(c)
    _per_token.rewrite_per_token_linears(gm)
    # the two attention matmuls' per-token left operands are not linears: still dequantized
    assert _count(gm, aten.matmul.default) == 2 and _count(gm, Q.dequantize_per_token.default) == 2
    assert _count(gm, Q.choose_qparams_per_token.default) == 2
    with torch.no_grad():
        assert _rel(gm(x), c(x)) < FLIP_REL_TOL


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rank", [2, 3])
def test_one_linear_matches_the_reference_graph(bias, rank):
    c, x = _linear(bias, rank)
    gm = copy.deepcopy(c)
    assert _per_token.rewrite_per_token_linears(gm) == 1
    ours = [n for n in gm.graph.nodes if _per_token.INT8_KERNEL_META_KEY in n.meta]
    assert sum(n.target is aten.add.Tensor for n in ours) == 1 + int(bias)  # the +128 shift, the bias
    assert sum(n.target is aten.reshape.default for n in ours) == 0  # the linear reads [..., K] as it is
    with torch.no_grad():
        out, ref = gm(x), c(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert _rel(out, ref) < FP32_REL_TOL, _rel(out, ref)


def test_siblings_share_one_gemm():
    torch.manual_seed(0)
    x = torch.randn(4, 8, 64)
    c = _converted(_Siblings(), x)
    gm = copy.deepcopy(c)
    assert _per_token.rewrite_per_token_linears(gm) == 3
    mm = _gemms(gm)
    assert len(mm) == 1 and tuple(getattr(gm, mm[0].args[1].args[0].target).shape) == (64 + 64 + 32, 64)
    assert _count(gm, aten.slice.Tensor) == 3
    assert sum(1 for b in gm.buffers() if b.dtype == torch.int8) == 1  # the three weights, concatenated once
    with torch.no_grad():
        assert _rel(_flat(gm(x)), _flat(c(x))) < FP32_REL_TOL


def test_smoothquant_folded_scales_keep_working():
    m, x = make_mlp()
    calib = list(x.split(32))
    smoothed = quantkit.smooth_quant(m, calib, alpha=0.5)
    c = _converted(smoothed, x)
    gm = copy.deepcopy(c)
    assert _per_token.rewrite_per_token_linears(gm) == 3
    with torch.no_grad():
        out, ref, fp = gm(x), c(x), m(x)
    assert _rel(out, ref) < FLIP_REL_TOL
    assert _rel(out, fp) < 5e-2  # still the model: int8 error only


@pytest.mark.parametrize("config", [QuantConfig(dynamic=True),
                                    QuantConfig(dynamic=True, activation="affine-uint8")],
                         ids=["dynamic-symmetric", "dynamic-asymmetric"])
def test_per_tensor_dynamic_is_not_rewritten(config):
    """Dynamic per-tensor linears are Inductor's own qlinear pattern (``dequantize_per_tensor.tensor``):
    this pass leaves them, asymmetric or not."""
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    c = _converted(nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16)), x, config)
    gm = copy.deepcopy(c)
    assert _per_token.rewrite_per_token_linears(gm) == 0
    assert not _gemms(gm) and _count(gm, aten.linear.default) == 2


def _compiled_code(c, x, **kw):
    with pytest.warns(UserWarning, match="saturates") if not _onednn.exact_on_this_cpu() else _no_warning():
        fast = quantkit.compile(c, cpu_kernels="onednn", **kw)
    with torch.no_grad():
        out, code = run_and_get_code(fast, x)
    return fast, out, "\n".join(code)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("case", ["2d-bias", "3d-siblings", "dynamic-per-tensor"])
def test_compiled_onednn_matches_reference_with_small_weights(case):
    """Per-token linears reach oneDNN through this pass; dynamic per-tensor ones through Inductor's
    own ``dequantize_per_tensor.tensor`` qlinear pattern (nothing for this pass to do)."""
    torch.manual_seed(0)
    if case == "3d-siblings":
        x = torch.randn(4, 8, 64)
        c, expect = _converted(_Siblings(bias=False), x), (3, 1)
    elif case == "2d-bias":
        c, x = _linear(bias=True, rank=2)
        expect = (1, 1)
    else:
        x = torch.randn(32, 64)
        c, expect = _converted(nn.Sequential(nn.Linear(64, 48)), x, QuantConfig(dynamic=True)), (0, 0)
    _small_weights(c)
    fast, out, code = _compiled_code(c, x)
    counts = fast._orig_mod.meta[LOWERING_META_KEY]
    assert (counts["per_token_linears"], counts["per_token_gemms"]) == expect
    assert code.count("= torch.ops.onednn.qlinear_pointwise") == 1  # one oneDNN GEMM (siblings: for all three)
    assert "_int_mm" not in code
    if case != "dynamic-per-tensor":  # per token: the quantize fused into C++, no Python fallback left
        assert "quantized_decomposed" not in code
    with torch.no_grad():
        ref = c(x)
    assert _rel(_flat(out), _flat(ref)) < FP32_REL_TOL, _rel(_flat(out), _flat(ref))


@pytest.mark.skipif(not _onednn.exact_on_this_cpu(), reason=NO_VNNI)
def test_compiled_auto_exact_with_full_range_weights_on_vnni():
    c, x = _linear(bias=True, rank=3)
    fast = quantkit.compile(c)  # auto: oneDNN here
    assert fast._orig_mod.meta[LOWERING_META_KEY]["per_token_linears"] == 1
    assert REFERENCE_META_KEY not in fast._orig_mod.meta
    with torch.no_grad():
        assert _rel(fast(x), c(x)) < FP32_REL_TOL


def test_auto_declines_without_vnni_and_says_why(monkeypatch):
    c, _ = _linear()
    monkeypatch.setattr(_onednn, "exact_on_this_cpu", lambda: False)
    line = ("no VNNI/AMX on this CPU: int8 GEMMs of per-token int8 activations and 8-bit weights would saturate; "
            "running the reference q/dq graph")
    assert not _onednn.exact_for_graph(c) and _onednn.why_reference(c) == line
    fast = quantkit.compile(c)  # torch.compile is lazy: nothing is compiled until the first call
    assert fast._orig_mod.meta[LOWERING_META_KEY] == {} and fast._orig_mod.meta[REFERENCE_META_KEY] == line
    assert _count(fast._orig_mod, Q.dequantize_per_token.default) == 1
    monkeypatch.setattr(_onednn, "exact_on_this_cpu", lambda: True)
    assert _onednn.exact_for_graph(c) and _onednn.why_reference(c) is None
    fast = quantkit.compile(c)
    assert fast._orig_mod.meta[LOWERING_META_KEY]["per_token_linears"] == 1
    assert REFERENCE_META_KEY not in fast._orig_mod.meta


def test_forced_bf16_still_matches_and_stays_correct():
    """int8-mixed-bf16: the bf16 pass casts around the chain, not inside it (its nodes carry no
    example values), so the quantize stays float32 and Inductor's pattern still takes the GEMM."""
    torch.manual_seed(0)
    x = torch.randn(8, 6, 64)
    c = _small_weights(_converted(nn.Sequential(nn.Linear(64, 48), nn.LayerNorm(48), nn.Linear(48, 16)), x))
    fast, out, code = _compiled_code(c, x, float_dtype="bf16")
    counts = fast._orig_mod.meta[LOWERING_META_KEY]
    assert counts["per_token_linears"] == 2 and counts["to_bf16"] > 0
    gm = fast._orig_mod
    ours = {n for n in gm.graph.nodes if _per_token.INT8_KERNEL_META_KEY in n.meta}
    casts = [n for n in gm.graph.nodes if n.target is aten._to_copy.default and n.kwargs.get("dtype") == torch.bfloat16]
    # no bf16 cast between two nodes of a chain (casts may feed it its input and constants, which then
    # get bf16 rounding as the reference bf16 graph's dq(w) and bias do, and read its outputs)
    computed = {n for n in ours if n.op == "call_function"}
    assert casts and not any(c.args[0] in computed and any(u in ours for u in c.users) for c in casts)
    assert all(n.kwargs.get("dtype") != torch.bfloat16 for n in ours)
    assert code.count("= torch.ops.onednn.qlinear_pointwise") == 2 and "_int_mm" not in code
    assert out.dtype == torch.float32
    with torch.no_grad():
        ref = c(x)
    assert _rel(out, ref) < BF16_REL_TOL, _rel(out, ref)


@pytest.mark.skipif(not _onednn.exact_on_this_cpu(), reason=NO_VNNI)
def test_compiled_gemm_runs_onednn_fast_int8_matmul_not_its_reference(capfd):
    """oneDNN's own verbose log names the implementation each matmul ran: a jit/brgemm kernel, never
    ``ref_int8`` (an int8 x int8 ``_int_mm`` ran there on VNNI without AMX: 93 s for one MiniLM MLP)."""
    c, x = _linear(bias=True, rank=3, d_in=128, d_out=96)
    fast = quantkit.compile(c)
    with torch.no_grad():
        fast(x)  # compiled and the weight prepacked here: the timed call below runs the GEMM only
        capfd.readouterr()
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            out = fast(x)
    log = capfd.readouterr().out
    matmuls = [line.split(",")[5] for line in log.splitlines() if line.startswith("onednn_verbose")
               and ",exec,cpu,matmul," in line]
    assert len(matmuls) == 1 and not matmuls[0].startswith("ref"), matmuls
    with torch.no_grad():
        assert _rel(out, c(x)) < FP32_REL_TOL
