"""Helpers shared by the compressed-tensors export tests (test_compressed_tensors.py and
test_compressed_tensors_schemes.py): a tiny random Llama checkpoint with its calibration batches,
and per-token cosines over the real (unpadded) tokens."""

from __future__ import annotations

import torch

__all__ = ["tiny_llama", "token_cosines", "AS_BEFORE", "FLOAT32"]

# the export as these tests were written for: float32 tensors and every scheme transformers runs (not
# only those vLLM's CPU build runs); with AS_BEFORE also lm_head quantized (named in the targets)
FLOAT32 = dict(float_dtype="float32", engine="transformers")
AS_BEFORE = dict(quantize_lm_head=True, float_dtype="float32", engine="transformers")


def token_cosines(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cosine (in float64) between ``a`` and ``b`` at every position where ``mask`` is set."""
    real = mask.bool()
    return torch.nn.functional.cosine_similarity(a[real].double(), b[real].double(), dim=-1)


def tiny_llama(tmp_path_factory, *, hidden_size: int, n_batches: int, seed: int = 0, data_seed: int = 0):
    """A random 2-layer ``LlamaForCausalLM`` (4 heads, 2 KV heads, MLP width ``2 * hidden_size``,
    vocabulary 100, tied embeddings; weights from ``torch.manual_seed(seed)``) saved to a fresh
    temporary folder, and ``n_batches`` batches of 4 x 12 random tokens (from a generator seeded
    with ``data_seed``), the last one padded after 9 tokens. Returns ``(model, path, batches)``."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=2 * hidden_size, vocab_size=100,
                                   tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("llama") / "llama"
    model.save_pretrained(str(path))
    gen = torch.Generator().manual_seed(data_seed)
    batches = [{"input_ids": torch.randint(0, 100, (4, 12), generator=gen),
                "attention_mask": torch.ones(4, 12, dtype=torch.long)} for _ in range(n_batches)]
    batches[-1]["attention_mask"][:, 9:] = 0  # padded tail
    return model, path, batches
