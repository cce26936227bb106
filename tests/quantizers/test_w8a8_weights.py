"""W8A8Quantizer on weights stored [K, N]: addmm (HF Conv1D, GPT-2) and mm/matmul by a parameter."""

import collections

import pytest
import torch

import quantkit
from quantkit._qmath import sqnr
from quantkit.quantizers import QuantConfig, W8A8Quantizer

Q = torch.ops.quantized_decomposed


class KNLinear(torch.nn.Module):
    """Two layers whose weights are [K, N]: addmm (as HF's Conv1D) and a plain x @ W."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(16, 32) * 0.2)
        self.b1 = torch.nn.Parameter(torch.randn(32) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(32, 8) * 0.2)

    def forward(self, x):
        h = torch.addmm(self.b1, x, self.w1).relu()
        return h @ self.w2


def _counts(gm):
    return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("cfg", [QuantConfig(), QuantConfig(dynamic=True, granularity="per-token")],
                         ids=["static", "per-token"])
def test_kn_weights_are_int8_per_output_channel(cfg):
    torch.manual_seed(0)
    m, x = KNLinear().eval(), torch.randn(64, 16)
    qm = quantkit.quantize(m, (x[:8],), [(b,) for b in x.split(16)], W8A8Quantizer(cfg), progress=False)
    dq_w = [n for n in qm.graph.nodes if n.target == Q.dequantize_per_channel.default]
    assert len(dq_w) == 2 and [n.args[3] for n in dq_w] == [1, 1]  # axis 1 = N, the output channel
    scales = sorted((getattr(qm, n.args[1].target).numel() for n in dq_w))
    assert scales == [8, 32]
    assert not any(p.is_floating_point() and p.dim() == 2 for p in qm.parameters())
    with torch.no_grad():
        assert sqnr(m(x), qm(x)) > 35


def test_gpt2_conv1d_layers_are_quantized():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=200)).eval()
    ids = torch.randint(0, 200, (4, 10))
    qm = quantkit.quantize(model, {"input_ids": ids}, [{"input_ids": ids}], W8A8Quantizer(), progress=False)
    counts = _counts(qm)
    # c_attn, c_proj (attention), c_fc, c_proj (MLP) are addmm; lm_head is a linear
    assert counts[torch.ops.aten.addmm.default] == 4
    assert counts[Q.dequantize_per_channel.default] == 5
    with torch.no_grad():
        assert sqnr(model(input_ids=ids).logits, qm(input_ids=ids).logits) > 30
