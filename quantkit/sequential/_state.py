"""On-disk state of a block-by-block quantization run: what survives an interruption.

The progress directory (``.NAME.quantkit-partial`` beside the output) holds, after block k:

- ``quantkit-partial.json``: the marker that makes it ours (kind and run id, written when it is
  created); a directory at that path without our marker is never reused or removed;
- ``state.json``: the run's fingerprint (model files, recipe, calibration data, versions), k,
  and the SHA-256 of every file below, with a digest of the record itself;
- ``block_<i>.safetensors`` for i <= k: the block's int8 weights (``q:<node>``) and the
  float tensors the quantized model keeps (``f:<attribute>``);
- ``observers_<i>.safetensors``: the buffers of the observers block i ran;
- ``acts/<k>/batch_<j>.safetensors`` (+ ``.json`` for sizes and None): the values block k
  handed on, one file per calibration batch.

Everything is safetensors or JSON: nothing here is ever unpickled. Each file is written under
a fresh temporary name opened with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a planted file or link is
never written through) inside the directory's resolved path, its SHA-256 computed as it is
written, then renamed; ``state.json`` comes last, so a run killed at any point resumes from the
last block whose files are all there. On resume every file is checked against its recorded
digest before it is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from .._errors import QuantkitError
from .._fsutil import CLOEXEC as _CLOEXEC, NOFOLLOW as _NOFOLLOW, lock_dir, unlock
from ._files import RESTART as _RESTART, Ledger, damaged as _damaged

__all__ = ["PartialDir", "ActivationCache", "STATE_VERSION", "MARKER"]

STATE_VERSION = 2
MARKER = "quantkit-partial.json"
_KIND = "quantkit block-by-block progress"
_HEX = frozenset("0123456789abcdef")


def _overlaps(a: Path, b: Path) -> bool:
    """Whether one of the two resolved paths is, or lies inside, the other."""
    a, b = Path(os.path.realpath(a)), Path(os.path.realpath(b))
    return a == b or a in b.parents or b in a.parents


class PartialDir:
    """The progress directory of one output path.

    It is created only where nothing exists, and reused or removed only where it holds our
    marker (:data:`MARKER`) with this output's run id; anything else there, a link, or a path
    that is, holds or lies inside one of ``inputs`` is refused before any work. While a run
    uses it, it holds the directory's ``flock``: a second run of the same output is refused.
    """

    def __init__(self, path: Path, run_id: str, inputs: Iterable[Path] = ()) -> None:
        self.path = Path(path).absolute()
        self.run_id = run_id
        self.inputs = [Path(p) for p in inputs]
        self.ledger = Ledger(self.path)
        self.fingerprint: dict = {}
        self.n_blocks = 0
        self._lock_fd: int | None = None

    @staticmethod
    def beside(out: Path) -> Path:
        out = Path(out).absolute()
        return out.parent / f".{out.name}.quantkit-partial"

    @classmethod
    def for_output(cls, out: Path, inputs: Iterable[Path] = ()) -> "PartialDir":
        """The progress directory beside ``out``; its run id names the output (its resolved parent and name)."""
        out = Path(out).absolute()
        where = os.path.join(os.path.realpath(out.parent), out.name)
        return cls(cls.beside(out), hashlib.sha256(os.fsencode(where)).hexdigest()[:32], inputs)

    def claim(self) -> None:
        """Check that the directory is ours to use: absent, or holding our marker.

        Raises:
            QuantkitError: it is an input (or holds or lies in one), a link, a file, or a
                directory without our marker (nothing is touched).
        """
        where = str(self.path)
        for p in self.inputs:
            if _overlaps(self.path, p):
                raise QuantkitError(f"the progress directory {where!r} would overwrite the input {str(p)!r}; "
                                    "choose another output path")
        if os.path.islink(self.path):
            raise QuantkitError(f"the progress directory {where!r} is a symbolic link; remove it or choose "
                                "another output path")
        if not os.path.lexists(self.path):
            return
        if not self.path.is_dir():
            raise QuantkitError(f"{where!r} exists and is not a directory, so it cannot hold this run's progress; "
                                "move it away or choose another output path")
        if not self._has_marker():
            raise QuantkitError(f"{where!r} exists and is not this run's quantkit progress directory (no marker "
                                f"{MARKER} with its run id); move it away or choose another output path")

    def _has_marker(self) -> bool:
        try:
            fd = os.open(self.path / MARKER, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                doc = json.loads(f.read(4096).decode("utf-8"))
        except (OSError, ValueError):
            return False
        return isinstance(doc, dict) and doc.get("kind") == _KIND and doc.get("run_id") == self.run_id

    def open(self, resume: bool, fingerprint: dict) -> int:
        """Check the directory; returns the last block already done (-1 for a fresh run).
        Call :meth:`set_blocks` once the model is cut into blocks (before anything is written).

        Without ``resume`` a previous partial run (ours) is discarded. With it, the run
        continues after its last completed block, once the state record and every file it
        lists have been checked against their SHA-256.

        Raises:
            QuantkitError: the directory is not ours (:meth:`claim`); or ``resume`` and the
                partial run's state or files are damaged (named), or it was made from other
                model files, another recipe, other calibration data or other versions (the
                message says which).
        """
        self.fingerprint = json.loads(json.dumps(fingerprint, default=str))  # as state.json will hold it
        self.claim()
        if os.path.lexists(self.path):
            self._hold()
        if resume and os.path.lexists(self.path / "state.json"):
            state = self._read_state()
            self._compare(state)
            self.ledger.digests = dict(state["files"])
            for b in range(state["done"] + 1):
                for f in (self.block_file(b), self.observers_file(b)):
                    if not os.path.lexists(f):
                        raise _damaged(self.path, f"{f.name} is missing")
            for key in sorted(state["files"]):  # the previous block's outputs, deleted after it, are gone
                if os.path.lexists(self.path / key):
                    self.ledger.verify(self.path / key)
            self.n_blocks = state["blocks"]
            return state["done"]
        self.n_blocks = 0  # a fresh run: the directory is made by set_blocks, once the model is checked
        return -1

    def set_blocks(self, n_blocks: int) -> None:
        """The model's number of blocks: checked for a resumed run; for a fresh one, the directory
        is (re)made here, with our marker (a previous partial run of this output is discarded).

        Raises:
            QuantkitError: the partial run cut the model into another number of blocks, or the
                path is no longer ours (:meth:`claim`).
        """
        if self.n_blocks:
            if self.n_blocks != n_blocks:
                raise QuantkitError(f"the model now has {n_blocks} blocks, the partial run in {str(self.path)!r} "
                                    f"{self.n_blocks}; {_RESTART}")
            return
        self.claim()
        if os.path.lexists(self.path):
            self._hold()
            shutil.rmtree(self.path)  # claim(): ours, and no other run holds it
            self.release()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(self.path, 0o700)
        self._hold()
        self.ledger = Ledger(self.path)
        self.ledger.save_text(json.dumps({"kind": _KIND, "run_id": self.run_id}) + "\n", self.path / MARKER,
                              record=False)
        self.n_blocks = n_blocks
        self._write_state(-1)

    def _read_state(self) -> dict:
        try:
            fd = os.open(self.path / "state.json", os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                state = json.loads(f.read().decode("utf-8"))
        except (OSError, ValueError):
            raise _damaged(self.path, "state.json is unreadable") from None
        if not isinstance(state, dict):
            raise _damaged(self.path, "state.json is not a record")
        if state.get("version") != STATE_VERSION:
            raise QuantkitError(f"the partial run in {str(self.path)!r} was written by another quantkit version "
                                f"(state version {state.get('version')!r}); {_RESTART}")
        body = {k: v for k, v in state.items() if k != "sha256"}
        if state.get("sha256") != _record_digest(body):
            raise _damaged(self.path, "state.json does not match its digest")
        blocks, done, files = state.get("blocks"), state.get("done"), state.get("files")
        if type(blocks) is not int or blocks < 1:
            raise _damaged(self.path, f"state.json: blocks is {blocks!r}")
        if type(done) is not int or not -1 <= done < blocks:
            raise _damaged(self.path, f"state.json: done is {done!r}, not a block from -1 to {blocks - 1}")
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) and len(v) == 64
                                                  and set(v) <= _HEX for k, v in files.items()):
            raise _damaged(self.path, "state.json: files is not a table of SHA-256 digests")
        if state.get("run_id") != self.run_id or not isinstance(state.get("fingerprint"), dict):
            raise _damaged(self.path, "state.json belongs to another run")
        return state

    def _compare(self, state: dict) -> None:
        """Raise naming the first part of the fingerprint that differs from the partial run's."""
        old, new = state["fingerprint"], self.fingerprint
        for key, what in (("quantkit", "the quantkit version"), ("torch", "the torch version"),
                          ("config.json", "config.json"), ("tokenizer", "the tokenizer files"),
                          ("checkpoint", "the checkpoint files"), ("recipe", "the recipe"), ("task", "the task"),
                          ("calibration", "the calibration data")):
            if old.get(key) == new.get(key):
                continue
            if key in ("tokenizer", "checkpoint") and isinstance(old.get(key), dict) and isinstance(new.get(key), dict):
                names = sorted(set(old[key]) | set(new[key]))
                changed = [n for n in names if old[key].get(n) != new[key].get(n)]
                what = f"{what[:-1]} {changed[0]!r}" if changed else what  # "the checkpoint file 'x'"
            if key in ("quantkit", "torch"):
                what = f"{what} ({old.get(key)} then, {new.get(key)} now)"
            raise QuantkitError(f"{what} changed since the partial run in {str(self.path)!r}; {_RESTART}")
        if old != new:
            raise QuantkitError(f"the run's settings changed since the partial run in {str(self.path)!r}; {_RESTART}")

    def _write_state(self, done: int) -> None:
        body = {"version": STATE_VERSION, "run_id": self.run_id, "fingerprint": self.fingerprint,
                "blocks": self.n_blocks, "done": done, "files": dict(sorted(self.ledger.digests.items()))}
        doc = {**body, "sha256": _record_digest(body)}
        self.ledger.save_text(json.dumps(doc, indent=1) + "\n", self.path / "state.json", record=False)

    def block_file(self, b: int) -> Path:
        return self.path / f"block_{b:04d}.safetensors"

    def observers_file(self, b: int) -> Path:
        return self.path / f"observers_{b:04d}.safetensors"

    def commit_block(self, b: int, weights: dict, observers: dict[str, torch.nn.Module]) -> None:
        """Write block ``b``'s weights and observer buffers; call :meth:`mark_done` after its activations."""
        self.ledger.save_tensors(weights, self.block_file(b))
        state = {f"{name}\x00{buf}": t.detach() for name, obs in observers.items()
                 for buf, t in obs.named_buffers() if isinstance(t, torch.Tensor)}
        self.ledger.save_tensors(state, self.observers_file(b))

    def mark_done(self, b: int) -> None:
        self._write_state(b)

    def restore_observers(self, done: int, observers: dict[str, torch.nn.Module]) -> None:
        """Load the observer buffers saved by blocks 0..``done`` (a later block's copy wins), each
        file checked against its digest first."""
        from safetensors.torch import load

        for b in range(done + 1):
            for key, t in load(self.ledger.read_verified(self.observers_file(b))).items():
                name, buf = key.split("\x00", 1)
                obs = observers[name]
                *path, attr = buf.split(".")
                owner = obs.get_submodule(".".join(path)) if path else obs
                owner._buffers[attr] = t

    def _hold(self) -> None:
        """Take the directory's flock for this run (the kernel drops it if the process dies).

        Raises:
            QuantkitError: another run (of the same output) holds it.
        """
        if self._lock_fd is not None:
            return
        try:
            fd = lock_dir(self.path)
        except OSError:
            raise QuantkitError(f"another quantkit run is using the progress directory {str(self.path)!r}; wait "
                                "for it to finish or choose another output path") from None
        self._lock_fd = fd

    def release(self) -> None:
        """Let go of the directory's flock (the files stay, for a later resume)."""
        fd, self._lock_fd = self._lock_fd, None
        unlock(fd)

    def remove(self) -> None:
        """Delete the directory, if it is still ours (our marker, no link)."""
        if os.path.lexists(self.path) and not os.path.islink(self.path) and self.path.is_dir() \
                and self._has_marker():
            shutil.rmtree(self.path, ignore_errors=True)


