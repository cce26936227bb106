"""The CLI's data: calibration and evaluation samples, where each comes from, splits, batches.

Samples are read from a text file (one per line) or a directory of tensor files, each
sample named by its origin (``x.pt[3]``, ``line 5 of f.txt``) so that every error about
data (NaN, shapes, token ids) can say which sample it is.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import _hf
from .._errors import QuantkitError

__all__ = [
    "DataSpec", "Split", "TENSOR_SUFFIXES", "read_samples", "nonfinite", "fingerprint", "split_samples",
    "make_batches", "static_shapes", "pad_id_of", "to_device", "nonfinite_split", "device_batches",
]

TENSOR_SUFFIXES = (".pt", ".pth", ".npy", ".safetensors")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class DataSpec:
    """Calibration or evaluation data: a text file, a directory of tensors, or the bundled sentences."""

    kind: str  # "default" | "text" | "tensors"
    path: str | None = None

    @staticmethod
    def from_arg(path: str | None) -> "DataSpec":
        if path is None:
            return DataSpec("default")
        p = Path(path)
        if not p.exists():
            raise QuantkitError(f"calibration data {path!r} does not exist; pass a text file or a directory of tensors")
        return DataSpec("tensors" if p.is_dir() else "text", str(p.absolute()))

    @staticmethod
    def from_json(doc: dict) -> "DataSpec":
        return DataSpec(doc.get("kind", "default"), doc.get("path"))

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def file(self) -> Path:
        return _hf.default_calibration_file() if self.kind == "default" else Path(self.path)


def _tensor_files(directory: Path) -> list[Path]:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in TENSOR_SUFFIXES)
    if not files:
        raise QuantkitError(f"calibration directory {str(directory)!r} has no {'/'.join(TENSOR_SUFFIXES)} files")
    return files


def _read_tensor_file(path: Path):
    try:
        if path.suffix == ".npy":
            import numpy as np

            return torch.from_numpy(np.load(str(path), allow_pickle=False))
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            _hf.check_safetensors(path)
            return load_file(str(path))
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except QuantkitError:
        raise
    except Exception as exc:
        raise QuantkitError(f"could not read calibration tensor file {str(path)!r} ({type(exc).__name__})") from None


def _as_batch(obj, path: Path):
    """A file's content as (args tuple) or {kwargs}: the batch dimension is dim 0 of each tensor."""
    if isinstance(obj, torch.Tensor):
        return (obj,)
    if isinstance(obj, (tuple, list)) and obj and all(isinstance(t, torch.Tensor) for t in obj):
        return tuple(obj)
    if isinstance(obj, dict) and obj and all(isinstance(t, torch.Tensor) for t in obj.values()):
        return dict(obj)
    raise QuantkitError(f"{str(path)!r} must hold a tensor, a tuple of tensors or a dict of tensors")


def _samples_of(batch, path: Path, ndims: list[int] | None) -> list:
    """Split a file's tensors into samples along dim 0. A file one dim short of the model's
    inputs (``ndims``) is one sample; without ``ndims`` (HF models), so are 1-D integer
    tensors: the token ids of one sequence (HF models take ``[batch, tokens]``)."""
    tensors = list(batch.values()) if isinstance(batch, dict) else list(batch)
    if ndims is None and tensors and all(t.dim() == 1 and not t.is_floating_point() for t in tensors):
        ndims = [2] * len(tensors)
    if ndims is not None and len(ndims) == len(tensors) and all(t.dim() == n - 1 for t, n in zip(tensors, ndims)):
        batch = {k: v.unsqueeze(0) for k, v in batch.items()} if isinstance(batch, dict) else tuple(t.unsqueeze(0) for t in batch)
        tensors = [t.unsqueeze(0) for t in tensors]
    if any(t.dim() == 0 for t in tensors) or len({t.shape[0] for t in tensors}) != 1:
        raise QuantkitError(f"tensors in {str(path)!r} need one shared batch dimension (dim 0)")
    n = tensors[0].shape[0]
    if isinstance(batch, dict):
        return [{k: v[i] for k, v in batch.items()} for i in range(n)]
    return [tuple(t[i] for t in batch) for i in range(n)]


