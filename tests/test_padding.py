"""Padding-aware calibration: observers leave out the tokens an attention_mask marks as padding."""

import pytest
import torch

import quantkit
from quantkit.observers import HistogramObserver, MinMaxObserver, QuantkitObserver
from quantkit.observers._tokens import FLAT, real_tokens, token_mask
from quantkit.quantizers import QuantConfig, W8A8Quantizer
from tests.models import make_mlp

transformers = pytest.importorskip("transformers")


def _bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, pad_token_id=0)
    model = transformers.BertModel(cfg).eval()
    with torch.no_grad():  # a padding token whose activations stand out
        model.embeddings.word_embeddings.weight[0] = 0
        model.embeddings.word_embeddings.weight[0, 3] = 40.0
    return model


def _batches(n=3, b=4, s=16):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        lengths = torch.randint(3, s, (b,), generator=g)
        mask = (torch.arange(s)[None] < lengths[:, None]).long()
        ids = torch.randint(1, 50, (b, s), generator=g) * mask  # padding id 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _first_layer_input(model, batches, real_only):
    """Min and max of the query projection's input (the embeddings' LayerNorm output)."""
    seen = []
    layer = model.encoder.layer[0].attention.self.query
    hook = layer.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        for b in batches:
            model(**b)
    hook.remove()
    vals = torch.cat([x[b["attention_mask"].bool()] if real_only else x.reshape(-1, x.shape[-1])
                      for x, b in zip(seen, batches)])
    return float(vals.min()), float(vals.max())


def _observer_of_first_linear_input(prepared):
    modules = dict(prepared.named_modules(remove_duplicate=False))
    for node in prepared.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
            src = node.args[0]
            while src.op == "call_module" and isinstance(modules[str(src.target)], QuantkitObserver):
                return modules[str(src.target)]
    raise AssertionError("no observed linear")


@pytest.mark.parametrize("skip", [True, False], ids=["skip-padding", "keep-padding"])
def test_observer_sees_only_real_tokens(skip):
    model = _bert()
    batches = _batches()
    gm = quantkit.capture(model, batches[0])
    prepared = quantkit.prepare(gm, W8A8Quantizer(QuantConfig(act_observer="minmax")))
    quantkit.calibrate(prepared, batches, progress=False, skip_padding=skip)
    obs = _observer_of_first_linear_input(prepared)
    assert obs.padding_aware
    lo, hi = _first_layer_input(model, batches, real_only=skip)
    assert abs(float(obs.min_val) - lo) <= 1e-5 and abs(float(obs.max_val) - hi) <= 1e-5
    if skip:  # the padding token's spike is not in the range
        assert hi < _first_layer_input(model, batches, real_only=False)[1] - 1.0


def test_histogram_counts_only_real_tokens():
    model = _bert()
    batches = _batches()
    gm = quantkit.capture(model, batches[0])
    prepared = quantkit.prepare(gm, W8A8Quantizer(QuantConfig(act_observer="mse")))
    quantkit.calibrate(prepared, batches, progress=False)
    obs = _observer_of_first_linear_input(prepared)
    assert isinstance(obs, HistogramObserver)
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    assert float(obs.histogram.sum()) == pytest.approx(real * 32, rel=1e-9)  # hidden size 32


def test_which_observers_are_padding_aware():
    model = _bert()
    batches = _batches()
    prepared = quantkit.prepare(quantkit.capture(model, batches[0]), W8A8Quantizer(QuantConfig()))
    modules = dict(prepared.named_modules(remove_duplicate=False))
    aware, weights = [], []
    for node in prepared.graph.nodes:
        if node.op == "call_module" and isinstance(modules[str(node.target)], QuantkitObserver):
            obs = modules[str(node.target)]
            if node.args[0].op == "get_attr":
                weights.append(obs.padding_aware)
            else:
                aware.append((tuple(node.meta["val"].shape)[1:], obs.padding_aware))
    assert weights and not any(weights)
    # activations [B, S, H], attention's [B, heads, S, d] / [B, heads, d, S]: aware;
    # the pooler's [B, H] (no token dimension): not
    assert all(ok for shape, ok in aware if len(shape) >= 2), aware
    assert not any(ok for shape, ok in aware if len(shape) == 1), aware
    # a graph without an attention_mask input: no observer is padding aware
    model, x = make_mlp()
    plain = quantkit.prepare(quantkit.capture(model, x), W8A8Quantizer(QuantConfig()))
    assert not any(getattr(m, "padding_aware", False) for m in plain.modules())


