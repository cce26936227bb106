"""FP8 on CPU against its reference q/dq graph: where the SQNR of the hidden states goes.

Measured on all-MiniLM-L6-v2, FP8 static, 32 x 128 tokens (issue 28): compiled vs reference 33.0 dB,
the lowered graph run eagerly 34.4 dB -- but also: Inductor compiling the *reference math itself*
(float8 q/dq as aten ops, linears on dequantized weights, no ``_scaled_mm``) 33.8 dB, and the eager
reference against itself with ~1 ulp of float32 noise on the embedding LayerNorm output 35.4 dB. No op
loses it: every lowered FP8 linear agrees with its reference op to ~130 dB when both read the same
inputs. The reference is that sensitive because each static E4M3 quantize turns a float32 rounding
difference at a rounding boundary into a whole E4M3 step (1/16 relative), and those flips grow
about tenfold per layer (5e-6 of the elements after layer 1, 8e-3 by layer 4). So the tests check:

* op by op (teacher-forced): each rewrite, fed the reference graph's own inputs, agrees with the
  reference op it replaced (>= 100 dB: float32 summation order only);
* end to end: the lowered graph is as close to the reference as the reference is to itself with one
  ulp of noise on every linear's output, where the lowering's float32 differences enter (6 dB margin:
  a real mistake, e.g. a wrong scale layout, costs tens of dB);
* on a small model (one block), compiled FP8 agrees with the reference at >= 40 dB: already
  tests/test_compile_fp8.py (static and dynamic per token).
"""

import copy

import pytest
import torch

import quantkit
from quantkit import _hf
from quantkit._qmath import sqnr
from quantkit.lowering._fp8 import lower_fp8
from quantkit.quantizers import FP8Quantizer

_SCHEMES = {"static": {}, "dynamic-per-token": {"dynamic": True, "granularity": "per-token"}}
_OP_DB = 100  # measured 125-135 dB: float32 products and sums in another order
_NOISE_MARGIN_DB = 6


class _Record(torch.fx.Interpreter):
    """Runs a graph and keeps every node's tensor value by node name."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.values[n.name] = out
        return out


class _TeacherForced(torch.fx.Interpreter):
    """Runs the lowered graph, but every node the reference graph also has (same name) yields the
    reference's value: only the nodes a rewrite added compute, from the reference's inputs. Each
    time a kept node reads an added node, the pair (added value, the reference value it stands for)
    is recorded."""

    def __init__(self, lowered, ref_graph, ref_values):
        super().__init__(lowered)
        self.ref_nodes = {n.name: n for n in ref_graph.nodes}
        self.ref_values = ref_values
        self.pairs = []

    def run_node(self, n):
        ref = self.ref_nodes.get(n.name)
        if ref is not None and n.op == "call_function" and n.name in self.ref_values:
            for new_arg, ref_arg in zip(n.all_input_nodes, ref.all_input_nodes):
                if new_arg.name not in self.ref_nodes and ref_arg.name in self.ref_values:
                    self.pairs.append((ref_arg.name, self.ref_values[ref_arg.name], self.env[new_arg]))
            return self.ref_values[n.name]
        return super().run_node(n)


def _op_by_op(conv, lowered, args):
    rec = _Record(conv)
    with torch.no_grad():
        rec.run(*args)
        tf = _TeacherForced(lowered, conv.graph, rec.values)
        tf.run(*args)
    return [(name, sqnr(ref, new)) for name, ref, new in tf.pairs]


class _Perturbed(torch.fx.Interpreter):
    """The reference graph with ~1 ulp of float32 noise (fixed seed) on every linear's output: where
    the lowering's own float32 differences (another summation order) enter."""

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function" and n.target is torch.ops.aten.linear.default:
            gen = torch.Generator().manual_seed(len(n.name))
            out = out * (1 + 2.0 ** -24 * torch.randn(out.shape, generator=gen))
        return out


@pytest.fixture(scope="module")
def minilm():
    """The bundled MiniLM at 8 x 32 tokens (tests/test_minilm.py's loading; small, for time)."""
    model, tok = _hf.load_hf_model(_hf.default_model_path())
    sents = _hf.read_sentences(_hf.default_calibration_file())
    calib = _hf.tokenize(tok, sents[:8], seq_len=32, batch_size=8)
    held = _hf.tokenize(tok, sents[-8:], seq_len=32, batch_size=8)[0]
    return quantkit.capture(model, calib[0]), calib, [held[k] for k in held]


def _fp8(gm, calib, kwargs):
    prepared = quantkit.prepare(gm, FP8Quantizer(**kwargs))
    quantkit.calibrate(prepared, calib, progress=False)
    return quantkit.convert(prepared)


def _hidden(out):
    return out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", list(_SCHEMES))
def test_minilm_each_fp8_rewrite_agrees_with_its_reference_op(minilm, scheme):
    gm, calib, args = minilm
    conv = _fp8(gm, calib, _SCHEMES[scheme])
    lowered = copy.deepcopy(conv)
    assert lower_fp8(lowered) == {"fp8_linear": 37}  # 6 layers x 6 linears + the pooler
    pairs = _op_by_op(conv, lowered, args)
    # each of the 37 linears' outputs is read (and the decomposed float8 q/dq that feed no linear)
    assert len({name for name, _ in pairs if name.startswith("linear")}) == 37
    worst = min(pairs, key=lambda p: p[1])
    assert worst[1] >= _OP_DB, f"lowered {worst[0]} vs its reference op: {worst[1]:.1f} dB"


@pytest.mark.slow
def test_minilm_lowered_is_as_close_as_the_reference_to_itself(minilm):
    gm, calib, args = minilm
    conv = _fp8(gm, calib, _SCHEMES["static"])
    lowered = copy.deepcopy(conv)
    lower_fp8(lowered)
    with torch.no_grad():
        ref = _hidden(conv(*args))
        db = sqnr(ref, _hidden(lowered(*args)))
        floor = sqnr(ref, _hidden(_Perturbed(conv).run(*args)))
    assert db >= floor - _NOISE_MARGIN_DB, f"lowered {db:.1f} dB vs the reference's own 1-ulp floor {floor:.1f} dB"
