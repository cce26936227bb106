"""quantkit.capture: input forms, dynamic batch, clear errors."""

import pytest
import torch

import quantkit
from tests.models import make_mlp


class KwargModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, input_ids, attention_mask=None):
        y = self.lin(input_ids)
        return y * attention_mask.unsqueeze(-1) if attention_mask is not None else y


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # Python branch on a tensor value: not exportable
            return x * 2
        return x


def test_tuple_inputs_and_dynamic_batch():
    model, x = make_mlp()
    gm = quantkit.capture(model, (x[:8],))
    assert isinstance(gm, torch.fx.GraphModule)
    for n in (1, 3, 64):
        torch.testing.assert_close(gm(x[:n]), model(x[:n]), atol=1e-5, rtol=0)


def test_single_tensor_with_batch_one_stays_dynamic():
    model, x = make_mlp()
    gm = quantkit.capture(model, x[:1])
    torch.testing.assert_close(gm(x[:5]), model(x[:5]), atol=1e-5, rtol=0)


def test_dict_inputs_as_kwargs():
    model = KwargModel()
    ex = {"input_ids": torch.randn(2, 5, 8), "attention_mask": torch.ones(2, 5)}
    gm = quantkit.capture(model, ex)
    x = {"input_ids": torch.randn(7, 5, 8), "attention_mask": torch.randint(0, 2, (7, 5)).float()}
    torch.testing.assert_close(gm(**x), model(**x), atol=1e-6, rtol=0)


def test_explicit_dynamic_shapes_override():
    model, x = make_mlp()
    gm = quantkit.capture(model, (x[:8],), dynamic_shapes=({0: None},))
    gm(x[:8])
    with pytest.raises(Exception):
        gm(x[:4])  # batch was pinned to 8


def test_capture_puts_model_in_eval_mode():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    model.train()
    gm = quantkit.capture(model, (torch.randn(3, 4),))
    assert not model.training
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), model(x))


def test_unexportable_model_raises_capture_error():
    with pytest.raises(quantkit.CaptureError) as info:
        quantkit.capture(DataDependent(), (torch.randn(2, 3),))
    msg = str(info.value)
    assert "DataDependent" in msg and "Hint:" in msg
    assert len(msg.splitlines()) <= 2


def test_bad_arguments():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        quantkit.capture(lambda x: x, (torch.randn(2),))
    with pytest.raises(TypeError, match="a batch must be"):
        quantkit.capture(torch.nn.Identity(), 3.0)


def test_causal_lm_is_captured_without_its_kv_cache():
    """HF causal LMs return a DynamicCache by default, which torch.export cannot output:
    capture traces them with config.use_cache off and restores the config."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=100)
    model = transformers.LlamaForCausalLM(cfg).eval()
    assert model.config.use_cache is True
    ids = torch.randint(0, 100, (2, 7))
    gm = quantkit.capture(model, {"input_ids": ids})
    assert model.config.use_cache is True
    other = torch.randint(0, 100, (3, 7))  # another batch size
    with torch.no_grad():
        assert torch.allclose(gm(input_ids=other).logits, model(input_ids=other).logits, atol=1e-5)
