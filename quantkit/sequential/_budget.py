"""What each quantize path needs in memory, from the checkpoint's sizes, and a heap that gives back.

``--max-memory SIZE`` is a promise: peak resident memory stays within SIZE plus the
interpreter's and libraries' own (``import torch, transformers, quantkit``). The plan here
is made from measured sizes, the safetensors headers (no tensor data) and config.json, before
anything runs:

- in memory: the weights times :data:`IN_MEMORY_FACTOR`, one batch's activations and the
  exported graph (:func:`export_bytes`);
- block by block, the larger of two phases: calibrating (the captured graph, the largest
  block's weights twice: the float tensors and the checkpoint pages mapped while they are
  read, the activations handed between blocks that stay in memory, :data:`CACHE_SHARE` of
  the budget at most, the rest spill to disk, and one batch's activations in the widest
  block) and writing the artifact (the converted graph and its serialised program).

When the block-by-block path is taken and a batch of ``--batch-size`` sequences would not
fit what is left, the calibration batches are made smaller (said in the report line); when
not even one sequence fits, the budget is refused in one line before anything runs.
"""

from __future__ import annotations

import ctypes
import json
import platform
from dataclasses import dataclass
from pathlib import Path

from .._errors import QuantkitError
from .._sizing import TensorInfo, checkpoint_shapes, format_bytes, layer_stack, size_field

__all__ = ["IN_MEMORY_FACTOR", "CACHE_SHARE", "graph_bytes", "export_bytes", "MemoryPlan", "plan_memory",
           "bound_heap"]

# the in-memory path holds the float weights and peaks at about 1.65x their size in total
# (BENCHMARKS.md, "peak memory of quantize", BERT-base); 2x leaves room for the converted copy
IN_MEMORY_FACTOR = 2.0
# share of --max-memory the activation cache may keep in memory, for the current block's
# inputs and for its outputs each (so twice this in all); the rest is read back from disk
CACHE_SHARE = 1 / 8


def graph_bytes(layers: int) -> int:
    """The captured, prepared and partitioned graph with its fake parameters and torch.export's
    shape environment, resident while blocks run: measured 37, 52 and 65 MiB above the imports
    for Llamas of 1, 8 and 16 layers (hidden 32; /proc/self/status VmRSS), so 40 MiB + 2 MiB a layer."""
    return (40 << 20) + (2 << 20) * layers


def export_bytes(layers: int) -> int:
    """Converting the graph and serialising its program when the artifact is written (no block
    weights are held then): measured 50, 101 and 151 MiB above the imports for Llamas of 1, 8
    and 16 layers, so 48 MiB + 7 MiB a layer."""
    return (48 << 20) + (7 << 20) * layers


# the int8 weights are quantized in 16 MiB slices (pipeline.emit._affine._CHUNK_BYTES) with float temporaries
_QUANTIZE_BYTES = 32 << 20
# activations are float32 and each op's output lives beside its input and an observer's
# temporaries (a min/max over a copy): measured peaks are within 2x the widths summed below
_ACT_FACTOR = 2 * 4


@dataclass(frozen=True)
class MemoryPlan:
    """How a quantize run fits a budget (bytes); see the module docstring for the terms."""

    budget: int | None
    weight_bytes: int
    in_memory_bytes: int
    block_name: str
    block_bytes: int
    sequential_bytes: int  # with batches of ``batch_size``
    batch_size: int  # 0: not even one sequence fits (see check)
    asked_batch_size: int
    sequential: bool
    seq_len: int = 0

    def check(self) -> None:
        """Refuse a budget the block-by-block path cannot keep even with one sequence per batch.

        Raises:
            QuantkitError: one line with the size it needs.
        """
        if self.sequential and self.budget is not None and self.batch_size < 1:
            raise QuantkitError(
                f"--max-memory {format_bytes(self.budget)} is too small to quantize block by block: the largest block "
                f"({self.block_name}, {format_bytes(self.block_bytes)} of float32 weights, held with the checkpoint "
                f"pages it is read from) and one sequence of {self.seq_len} tokens need about "
                f"{format_bytes(self.sequential_bytes)}; raise --max-memory or lower --seq-len")

    def line(self, forced: bool = False) -> str:
        """The one line the CLI prints about the choice."""
        budget = f"--max-memory {format_bytes(self.budget)}" if self.budget is not None else "no --max-memory"
        if not self.sequential:
            return (f"memory: in memory needs about {format_bytes(self.in_memory_bytes)} "
                    f"({format_bytes(self.weight_bytes)} of weights), within {budget}: quantizing in memory")
        why = "--sequential" if forced else (f"in memory would need about {format_bytes(self.in_memory_bytes)}, "
                                            f"more than {budget}")
        batches = (f"; calibration batches of {self.batch_size} instead of {self.asked_batch_size} keep the "
                   "activations within the budget" if self.batch_size < self.asked_batch_size else "")
        return (f"memory: {why}: quantizing block by block, about {format_bytes(self.sequential_bytes)} "
                f"(largest block {self.block_name}: {format_bytes(self.block_bytes)} of weights){batches}")