def read_samples(data: DataSpec, *, example_ndims: list[int] | None = None) -> tuple[list, list[str]]:
    """All samples of a data source, and where each comes from.

    Returns:
        ``(samples, origins)``: strings for text, per-sample tuples/dicts of tensors for
        tensor directories; ``origins[i]`` names sample ``i`` (``"x.pt[3]"``, ``"line 5 of f.txt"``).

    Raises:
        QuantkitError: missing, empty or blank-only text; a directory without tensors.
    """
    if data.kind != "tensors":
        path = data.file
        sentences = _hf.read_sentences(path)
        lines = [i + 1 for i, ln in enumerate(path.read_text(encoding="utf-8").splitlines()) if ln.strip()]
        if len(lines) != len(sentences):  # line breaks splitlines sees but the file's reader may not
            lines = list(range(1, len(sentences) + 1))
        return sentences, [f"line {n} of {path.name}" for n in lines]
    samples, origins = [], []
    for f in _tensor_files(Path(data.path)):
        got = _samples_of(_as_batch(_read_tensor_file(f), f), f, example_ndims)
        samples.extend(got)
        origins.extend(f"{f.name}[{i}]" for i in range(len(got)))
    if not samples:
        raise QuantkitError(f"calibration directory {data.path!r} holds no samples (every tensor has batch size 0)")
    return samples, origins


def _tensors(sample) -> list[torch.Tensor]:
    if isinstance(sample, dict):
        return list(sample.values())
    return list(sample) if isinstance(sample, (tuple, list)) else []


def nonfinite(samples: list) -> list[int]:
    """Positions of the samples holding a NaN or an infinity (text samples never do)."""
    return [i for i, s in enumerate(samples)
            if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in _tensors(s))]


def fingerprint(data: DataSpec) -> str:
    """sha256 of the data's files, to notice when eval's data is not what quantize split."""
    h = hashlib.sha256()
    files = _tensor_files(Path(data.path)) if data.kind == "tensors" else [data.file]
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class Split:
    """Indices of the calibration and held-out samples (held out samples are never calibrated on)."""

    calib: list[int] = field(default_factory=list)
    heldout: list[int] = field(default_factory=list)


# 20% held out, at most 256 samples: enough for a stable mean cosine, cheap to evaluate
HELDOUT_FRACTION = 0.2
MAX_HELDOUT = 256


def split_samples(n: int, *, num_calib: int | None, seed: int = 0) -> Split:
    """A seeded shuffle of ``range(n)``: the first part held out, the rest (up to ``num_calib``) calibrates."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    if n < 2:
        return Split(calib=order, heldout=order)  # nothing to hold out: evaluate on the calibration sample
    k = max(1, min(MAX_HELDOUT, int(round(n * HELDOUT_FRACTION))))
    heldout, calib = sorted(order[:k]), order[k:]
    if num_calib is not None:
        calib = calib[:num_calib]
    return Split(calib=sorted(calib), heldout=heldout)


def _stack(samples: list, origins: list[str], what: str, pad_id: int | None):
    """One batch from samples of equal structure. Token-id samples (an HF model's
    ``input_ids`` with ``attention_mask``) of different lengths are right-padded, the
    padding masked; other tensors must agree in shape."""
    first, o0 = samples[0], origins[0]
    keys = list(first) if isinstance(first, dict) else None
    for s, o in zip(samples, origins):
        if (keys is None) != (not isinstance(s, dict)) or (keys is not None and list(s) != keys) \
                or (keys is None and len(s) != len(first)):
            raise QuantkitError(f"{what} sample {o} holds different inputs from sample {o0} "
                                f"({_structure(s)} vs {_structure(first)}); give every sample the same inputs")
    names = keys if keys is not None else list(range(len(first)))
    pad = pad_id is not None and keys is not None and "input_ids" in keys and "attention_mask" in keys \
        and all(first[k].dim() == 1 for k in keys)
    out = {}
    for k in names:
        col = [s[k] for s in samples]
        if pad and len({t.shape[0] for t in col}) > 1:
            n = max(t.shape[0] for t in col)
            value = pad_id if k == "input_ids" else 0
            col = [torch.nn.functional.pad(t, (0, n - t.shape[0]), value=value) for t in col]
        for t, o in zip(col, origins):
            if t.shape != col[0].shape or t.dtype != col[0].dtype:
                raise QuantkitError(
                    f"{what} sample {o} has {_desc(t)} for input {k!r} but sample {o0} has {_desc(col[0])}; "
                    "samples batched together need equal shapes: make them equal or pass --batch-size 1")
        out[k] = torch.stack(col)
    return out if keys is not None else tuple(out[i] for i in names)


def _desc(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}:{_dtype_name(t.dtype)}"


def _structure(sample) -> str:
    if isinstance(sample, dict):
        return "keys " + ", ".join(map(str, sample))
    return f"{len(sample)} tensors"


def _check_sample(sample, origin: str, example, what: str) -> None:
    """Compare a tensor sample with the factory's example input (without the batch dim)."""
    tensors = _tensors(sample)
    if len(tensors) != len(example):
        raise QuantkitError(f"{what} sample {origin} has {len(tensors)} tensors, --example-input has {len(example)}")
    for t, e in zip(tensors, example):
        if tuple(t.shape) != tuple(e.shape[1:]) or t.dtype != e.dtype:
            raise QuantkitError(
                f"{what} sample {origin} of shape {tuple(t.shape)}:{_dtype_name(t.dtype)} does not match --example-input "
                f"{'x'.join(map(str, e.shape))}:{_dtype_name(e.dtype)} (dims after the batch dim must agree)"
            )


