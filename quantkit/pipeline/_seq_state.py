"""On-disk state of a block-by-block quantization run: what survives an interruption.

The partial directory (``.NAME.quantkit-partial`` beside the output) holds, after block k:

- ``state.json``: the run's fingerprint (checkpoint files, recipe, calibration data) and k;
- ``block_<i>.safetensors`` for i <= k: the block's int8 weights (``q:<node>``) and the
  float tensors the quantized model keeps (``f:<attribute>``);
- ``observers_<i>.safetensors``: the buffers of the observers block i ran;
- ``acts/<k>/batch_<j>.safetensors`` (+ ``.json`` for sizes and None): the values block k
  handed on, one file per calibration batch.

Everything is safetensors or JSON: nothing here is ever unpickled. Each file is written
under a temporary name and renamed, and ``state.json`` last, so a run killed at any point
resumes from the last block whose files are all there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from .._errors import QuantkitError

__all__ = ["PartialDir", "ActivationCache", "STATE_VERSION", "digest_of", "fingerprint_tensors"]

STATE_VERSION = 1


def _atomic_save(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _atomic_text(text: str, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def fingerprint_tensors(digest, value) -> None:
    """Feed ``value`` (tensors, containers, scalars) into a hashlib digest."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            digest.update(str(k).encode())
            fingerprint_tensors(digest, value[k])
    elif isinstance(value, (list, tuple)):
        digest.update(f"[{len(value)}".encode())
        for v in value:
            fingerprint_tensors(digest, v)
    else:
        digest.update(repr(value).encode())


class PartialDir:
    """The partial directory of one output path."""

    def __init__(self, path: Path, fingerprint: dict, n_blocks: int) -> None:
        self.path = Path(path)
        self.fingerprint = json.loads(json.dumps(fingerprint, default=str))  # as state.json will hold it
        self.n_blocks = n_blocks

    @staticmethod
    def beside(out: Path) -> Path:
        out = Path(out).absolute()
        return out.parent / f".{out.name}.quantkit-partial"

    def open(self, resume: bool) -> int:
        """Prepare the directory; returns the last block already done (-1 for a fresh run).

        Without ``resume`` a previous partial run is discarded. With it, the run continues
        after its last completed block.

        Raises:
            QuantkitError: ``resume`` and the partial run was made from other weights, another
                recipe or other calibration data.
        """
        state_file = self.path / "state.json"
        if resume and state_file.is_file():
            try:
                state = json.loads(state_file.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                state = None
            if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
                raise QuantkitError(f"the partial run in {str(self.path)!r} is unreadable; run again without --resume")
            if state.get("fingerprint") != self.fingerprint or state.get("blocks") != self.n_blocks:
                raise QuantkitError(f"the partial run in {str(self.path)!r} was made from other weights, recipe or "
                                    "calibration data; run again without --resume to start over")
            return int(state.get("done", -1))
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        self._write_state(-1)
        return -1

    def _write_state(self, done: int) -> None:
        doc = {"version": STATE_VERSION, "fingerprint": self.fingerprint, "blocks": self.n_blocks, "done": done}
        _atomic_text(json.dumps(doc, indent=1) + "\n", self.path / "state.json")

    def block_file(self, b: int) -> Path:
        return self.path / f"block_{b:04d}.safetensors"

    def observers_file(self, b: int) -> Path:
        return self.path / f"observers_{b:04d}.safetensors"

    def commit_block(self, b: int, weights: dict, observers: dict[str, torch.nn.Module]) -> None:
        """Write block ``b``'s weights and observer buffers; call :meth:`mark_done` after its activations."""
        _atomic_save(weights, self.block_file(b))
        state = {f"{name}\x00{buf}": t.detach() for name, obs in observers.items()
                 for buf, t in obs.named_buffers() if isinstance(t, torch.Tensor)}
        _atomic_save(state, self.observers_file(b))

    def mark_done(self, b: int) -> None:
        self._write_state(b)

    def restore_observers(self, done: int, observers: dict[str, torch.nn.Module]) -> None:
        """Load the observer buffers saved by blocks 0..``done`` (a later block's copy wins)."""
        from safetensors.torch import load_file

        for b in range(done + 1):
            for key, t in load_file(str(self.observers_file(b))).items():
                name, buf = key.split("\x00", 1)
                obs = observers[name]
                *path, attr = buf.split(".")
                owner = obs.get_submodule(".".join(path)) if path else obs
                owner._buffers[attr] = t

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class ActivationCache:
    """Values handed from one block to the next, per calibration batch.

    Every block's outputs are written to ``acts/<block>/`` (so that a run can resume); they
    are also kept in memory while their total stays within ``budget`` bytes, and read back
    from disk (memory-mapped, one batch at a time) above it.
    """

    def __init__(self, root: Path, budget: int | None) -> None:
        self.root = Path(root) / "acts"
        self.budget = budget
        self.memory: dict[int, dict] | None = {}
        self.block = -1

    def _dir(self, block: int) -> Path:
        return self.root / f"{block:04d}"

    def start(self, block: int) -> None:
        """Begin collecting the outputs of ``block``."""
        d = self._dir(block)
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        self.next_memory: dict[int, dict] | None = {}
        self.next_bytes = 0

    def put(self, block: int, i: int, values: dict) -> None:
        tensors, aliases, seen = {}, {}, {}
        for k, v in values.items():
            if not isinstance(v, torch.Tensor):
                continue
            same = seen.get(v.untyped_storage().data_ptr())
            if same is not None and values[same] is v:  # one tensor under two names (observers pass it on)
                aliases[k] = same
                continue
            # safetensors stores each storage once: a view of a stored tensor is stored as a copy
            tensors[k] = v if same is None else v.clone()
            seen.setdefault(v.untyped_storage().data_ptr(), k)
        other = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
        for k, v in other.items():
            if not (v is None or isinstance(v, (int, float, bool))):
                raise QuantkitError(f"value {k!r} crossing a block boundary is a {type(v).__name__}; "
                                    "only tensors, numbers and None can be carried; quantize this model in memory")
        d = self._dir(block)
        _atomic_save(tensors, d / f"batch_{i:06d}.safetensors")
        _atomic_text(json.dumps({"values": other, "aliases": aliases}), d / f"batch_{i:06d}.json")
        if self.next_memory is not None:
            self.next_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            if self.budget is not None and self.next_bytes > self.budget:
                self.next_memory = None  # spilled: read back from disk
            else:
                self.next_memory[i] = values

    def finish(self, block: int) -> None:
        """``block``'s outputs become the inputs of the next block; older ones are deleted."""
        old = self.block
        self.block, self.memory = block, self.next_memory
        if old >= 0 and self._dir(old).exists():
            shutil.rmtree(self._dir(old))

    def resume(self, block: int) -> None:
        """Continue from the outputs ``block`` wrote in an earlier run (read from disk)."""
        self.block, self.memory = block, None

    def get(self, i: int) -> dict:
        if self.memory is not None:
            return self.memory[i]
        from safetensors.torch import load_file

        d = self._dir(self.block)
        values = dict(load_file(str(d / f"batch_{i:06d}.safetensors")))
        doc = json.loads((d / f"batch_{i:06d}.json").read_text(encoding="utf-8"))
        values.update(doc["values"])
        values.update({k: values[same] for k, same in doc["aliases"].items()})
        return values


def digest_of(*values) -> str:
    h = hashlib.sha256()
    for v in values:
        fingerprint_tensors(h, v)
    return h.hexdigest()

