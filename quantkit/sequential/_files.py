"""The files of a block-by-block progress directory: written without following links, each
with the SHA-256 it was written with, and checked against it when read back.

Also the fingerprints a resumed run is compared with (:func:`model_files_fingerprint`,
:func:`digest_of`). Everything is safetensors or JSON: nothing here is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import stat
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from .._errors import QuantkitError
from .._fsutil import CLOEXEC as _CLOEXEC, NOFOLLOW as _NOFOLLOW

__all__ = ["Ledger", "LARGE_FILE", "RESTART", "damaged", "digest_of", "file_digest", "fingerprint_tensors",
           "model_files_fingerprint"]

# files larger than this are fingerprinted by size, mtime and a few sampled windows, not read whole
LARGE_FILE = 1 << 30
_WINDOW = 1 << 20
# safetensors' dtype names (github.com/huggingface/safetensors, format spec)
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
           torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}
RESTART = "run again with --no-resume (or without --resume) to start over"


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


def digest_of(*values) -> str:
    h = hashlib.sha256()
    for v in values:
        fingerprint_tensors(h, v)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes; for a file over :data:`LARGE_FILE` (1 GiB), of its size, mtime
    and five fixed 1 MiB windows (at 0, 1/4, 1/2, 3/4 of it and its last MiB) instead: a
    multi-GB checkpoint is not read whole on every run, so an edit that keeps size and mtime and
    misses every window goes unseen there."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_size <= LARGE_FILE:
            for chunk in iter(lambda: f.read(_WINDOW), b""):
                h.update(chunk)
            return h.hexdigest()
        h.update(f"sampled:{st.st_size}:{st.st_mtime_ns}".encode())
        for offset in (0, st.st_size // 4, st.st_size // 2, st.st_size * 3 // 4, st.st_size - _WINDOW):
            f.seek(offset)
            h.update(f.read(_WINDOW))
    return "sampled:" + h.hexdigest()


def _is_tokenizer_file(name: str) -> bool:
    return (name.startswith(("tokenizer", "vocab", "merges")) or name.endswith(".model")
            or name in ("special_tokens_map.json", "added_tokens.json"))


def model_files_fingerprint(model_dir: Path, checkpoint_files: Iterable[str]) -> dict:
    """Digests (:func:`file_digest`) of ``config.json``, the tokenizer files and the checkpoint files."""
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    tokenizer = sorted(p.name for p in model_dir.iterdir() if p.is_file() and _is_tokenizer_file(p.name))
    return {"config.json": file_digest(config) if config.is_file() else None,
            "tokenizer": {name: file_digest(model_dir / name) for name in tokenizer},
            "checkpoint": {name: file_digest(model_dir / name) for name in sorted(set(checkpoint_files))}}


def damaged(path: Path, why: str) -> QuantkitError:
    return QuantkitError(f"the partial run in {str(path)!r} is damaged ({why}); {RESTART}")


def _safetensors_chunks(tensors: dict) -> Iterator[bytes | memoryview]:
    """The safetensors serialization of ``tensors``, one tensor at a time (no copy of the whole file)."""
    header: dict = {}
    arrays = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.dtype not in _DTYPES:
            raise QuantkitError(f"internal: cannot store a {t.dtype} tensor ({name!r}) in the progress directory")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        arrays.append(t)
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    yield struct.pack("<Q", len(raw)) + raw
    for t in arrays:
        if t.numel():
            yield memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


class Ledger:
    """The files of one progress directory and the SHA-256 each was written with.

    Every write goes through here: the target must lie inside the directory's resolved path,
    is written under a fresh name opened with ``O_EXCL | O_NOFOLLOW`` and renamed into place.
    Every read of a file the run trusts is checked against its recorded digest.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()
        self.digests: dict[str, str] = {}

    def key(self, path: Path) -> str:
        return Path(path).absolute().relative_to(self.root).as_posix()

    def inside(self, path: Path) -> Path:
        """``path`` if its directory resolves inside the progress directory and it is no link.

        Raises:
            QuantkitError: it would lead elsewhere (a planted link on the way).
        """
        path = Path(path).absolute()
        real_root = os.path.realpath(self.root)
        real_parent = os.path.realpath(path.parent)
        if (os.path.islink(self.root) or not (real_parent == real_root or real_parent.startswith(real_root + os.sep))
                or os.path.islink(path)):
            raise QuantkitError(f"refusing to write {str(path)!r}: a symbolic link leads it outside the progress "
                                f"directory {str(self.root)!r}; remove that directory and run again")
        return path

    def makedirs(self, path: Path) -> None:
        """Create ``path`` and the directories up to it below the root (mode 0700), refusing links."""
        path = Path(path).absolute()
        if self.root not in path.parents:
            raise QuantkitError(f"internal: refusing to create {str(path)!r} outside {str(self.root)!r}")
        todo = []
        p = path
        while p != self.root:
            todo.append(p)
            p = p.parent
        for d in reversed(todo):
            self.inside(d)
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(d).st_mode):
                    raise QuantkitError(f"{str(d)!r} in the progress directory is not a directory; remove "
                                        f"{str(self.root)!r} and run again") from None

    def write(self, path: Path, chunks: Iterable, *, record: bool = True) -> str:
        """Write ``chunks`` to ``path`` atomically; returns (and records) their SHA-256."""
        path = self.inside(path)
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(6)}.tmp")
        h = hashlib.sha256()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
        try:
            for chunk in chunks:
                h.update(chunk)
                _write_all(fd, chunk)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)
        digest = h.hexdigest()
        if record:
            self.digests[self.key(path)] = digest
        return digest

    def save_tensors(self, tensors: dict, path: Path) -> str:
        return self.write(path, _safetensors_chunks(tensors))

    def save_text(self, text: str, path: Path, *, record: bool = True) -> str:
        return self.write(path, [text.encode("utf-8")], record=record)

    def _open_checked(self, path: Path):
        """(file, expected digest) of a recorded file, opened without following links."""
        path = Path(path).absolute()
        expected = self.digests.get(self.key(path))
        if expected is None:
            raise damaged(self.root, f"{self.key(path)} is not recorded in state.json")
        try:
            fd = os.open(self.inside(path), os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        except (OSError, QuantkitError):
            raise damaged(self.root, f"{self.key(path)} is missing or not a plain file") from None
        return os.fdopen(fd, "rb"), expected

    def read_verified(self, path: Path) -> bytes:
        """The bytes of ``path``, after checking them against the digest recorded when it was written.

        Raises:
            QuantkitError: unrecorded, missing, a link, or changed since (named).
        """
        f, expected = self._open_checked(path)
        with f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != expected:
            raise damaged(self.root, f"{self.key(path)} was changed after it was written")
        return data

    def verify(self, path: Path) -> None:
        """Check ``path`` against its recorded digest (read in 1 MiB pieces)."""
        f, expected = self._open_checked(path)
        h = hashlib.sha256()
        with f:
            for chunk in iter(lambda: f.read(_WINDOW), b""):
                h.update(chunk)
        if h.hexdigest() != expected:
            raise damaged(self.root, f"{self.key(path)} was changed after it was written")

    def rmtree(self, path: Path) -> None:
        """Remove ``path`` (a directory below the root, not a link) and forget its files."""
        path = Path(path).absolute()
        if path == self.root or self.root not in path.parents:
            raise QuantkitError(f"internal: refusing to remove {str(path)!r} outside {str(self.root)!r}")
        if not os.path.lexists(path):
            return
        self.inside(path)
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise QuantkitError(f"{str(path)!r} in the progress directory is not a directory; remove "
                                f"{str(self.root)!r} and run again")
        shutil.rmtree(path)
        prefix = self.key(path) + "/"
        self.digests = {k: v for k, v in self.digests.items() if not k.startswith(prefix)}