def _pad_id(loaded) -> int:
    for src in (loaded.tokenizer, getattr(loaded.model, "config", None)):
        v = getattr(src, "pad_token_id", None)
        if isinstance(v, int):
            return v
    return 0


def make_batches(samples: list, loaded, *, seq_len: int, batch_size: int, what: str,
                 origins: list[str] | None = None) -> list:
    """Batches the model can take: tokenized (dynamic padding) for text, stacked tensors otherwise.

    Raises:
        QuantkitError: text for a model without a tokenizer, or tensor samples that cannot be
            batched (the message names the sample, from ``origins``).
    """
    if not samples:
        return []
    origins = origins if origins is not None else [f"#{i}" for i in range(len(samples))]
    if isinstance(samples[0], str):
        if loaded.tokenizer is None:
            raise QuantkitError(f"{what} data is text but the model has no tokenizer; "
                                "pass a directory of .pt/.npy/.safetensors tensors")
        batches = _hf.tokenize(loaded.tokenizer, samples, seq_len=seq_len, batch_size=batch_size, padding="longest")
        return [_hf.accepted_inputs(loaded.model, b) for b in batches]
    pad_id = None
    if loaded.example is not None:
        for s, o in zip(samples, origins):
            _check_sample(s, o, loaded.example, what)
    else:
        pad_id = _pad_id(loaded)
        samples = [_as_hf_inputs(s, o, what, loaded.model) for s, o in zip(samples, origins)]
    return [_stack(samples[i:i + batch_size], origins[i:i + batch_size], what, pad_id)
            for i in range(0, len(samples), batch_size)]


def static_shapes(batches: list, *, pad_id: int = 0) -> list:
    """The same batches with one shape, so a compiled model compiles once: token batches
    (dicts with a ``[batch, tokens]`` ``attention_mask``) right-padded to the longest, the
    padding masked; a short last batch filled up with copies of its first sample (the
    caller ignores rows past its real samples)."""
    if not batches:
        return batches
    size = _rows_of(batches[0])
    longest = max((b["attention_mask"].shape[1] for b in batches if _is_tokens(b)), default=None)
    out = []
    for b in batches:
        if longest is not None and _is_tokens(b):
            n = b["attention_mask"].shape[1]
            b = {k: torch.nn.functional.pad(v, (0, longest - n), value=pad_id if k == "input_ids" else 0)
                 if v.dim() == 2 and v.shape[1] == n else v for k, v in b.items()}
        short = size - _rows_of(b)
        if short > 0:
            fill = lambda t: torch.cat([t, t[:1].expand(short, *t.shape[1:])])  # noqa: E731
            b = {k: fill(v) for k, v in b.items()} if isinstance(b, dict) else tuple(fill(t) for t in b)
        out.append(b)
    return out