def _fp32_bytes(info: TensorInfo) -> int:
    """Bytes as the block-by-block path holds a tensor: floating weights in float32 (the
    empty model's dtype), integers as stored."""
    n = 1
    for s in info.shape:
        n *= s
    return n * (4 if info.dtype.startswith(("F", "BF")) else max(1, info.nbytes // max(1, n)))


def _units(shapes: dict[str, TensorInfo]) -> dict[str, list[TensorInfo]]:
    """Tensors per block, approximately: each layer of the largest stack (``model.layers.3``),
    and outside it each module's parent (``model`` for ``model.embed_tokens.weight``,
    ``lm_head``, ``bert.embeddings``): the head and tail blocks hold those."""
    stack, _ = layer_stack(shapes)
    units: dict[str, list[TensorInfo]] = {}
    for name, info in shapes.items():
        parts = name.split(".")
        if stack is not None and name.startswith(stack + "."):
            key = ".".join(parts[:len(stack.split(".")) + 1])
        else:
            key = ".".join(parts[:-2]) or parts[0]
        units.setdefault(key, []).append(info)
    return units


def _width(tensors: list[TensorInfo]) -> int:
    """Activation values per token a block produces, at most: every matrix's larger side (a
    linear layer's output, an LM head's vocabulary; an embedding's too, which overcounts)."""
    return sum(max(t.shape) for t in tensors if len(t.shape) == 2)


def plan_memory(model_dir: str | Path, budget: int | None, *, seq_len: int, batch_size: int,
                samples: int | None = None, forced: bool = False) -> MemoryPlan:
    """The :class:`MemoryPlan` of quantizing ``model_dir`` with ``budget`` bytes.

    Args:
        seq_len, batch_size: the calibration batches asked for (tokens per sequence, sequences).
        samples: calibration sequences (bounds the activation cache); None: as many as fit.
        forced: the block-by-block path is asked for (``--sequential``/``--resume``).

    The plan's :meth:`MemoryPlan.check` refuses a budget that not even one sequence per batch fits.
    """
    model_dir = Path(model_dir)
    shapes = checkpoint_shapes(model_dir) or {}
    try:
        doc = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        doc = {}
    doc = doc if isinstance(doc, dict) else {}
    heads = size_field(doc, ("num_attention_heads", "n_head", "n_heads", "num_heads")) or 1
    weight_bytes = sum(t.nbytes for t in shapes.values())
    units = _units(shapes)
    block_name, block = max(((k, sum(_fp32_bytes(t) for t in v)) for k, v in units.items()),
                            key=lambda kv: kv[1], default=("-", 0))
    hidden = size_field(doc, ("hidden_size", "n_embd", "d_model", "dim")) or 0
    # per token: the widest block's outputs, and the attention scores and probabilities of a sequence
    per_token = max((_width(v) for v in units.values()), default=0) * _ACT_FACTOR + 2 * 4 * heads * seq_len
    layers = layer_stack(shapes)[1]
    # the in-memory path captures and exports the whole graph too
    in_memory = int(weight_bytes * IN_MEMORY_FACTOR) + per_token * seq_len * batch_size + export_bytes(layers)
    writing = export_bytes(layers) + max((_fp32_bytes(t) for t in shapes.values()), default=0)
    if budget is None:
        fixed = 2 * block + _QUANTIZE_BYTES + graph_bytes(layers)
        need = max(writing, fixed + per_token * seq_len * batch_size)
        return MemoryPlan(None, weight_bytes, in_memory, block_name, block, need, batch_size, batch_size, forced,
                          seq_len)
    # values handed to the next block, per sequence: the hidden states and a residual-sized copy
    cached_per_seq = 2 * 4 * max(hidden, 1) * seq_len
    cache = 2 * min(int(budget * CACHE_SHARE), cached_per_seq * (samples if samples is not None else 1 << 30))
    fixed = 2 * block + _QUANTIZE_BYTES + graph_bytes(layers) + cache
    sequential = forced or in_memory > budget
    if not sequential:
        return MemoryPlan(budget, weight_bytes, in_memory, block_name, block,
                          max(writing, fixed + per_token * seq_len * batch_size), batch_size, batch_size, False, seq_len)
    fits = max(0, (budget - fixed) // max(1, per_token * seq_len)) if writing <= budget else 0
    batch = int(min(batch_size, fits))
    return MemoryPlan(budget, weight_bytes, in_memory, block_name, block,
                      max(writing, fixed + per_token * seq_len * max(1, batch)), batch, batch_size, True, seq_len)


def bound_heap() -> None:
    """Make glibc return freed tensors to the system for the rest of the process.

    glibc raises its mmap threshold to the size of each freed mmapped chunk (up to 32 MiB), so
    after the first block's weights are freed, the next block's are served from the heap,
    whose freed space stays resident; a fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, which
    turns the adjustment off) keeps every tensor of 1 MiB or more in its own mapping, unmapped
    when freed (measured: 598 instead of 687 MiB peak RSS for ``quantkit quantize --max-memory
    160MiB`` of a 210 MiB fp32 Llama, 6 layers, hidden 768). A no-op on other C libraries.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (malloc.h)
    except (OSError, AttributeError):  # pragma: no cover - no glibc after all
        pass