@pytest.mark.parametrize("shape,dim", [((2, 5, 7), 1), ((2, 3, 5, 4), 2), ((2, 3, 4, 5), 3), ((2, 5, 3, 4), 1),
                                       ((10, 7), FLAT)])
def test_real_tokens_finds_the_token_dimension(shape, dim):
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    x = torch.randn(shape)
    with token_mask(mask):
        got = real_tokens(x)
    want = x[mask.reshape(-1)] if dim == FLAT else x.movedim(dim, 1)[mask]
    assert torch.equal(got, want) and got.shape[0] == 4
    assert real_tokens(x) is x  # no mask active: unchanged
    with token_mask(mask):
        other = torch.randn(3, 5, 7)  # batch size differs: not a [batch, tokens] tensor
        assert real_tokens(other) is other


def test_gpt2_flattened_rows_skip_padding():
    # GPT-2's Conv1D flattens [B, S, H] to [B*S, H] rows before addmm: still padding aware
    torch.manual_seed(0)
    model = transformers.GPT2Model(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=50)).eval()
    batches = _batches()
    seen = []
    hook = model.h[0].attn.c_attn.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        for b in batches:
            model(**b)
    hook.remove()
    real = torch.cat([x[b["attention_mask"].bool()] for x, b in zip(seen, batches)])
    prepared = quantkit.prepare(quantkit.capture(model, batches[0]), W8A8Quantizer(QuantConfig()))
    quantkit.calibrate(prepared, batches, progress=False)
    modules = dict(prepared.named_modules(remove_duplicate=False))
    addmm = next(n for n in prepared.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.addmm.default)
    obs = modules[str(addmm.args[1].target)]
    assert obs.padding_aware and len(addmm.args[1].meta["val"].shape) == 2
    assert abs(float(obs.min_val) - float(real.min())) <= 1e-5 and abs(float(obs.max_val) - float(real.max())) <= 1e-5


def test_unaware_observer_and_all_padding():
    obs = MinMaxObserver()
    mask = torch.zeros(2, 4, dtype=torch.bool)
    x = torch.randn(2, 4, 3)
    with token_mask(mask):
        obs(x)  # not marked: sees everything
    assert float(obs.max_val) == float(x.max())
    aware = MinMaxObserver()
    aware.token_axes = (((None, None, None), 1),)  # as prepare records it: [batch, tokens, ...]
    with token_mask(mask):
        aware(x)  # every token is padding: nothing observed
    assert not aware.calibrated


def test_smoothquant_statistics_skip_padding():
    # SmoothQuant's per-channel activation maxima come from real tokens only: the padding
    # token's spike (channel 3 of the embeddings) does not reach the first layer's scale
    from quantkit.accuracy._smoothquant import _collect, _groups

    model = _bert()
    batches = _batches()
    gm = quantkit.capture(model, batches[0])
    groups = _groups(gm)
    stats = _collect(gm, groups, batches, keep_rows=64)
    first = min(range(len(groups)), key=lambda i: list(gm.graph.nodes).index(groups[i].source))
    lo, hi = _first_layer_input(model, batches, real_only=True)
    assert abs(float(stats[first].max.max()) - hi) <= 1e-5 and abs(float(stats[first].min.min()) - lo) <= 1e-5
    assert all(r.shape[1] == 32 for r in stats[first].rows)