def _is_tokens(batch) -> bool:
    return isinstance(batch, dict) and "attention_mask" in batch and batch["attention_mask"].dim() == 2


def _rows_of(batch) -> int:
    return int(next(iter(batch.values())).shape[0] if isinstance(batch, dict) else batch[0].shape[0])


def pad_id_of(loaded) -> int:
    """The token id padding uses: the tokenizer's, else the model config's, else 0."""
    return _pad_id(loaded)


def _check_token_ids(ids, origin: str, what: str, model) -> None:
    """Token ids outside the vocabulary would fail deep inside the embedding lookup."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    n = getattr(emb, "num_embeddings", None)
    if ids is None or ids.numel() == 0 or not isinstance(n, int):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= n:
        raise QuantkitError(f"{what} sample {origin} has token id {hi if hi >= n else lo}, outside the model's "
                            f"vocabulary of {n} (0..{n - 1}); tokenize with this model's tokenizer")


def _as_hf_inputs(sample, origin: str, what: str, model):
    """An HF model's keyword inputs: a bare tensor of token ids gets an all-ones attention mask.
    Token ids must be integers (a float tensor for a text model is a mistake, found here)."""
    if isinstance(sample, tuple):
        first = sample[0]
        if getattr(model, "main_input_name", None) == "input_ids" and first.is_floating_point():
            raise QuantkitError(f"{what} sample {origin} is a {_dtype_name(first.dtype)} tensor, but this text model "
                                "takes token ids: save integer (int64) input_ids, or a dict of named inputs")
        if len(sample) == 1 and not first.is_floating_point():
            _check_token_ids(first, origin, what, model)
            return {"input_ids": first, "attention_mask": torch.ones_like(first)}
        return sample  # positional inputs, as saved
    ids = sample.get("input_ids")
    if ids is not None and ids.is_floating_point():
        raise QuantkitError(f"{what} sample {origin} has {_dtype_name(ids.dtype)} input_ids; token ids are "
                            "integers: save them as int64")
    _check_token_ids(ids, origin, what, model)
    if ids is not None and "attention_mask" not in sample:
        sample = {**sample, "attention_mask": torch.ones_like(ids)}
    return sample


def to_device(batch, device: torch.device):
    """A batch (tensor, tuple or dict of tensors) on ``device``."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(t.to(device) for t in batch)
    return batch.to(device)


def nonfinite_split(samples, origins, split: Split, skip: bool, what: str) -> tuple[Split, list[str]]:
    """Leave samples holding NaN/inf out of the split (``skip``), or fail naming the first."""
    bad = nonfinite(samples)
    if bad and not skip:
        raise QuantkitError(f"{what} sample {origins[bad[0]]} holds NaN or inf ({len(bad)} of {len(samples)} "
                            "samples do); fix the data, or pass --skip-nonfinite to leave such samples out")
    drop = set(bad)
    kept = Split(calib=[i for i in split.calib if i not in drop],
                 heldout=[i for i in split.heldout if i not in drop])
    if bad and not kept.calib:
        raise QuantkitError(f"every calibration sample holds NaN or inf ({len(bad)} of {len(samples)}); "
                            "nothing is left to calibrate on: fix the data")
    if bad and not kept.heldout:  # evaluate on what calibrates rather than on nothing
        kept = Split(calib=kept.calib, heldout=kept.calib)
    return kept, [origins[i] for i in bad]


def device_batches(samples, origins, indices, loaded, *, what, seq_len, batch_size, device):
    """The samples at ``indices`` as batches on ``device``, with each batch's sample origins."""
    picked = [samples[i] for i in indices]
    where = [origins[i] for i in indices]
    batches = make_batches(picked, loaded, what=what, seq_len=seq_len, batch_size=batch_size, origins=where)
    return [to_device(b, device) for b in batches], [where[i:i + batch_size] for i in range(0, len(where), batch_size)]
