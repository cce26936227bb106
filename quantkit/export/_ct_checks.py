"""Checks of a written compressed-tensors checkpoint that do not go through the loaded model's
compressed tensors: the files read back, and the two places where transformers 5.24 with
compressed-tensors 0.20 does not hold what the checkpoint stores.

- Asymmetric ``pack-quantized`` weights: the checkpoint stores zero points packed into int32
  along the output channels (what compressed-tensors' own compressor writes and vLLM reads),
  but transformers' default (compressed) load path builds the module on the meta device with
  the zero points unpacked and refuses the sizes (llm-compressor#1618). Such exports are loaded
  with ``CompressedTensorsConfig(dequantize=True)``: transformers runs compressed-tensors'
  decompressor on every weight, and each dense weight must equal quantkit's dequantized one.
- KV-cache scales: compressed-tensors 0.20 hooks attention modules whose ``forward`` takes
  ``past_key_values``; transformers 5's Llama takes ``cache``, so the ``k_scale``/``v_scale``
  load into nothing and the cache stays float there (vLLM reads them). They are checked in the
  files, and the model-level comparison is then made without quantkit's K/V quantization.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .._errors import QuantkitError
from ._ct_schemes import GroupWeight, is_float8, layer_tensors

__all__ = ["dense_load", "kv_applied", "check_files", "check_dense", "stored_on_modules", "same"]


def dense_load(plan) -> bool:
    """Whether the export must be verified through transformers' dequantizing load path."""
    return any(isinstance(layer.weight, GroupWeight) and not layer.weight.symmetric for layer in plan.linears.values())


def kv_applied(model, plan) -> bool:
    """Whether the loaded model holds the KV-cache scales on its attention modules."""
    return bool(plan.kv) and all(isinstance(getattr(model.get_submodule(m), "k_scale", None), torch.Tensor)
                                 for m in plan.kv)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if is_float8(a.dtype) else torch.equal(a, b)


def check_files(directory: Path, plan) -> int:
    """Every quantized tensor the export wrote (weights, scales, zero points, KV scales), read
    back from its safetensors: quantkit's, bit for bit. Returns how many were compared."""
    from safetensors import safe_open

    want = {f"{m}.{k}": t for m, layer in plan.linears.items() for k, t in layer_tensors(layer).items()}
    want.update({f"{m}.{k}": t for m, kv in plan.kv.items() for k, t in kv.stored().items()})
    found = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            found.update({k: st.get_tensor(k) for k in st.keys() if k in want})
    for key, expected in want.items():
        got = found.get(key)
        if got is None or not _same(got, expected):
            raise QuantkitError(f"the export's {key} as written is not quantkit's tensor; nothing was written, "
                                "please report it")
    return len(want)


def check_dense(model, plan) -> None:
    """After a dequantizing load: each quantized linear's dense weight is quantkit's dequantized weight."""
    for name, layer in plan.linears.items():
        w = model.get_submodule(name).weight
        if not torch.equal(w, layer.weight.dequantized(w.dtype).to(w.device)):
            raise QuantkitError(f"transformers dequantized {name}.weight of the export differently from quantkit; "
                                "nothing was written, please report it")


def stored_on_modules(plan, with_kv: bool) -> list:
    """``(module, {attr: tensor})`` the compressed load path must hold, bit for bit."""
    out = [(name, layer_tensors(layer)) for name, layer in plan.linears.items()]
    return out + ([(name, kv.stored()) for name, kv in plan.kv.items()] if with_kv else [])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (float8 compared as bytes)."""
    return _same(a, b)