def _record_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class ActivationCache:
    """Values handed from one block to the next, per calibration batch.

    Every block's outputs are written to ``acts/<block>/`` under ``root`` (so that a run can
    resume), through ``ledger`` (the progress directory's: digests recorded, links refused);
    they are also kept in memory while their total stays within ``budget`` bytes, and read
    back from disk (one batch at a time, checked against their digests) above it.
    """

    def __init__(self, root: Path, budget: int | None, ledger: Ledger | None = None) -> None:
        self.root = Path(root).absolute() / "acts"
        self.ledger = ledger if ledger is not None else Ledger(Path(root))
        self.budget = budget
        self.memory: dict[int, dict] | None = {}
        self.block = -1

    def _dir(self, block: int) -> Path:
        return self.root / f"{block:04d}"

    def start(self, block: int) -> None:
        """Begin collecting the outputs of ``block``."""
        d = self._dir(block)
        self.ledger.rmtree(d)
        self.ledger.makedirs(d)
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
            tensors[k] = v
            seen.setdefault(v.untyped_storage().data_ptr(), k)
        other = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
        for k, v in other.items():
            if not (v is None or isinstance(v, (int, float, bool))):
                raise QuantkitError(f"value {k!r} crossing a block boundary is a {type(v).__name__}; "
                                    "only tensors, numbers and None can be carried; quantize this model in memory")
        d = self._dir(block)
        self.ledger.save_tensors(tensors, d / f"batch_{i:06d}.safetensors")
        self.ledger.save_text(json.dumps({"values": other, "aliases": aliases}), d / f"batch_{i:06d}.json")
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
        if old >= 0:
            self.ledger.rmtree(self._dir(old))

    def resume(self, block: int) -> None:
        """Continue from the outputs ``block`` wrote in an earlier run (read from disk)."""
        self.block, self.memory = block, None

    def get(self, i: int) -> dict:
        if self.memory is not None:
            return self.memory[i]
        from safetensors.torch import load

        d = self._dir(self.block)
        values = dict(load(self.ledger.read_verified(d / f"batch_{i:06d}.safetensors")))
        doc = json.loads(self.ledger.read_verified(d / f"batch_{i:06d}.json").decode("utf-8"))
        values.update(doc["values"])
        values.update({k: values[same] for k, same in doc["aliases"].items()})
        return values
