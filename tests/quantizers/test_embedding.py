"""EmbeddingQuantizer: weight-only int8 embedding tables, one scale per row."""

from __future__ import annotations

import pytest
import torch
from torchao.quantization.pt2e.quantizer import ComposableQuantizer

import quantkit
from quantkit.quantizers import EmbeddingQuantizer, W8A8Quantizer

_OPS = torch.ops.quantized_decomposed


class _Tagger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(1000, 64)
        self.pos = torch.nn.Embedding(16, 64)
        self.head = torch.nn.Linear(64, 8)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        return self.head(self.tok(ids) + self.pos(pos))


def _count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def _sqnr(ref, approx) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum()))


@pytest.mark.parametrize("skip, int8_tables", [(None, 2), ("pos", 1)])
def test_embedding_tables_become_int8(skip, int8_tables):
    torch.manual_seed(0)
    model = _Tagger().eval()
    ids = torch.randint(0, 1000, (32, 16))
    emb = EmbeddingQuantizer()
    if skip:
        emb.set_module_name(skip, None)
    gm = quantkit.prepare(quantkit.capture(model, (ids[:8],)), ComposableQuantizer([emb, W8A8Quantizer()]))
    quantkit.calibrate(gm, [(b,) for b in ids.split(8)], progress=False)
    q = quantkit.convert(gm)
    # embedding tables: per-row dequantize of an int8 buffer; the linear weight too
    assert _count(q, _OPS.dequantize_per_channel.default) == int8_tables + 1
    int8 = {tuple(b.shape) for b in q.buffers() if b.dtype == torch.int8}
    assert ((1000, 64) in int8) and (((16, 64) in int8) == (skip is None))
    tok = next(r for r in q.meta["quantkit_qparams"] if r["node"].startswith("tok_weight"))
    assert tok["qscheme"] == "per_channel_symmetric" and len(tok["scale"]) == 1000
    with torch.no_grad():
        w_q = next(b for b in q.buffers() if b.dtype == torch.int8 and b.shape == (1000, 64))
        deq = w_q.float() * torch.tensor(tok["scale"])[:, None]  # symmetric: zero point 0
        sqnr = _sqnr(model.tok.weight, deq)
        assert sqnr > 35, f"per-row int8 embedding SQNR {sqnr:.1f} dB"
        e2e = _sqnr(model(ids), q(ids))
        assert e2e > 30, f"end-to-end SQNR {e2e:.1f} dB"


def test_embedding_quantizer_validates():
    with pytest.raises(ValueError, match="per-channel observer"):
        EmbeddingQuantizer("minmax")
    with pytest.raises(ValueError, match="unknown observer"):
        EmbeddingQuantizer("nope")
    with pytest.raises(ValueError, match="only accepts None"):
        EmbeddingQuantizer().set_module_name("tok", object())
