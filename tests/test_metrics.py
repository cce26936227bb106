"""Metrics: values against torch references, name resolution, the evaluation loop."""

import pytest
import torch

from quantkit import metrics
from quantkit.accuracy._metrics import Evaluator, primary_tensor


def negative_l1(float_output, quantized_output):
    """A user metric, resolved as 'tests.test_metrics:negative_l1'."""
    return -float((float_output - quantized_output).abs().mean())


def test_embedding_cosine_rows_and_tokens():
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    ref = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).mean()
    assert metrics.embedding_cosine(a, b) == pytest.approx(float(ref), abs=1e-12)
    assert metrics.embedding_cosine(a, a) == pytest.approx(1.0, abs=1e-12)
    h, g = torch.randn(2, 5, 16), torch.randn(2, 5, 16)  # (batch, tokens, dim): per token
    assert metrics.embedding_cosine(h, g) == pytest.approx(metrics.embedding_cosine(h.reshape(10, 16), g.reshape(10, 16)))


def test_logits_kl_matches_torch():
    p, q = torch.randn(6, 10), torch.randn(6, 10)
    ref = torch.nn.functional.kl_div(q.double().log_softmax(-1), p.double().log_softmax(-1),
                                     log_target=True, reduction="batchmean")
    assert metrics.logits_kl(p, q) == pytest.approx(-float(ref), abs=1e-12)
    assert metrics.logits_kl(p, p) == pytest.approx(0.0, abs=1e-12)


def test_top1_agreement():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0], [0.0, 3.0]])
    b = torch.tensor([[1.0, 0.0], [1.0, 0.0], [2.0, 1.0], [1.0, 0.0]])
    assert metrics.top1_agreement(a, b) == 0.5


def test_outputs_with_structure():
    t = torch.randn(2, 3)
    assert primary_tensor({"last_hidden_state": t, "pooler_output": t[:, 0]}) is t
    assert primary_tensor({"logits": t, "hidden": t + 1}) is t
    assert primary_tensor((t, t + 1)) is t
    with pytest.raises(TypeError, match="holds no tensor"):
        primary_tensor(3)
    with pytest.raises(ValueError, match="differ in shape"):
        metrics.embedding_cosine(t, t[:1])


def test_resolve_metric():
    assert metrics.resolve_metric("cosine") is metrics.embedding_cosine
    assert metrics.resolve_metric("embedding_cosine") is metrics.embedding_cosine
    assert metrics.resolve_metric("logits-kl") is metrics.logits_kl
    assert metrics.resolve_metric("TOP1") is metrics.top1_agreement
    assert metrics.resolve_metric("tests.test_metrics:negative_l1") is negative_l1
    assert metrics.resolve_metric(negative_l1) is negative_l1
    with pytest.raises(ValueError, match="unknown metric 'mse'"):
        metrics.resolve_metric("mse")
    with pytest.raises(ValueError, match="cannot import module"):
        metrics.resolve_metric("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        metrics.resolve_metric("tests.test_metrics:nope")
    with pytest.raises(TypeError, match="callable or a string"):
        metrics.resolve_metric(3)


def test_evaluator_averages_over_batches():
    model = torch.nn.Linear(4, 3).eval()
    half = torch.nn.Linear(4, 3).eval()
    half.load_state_dict({k: v / 2 for k, v in model.state_dict().items()})
    data = [torch.randn(5, 4), torch.randn(7, 4)]
    ev = Evaluator(model, iter(data), negative_l1)  # a one-shot iterator is kept as a list
    assert ev.reference == 0.0
    with torch.no_grad():
        expected = sum(negative_l1(model(b), half(b)) for b in data) / 2
    assert ev.score(half) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="finite"):
        Evaluator(model, data, lambda a, b: float("nan"))
    with pytest.raises(TypeError, match="must return a float"):
        Evaluator(model, data, lambda a, b: "good")
    with pytest.raises(ValueError, match="evaluation data is empty"):
        Evaluator(model, [], negative_l1)
