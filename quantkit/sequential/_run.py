"""quantize_pretrained: quantize a Hugging Face checkpoint, block by block when it does not fit in memory.

The sequential path never holds the float model:

1. capture it without weights (``_meta_capture``) and prepare it with the quantizer, as
   the in-memory path does (same graph, same observers);
2. cut the prepared graph into head, layers and tail (``_partition``);
3. for each block: load its weights from the safetensors checkpoint (only its tensors),
   run it on every calibration batch's cached inputs (observers record ranges), quantize
   its weights, write them to the partial directory, drop the float weights, and keep the
   block's outputs as the next block's inputs (``sequential._state``);
4. convert the whole prepared graph with the weights still absent (qparams come from the
   calibrated observers), put the int8 weights in place of the quantize ops, and write the
   artifact with the weights streamed from the partial directory (``export._streamed``).

The result equals the in-memory path's (``quantkit.quantize`` on the loaded model): the
observers see the same tensors in the same order, and weights are quantized with the
qparams and ops ``convert`` uses.
"""

from __future__ import annotations

import os
import re
import signal
from importlib import metadata
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from quantkit.observers._tokens import token_mask
from quantkit.quantizers import W8A8Quantizer
from quantkit.quantizers._scheme import CONFIG_META_KEY, SchemeConfig, SchemeError, as_config

from .._errors import QuantkitError
from .. import _hf
from .._graph import (FOLDED_PREFIX, QPARAMS_META_KEY, QUANTIZE_OPS, constant_value, get_attr, is_calibrated,
                      is_observer_node, set_attr, unique_attr_name)
from ..accuracy.rounding._gptq_blocks import head_values
from ..export import _artifact, _streamed
from ..pipeline import _api
from ..pipeline._calibrate import _padding_mask
from ..pipeline._convert import _remove_unused_attributes, convert_in_place
from ..pipeline.emit import emitter_for
from ..pipeline._hooks import BlockRun, calibration_hooks
from ..pipeline._meta_capture import CheckpointIndex, capture_without_weights, empty_model, index_checkpoint
from ..pipeline._partition import Block, partition, run_block
from ..pipeline._prepare import prepare_in_place
from . import _gptq  # noqa: F401  (registers GPTQ's after_block hook)
from ._budget import CACHE_SHARE, IN_MEMORY_FACTOR, bound_heap, plan_memory
from ._files import digest_of, model_files_fingerprint
from ._groupwise import fold_groupwise
from ._state import ActivationCache, PartialDir

__all__ = ["quantize_pretrained", "parse_size", "IN_MEMORY_FACTOR"]

# environment hook for tests: SIGKILL the process right after block N is committed
KILL_AFTER_ENV = "QUANTKIT_TEST_KILL_AFTER_BLOCK"

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(I?)B?\s*\Z", re.IGNORECASE)


def parse_size(value) -> int:
    """Bytes from ``4GiB``, ``512MB``, ``1.5G`` (K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti of
    1024) or an integer number of bytes.

    Raises:
        ValueError: anything else, or a size that is not positive.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ValueError(f"memory size {value!r} is not a size; write e.g. 4GiB, 512MB or a number of bytes")
        number, unit, binary = float(m[1]), m[2].upper(), bool(m[3])
        if binary and not unit:
            raise ValueError(f"memory size {value!r} is not a size; write e.g. 4GiB, 512MB or a number of bytes")
        power = " KMGT".index(unit) if unit else 0
        size = int(number * (1024 if binary else 1000) ** power)
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return size


def _batches(calib_data) -> list:
    if isinstance(calib_data, (torch.Tensor, Mapping)) or not isinstance(calib_data, Iterable):
        raise TypeError("calibration data must be an iterable of batches (e.g. a list of tensors, tuples or dicts); "
                        f"got {type(calib_data).__name__}; wrap a single batch in a list")
    batches = list(calib_data)
    if not batches:
        raise QuantkitError("calibration data is empty: pass at least one representative batch")
    return batches


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def _recipe_of(quantizer) -> Any:
    config = getattr(quantizer, "config", None)
    if config is not None and hasattr(config, "__dataclass_fields__"):
        from dataclasses import asdict

        return {"class": type(quantizer).__name__, "config": {k: repr(v) for k, v in asdict(config).items()}}
    return {"class": type(quantizer).__name__}


def quantize_pretrained(model_dir: str | os.PathLike, calib_data: Iterable, quantizer=None, *,
                        max_memory: int | str | None = None, out: str | os.PathLike | None = None,
                        sequential: bool | None = None, resume: bool = False, overwrite: bool = False,
                        task: str = "auto", progress: bool = True, recipe: dict | None = None,
                        dynamic_shapes=None, source: dict | None = None, config: str | SchemeConfig | None = None,
                        recorded_config: SchemeConfig | None = None):
    """Quantize the Hugging Face checkpoint in ``model_dir``, block by block when it does not fit.

    With ``max_memory`` smaller than the in-memory path needs (measured from the checkpoint's
    tensor shapes and the batches' sizes: :func:`quantkit.sequential._budget.plan_memory`, the
    same plan as the CLI's), or ``sequential=True``, the model is calibrated one repeated
    unit (transformer layer) at a time with its weights read from the safetensors checkpoint,
    and only that block's float weights are ever in memory. Otherwise it is loaded and
    quantized with :func:`quantkit.quantize`. Both give the same model.

    Args:
        model_dir: an HF model directory (config.json and safetensors weights).
        calib_data: an iterable of calibration batches (tokenizer outputs as dicts, tensors
            or tuples); the first batch is the example the model is captured with.
        quantizer: defaults to ``W8A8Quantizer()``.
        config: instead of ``quantizer``: a registered preset name (``"w4a16"``, ...; see
            ``quantkit.quantizers.available_schemes()``) or a ``SchemeConfig``, whose
            ``quantizer()`` is used; the result's ``meta["quantkit_config"]`` (and the artifact's
            ``quantization.json``) records it, and a resumed run must have the same one.
        recorded_config: with ``quantizer``: the ``SchemeConfig`` to record as above, when the
            quantizer was built from it and then adjusted (the CLI's, with ``--skip`` and int8
            embeddings); it does not change what is quantized.
        max_memory: the memory budget (bytes, or a size such as ``"4GiB"``); also bounds the
            activations cached in memory (``_budget.CACHE_SHARE`` of it twice; the rest spill to disk).
        out: write the artifact (``model.pt2`` + ``quantization.json``) there, atomically;
            the sequential path keeps its progress beside it (``.NAME.quantkit-partial``).
        sequential: force (True) or forbid (False) the block-by-block path.
        resume: continue an interrupted sequential run from its last completed block. Every
            file of the partial run is checked against the SHA-256 it was written with, and the
            model files, recipe, calibration data and versions against the run's fingerprint
            (``_Run._fingerprint``); a mismatch is one line naming it. The progress directory
            must be this output's (its marker); nothing else at that path is used or removed.
        overwrite: replace ``out`` if it holds a quantkit artifact.
        task: the model class (see ``quantkit quantize --task``).
        progress: show a progress bar per block.
        recipe: recorded as ``quantization.json``'s ``recipe`` (and part of what ``resume``
            checks the partial run against).
        source: recorded as ``quantization.json``'s ``source`` (default: the model directory).
        dynamic_shapes: passed to :func:`quantkit.capture`. By default the batch dimension
            is dynamic, and for token batches whose lengths differ the sequence one too.

    Returns:
        ``Path(out)`` when ``out`` is given, else the converted model (with its int8 weights
        in memory).

    Raises:
        QuantkitError: a checkpoint tensor is missing or mis-shaped (named; nothing is
            written), or the model cannot be cut into blocks (one line each).
        SchemeError: both ``quantizer`` and ``config``, or an unknown preset name (one line).

    Example:
        >>> quantkit.quantize_pretrained("llama-7b", batches, max_memory="4GiB", out="llama-int8")
        >>> quantkit.quantize_pretrained("llama-7b", batches, config="w4a16", out="llama-w4a16")
    """
    if quantizer is not None and config is not None:
        raise SchemeError("pass quantizer= or config=, not both (a config builds its own quantizer)")
    if recorded_config is not None:
        if config is not None or quantizer is None:
            raise SchemeError("recorded_config= goes with quantizer= (config= records itself); drop one of them")
        if not isinstance(recorded_config, SchemeConfig):
            raise SchemeError(f"recorded_config must be a SchemeConfig, got {type(recorded_config).__name__}")
        config = recorded_config
    elif config is not None:
        config = as_config(config)
        quantizer = config.quantizer()
    model_dir = Path(model_dir)
    _hf.check_hf_dir(model_dir)
    budget = parse_size(max_memory) if max_memory is not None else None
    batches = _batches(calib_data)
    if quantizer is None:
        quantizer = W8A8Quantizer()
    if out is not None:
        _artifact.check_out_dir(out, overwrite=overwrite)
    if dynamic_shapes is None:
        dynamic_shapes = _default_dynamic_shapes(batches)
    if sequential is None:
        index_checkpoint(model_dir)  # safetensors weights, or one line saying the block-by-block path needs them
        seq_len, batch_size = _batch_dims(batches[0])
        sequential = resume or plan_memory(model_dir, budget, seq_len=seq_len, batch_size=batch_size,
                                           samples=batch_size * len(batches)).sequential
    if sequential and budget is not None:
        bound_heap()  # freed block weights go back to the system, not to a heap that stays resident
    if not sequential:
        return _in_memory(model_dir, batches, quantizer, out, overwrite, task, progress, recipe, dynamic_shapes,
                          source, config)
    return _Run(model_dir, batches, quantizer, budget, out, resume, overwrite, task, progress, recipe,
                dynamic_shapes, source, config).run()


def _batch_dims(batch) -> tuple[int, int]:
    """(tokens per sequence, sequences) of a calibration batch: its first tensor's first two sizes."""
    first = next(iter(batch.values()), None) if isinstance(batch, Mapping) else \
        (batch[0] if isinstance(batch, (tuple, list)) and batch else batch)
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return 1, 1
    return (int(first.shape[1]) if first.dim() > 1 else 1), int(first.shape[0])


def _default_dynamic_shapes(batches: list):
    """None (capture's default: dynamic batch), or batch and sequence dynamic for dict token
    batches (``attention_mask`` ``[batch, tokens]``) of different lengths."""
    masks = [b.get("attention_mask") for b in batches if isinstance(b, Mapping)]
    if len(masks) != len(batches) or not all(isinstance(m, torch.Tensor) and m.dim() == 2 for m in masks):
        return None
    if len({m.shape[1] for m in masks}) == 1:
        return None
    return _hf.dynamic_shapes(batches[0])


def _in_memory(model_dir, batches, quantizer, out, overwrite, task, progress, recipe, dynamic_shapes, source,
               config=None):
    model, _, _ = _hf.load_hf_checkpoint(model_dir, task=task, progress=progress)
    qmodel = _api.quantize(model, batches[0], batches, quantizer, progress=progress, dynamic_shapes=dynamic_shapes)
    if config is not None:
        qmodel.meta[CONFIG_META_KEY] = config
    if out is None:
        return qmodel
    program = _artifact.export_converted(qmodel)
    with _artifact.atomic_dir(out, overwrite=overwrite) as tmp:
        _artifact.write_program(program, tmp)
        _artifact.write_json(tmp / _artifact.RECIPE_FILE, _artifact.recipe_document(
            qmodel, recipe=recipe, source=source or {"model": str(model_dir)}))
    return Path(out)


def _checkpoint_sources(model: torch.nn.Module, index: CheckpointIndex) -> dict[str, str]:
    """Checkpoint key of every parameter and persistent buffer of ``model`` (aliases of tied
    parameters included).

    Raises:
        QuantkitError: a tensor the model needs is missing or has another shape; the
            message names it.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    persistent = set(model.state_dict())
    tensors: dict[int, list[str]] = {}
    shapes: dict[int, tuple] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            [(n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in persistent]:
        tensors.setdefault(id(t), []).append(name)
        shapes[id(t)] = tuple(t.shape)
    sources: dict[str, str] = {}
    where = str(index.directory)
    for key, names in tensors.items():
        found = None
        for name in names:
            for cand in (name, f"{prefix}.{name}" if prefix else None,
                         name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else None):
                if cand is not None and cand in index.entries:
                    found = cand
                    break
            if found:
                break
        if found is None:
            raise QuantkitError(f"the checkpoint in {where!r} has no tensor {names[0]!r}; "
                                "fix the weights or config.json (nothing was written)")
        shape = index.entries[found][1]
        if shape != shapes[key]:
            raise QuantkitError(f"tensor {found!r} in {where!r} has shape {list(shape)}, the model expects "
                                f"{list(shapes[key])}; fix the weights or config.json (nothing was written)")
        for name in names:
            sources[name] = found
    return sources


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _check_weight_observers(prepared: GraphModule) -> None:
    """Refuse, before any block runs, weights this path cannot quantize block by block: those of
    observers whose convert emitter neither folds the weight to integers (``folds_weight``: the
    ``"affine"`` kind) nor emits from the weight alone (``emits_from_weight``: ``"groupwise"``, see
    ``_groupwise``), e.g. torchao observers with their own ``convert`` or float16, and weights to be
    rounded by AWQ (a whole-model pass in ``quantkit.calibrate``)."""
    modules = dict(prepared.named_modules())
    memo: dict = {}
    for node in prepared.graph.nodes:
        if not is_observer_node(node, modules):
            continue
        obs = modules[str(node.target)]
        if not isinstance(constant_value(prepared, node.args[0], memo), torch.Tensor):
            continue
        where = getattr(obs, "node_name", node.name)
        algorithm = getattr(obs, "weight_algorithm", "rtn") or "rtn"
        if algorithm not in ("rtn", "gptq"):  # GPTQ: sequential._gptq.SequentialGPTQ
            raise QuantkitError(f"weight_algorithm={algorithm!r} (weight at {where!r}) is not supported block by "
                                "block yet; use 'rtn' or 'gptq', or quantize in memory")
        emitter = emitter_for(obs)
        if not (emitter.folds_weight(obs) or emitter.emits_from_weight(obs)):
            kind = str(getattr(obs, "dtype", "")).replace("torch.", "")
            raise QuantkitError(f"the weight at {where!r} is quantized by {type(obs).__name__} ({kind}), which "
                                "block-by-block quantization does not support (int8/uint8 weights of quantkit's "
                                "static observers and group-wise weight-only ones); quantize this model in memory")


class _Run:
    def __init__(self, model_dir, batches, quantizer, budget, out, resume, overwrite, task, progress, recipe,
                 dynamic_shapes, source, config=None):
        self.model_dir, self.batches, self.quantizer, self.config = model_dir, batches, quantizer, config
        self.dynamic_shapes, self.source = dynamic_shapes, source
        self.budget, self.out, self.resume, self.overwrite = budget, out, resume, overwrite
        self.task, self.progress, self.recipe = task, progress, recipe

    def run(self):
        import tempfile

        tmp = None
        if self.out is not None:
            partial = PartialDir.for_output(Path(self.out), inputs=[self.model_dir])
            partial.claim()  # before any work: never a directory that is not this run's
        else:
            tmp = tempfile.TemporaryDirectory(prefix="quantkit-sequential-")
            partial = PartialDir(Path(tmp.name) / "partial", "in-memory")
        try:
            index = index_checkpoint(self.model_dir)
            done = partial.open(self.resume, self._fingerprint(index))  # a resume is checked before any work
            model = empty_model(self.model_dir, self.task)
            self.sources = _checkpoint_sources(model, index)
            self.index = index
            gm = capture_without_weights(model, self.batches[0], dynamic_shapes=self.dynamic_shapes)
            del model
            prepared = prepare_in_place(gm, self.quantizer)
            _check_weight_observers(prepared)
            blocks = partition(prepared)
            self.prepared, self.blocks = prepared, blocks
            self.observers = {str(n.target): prepared.get_submodule(str(n.target)) for n in prepared.graph.nodes
                              if is_observer_node(n, dict(prepared.named_modules()))}
            partial.set_blocks(len(blocks))
            self._calibrate(partial, done)
            result = self._finish(partial)
        finally:
            partial.release()
            if tmp is not None:
                tmp.cleanup()
        partial.remove()
        return result

    def _fingerprint(self, index: CheckpointIndex) -> dict:
        """What a resumed run must share with the partial one: config.json, the tokenizer files and
        the checkpoint files (digests; sampled for files over 1 GiB, see ``_files.file_digest``),
        the recipe, the task, the calibration data, and the quantkit and torch versions."""
        return {**model_files_fingerprint(self.model_dir, {f for f, _, _ in index.entries.values()}),
                "recipe": self.recipe or _recipe_of(self.quantizer), "task": self.task,
                **({} if self.config is None else {"config": self.config.to_dict()}),
                "calibration": digest_of(self.batches), "quantkit": _version("quantkit"), "torch": torch.__version__}

    def _calibrate(self, partial: PartialDir, done: int) -> None:
        from tqdm.auto import tqdm

        act_budget = None if self.budget is None else int(self.budget * CACHE_SHARE)  # _budget.plan_memory
        cache = ActivationCache(partial.path, act_budget, partial.ledger)
        # the after_block hooks that apply (GPTQ's rounded stream, when weights ask for GPTQ: _gptq)
        run = BlockRun(self.prepared, self.blocks, self.batches, partial.path, act_budget, partial.ledger)
        hooks = [h for h in (hook(run) for _, hook in calibration_hooks("after_block")) if h is not None]
        later_inputs = [set().union(*(b.inputs for b in self.blocks[i + 1:])) for i in range(len(self.blocks))]
        if done >= 0:
            try:  # every file was checked against its digest by partial.open, and is again as it is read
                partial.restore_observers(done, self.observers)
                cache.resume(done)
                for i in range(len(self.batches) if done < len(self.blocks) - 1 else 0):  # the tail hands nothing on
                    cache.get(i)
                for h in hooks:
                    h.resume(done, partial.block_file, self.observers)
            except QuantkitError:  # names the damaged file
                raise
            except Exception as exc:  # foreign contents under a recorded digest: a one-line error, never a traceback
                raise QuantkitError(f"the partial run in {str(partial.path)!r} is damaged ({type(exc).__name__}); "
                                    "run again with --no-resume (or without --resume) to start over") from None
        kill_after = os.environ.get(KILL_AFTER_ENV)
        for block in self.blocks[done + 1:]:
            self._load_weights(block)
            bar = tqdm(total=len(self.batches), desc=f"block {block.index + 1}/{len(self.blocks)} ({block.name})",
                       unit="batch", disable=not self.progress, leave=False)
            cache.start(block.index)
            try:
                with torch.no_grad():
                    for i, batch in enumerate(self.batches):
                        values = self._head_values(batch) if block.index == 0 else cache.get(i)
                        with token_mask(_padding_mask(batch)):
                            produced = run_block(block, values)
                        keep = {k: v for k, v in {**values, **produced}.items() if k in later_inputs[block.index]}
                        if block.index < len(self.blocks) - 1:
                            cache.put(block.index, i, keep)
                        bar.update(1)
            finally:
                bar.close()
            fixed: dict[str, torch.Tensor] = {}
            for h in hooks:
                fixed.update(h.round(block, lambda i: self._head_values(self.batches[i]) if block.index == 0
                                     else cache.get(i)))
            weights = {**self._quantize_weights(block), **fixed}
            used = {str(n.target) for n in block.module.graph.nodes if n.op == "call_module"}
            partial.commit_block(block.index, weights, {k: v for k, v in self.observers.items() if k in used})
            partial.mark_done(block.index)
            cache.finish(block.index)
            for h in hooks:
                h.finish(block.index)
            del weights, values, produced, keep  # the float weights are gone once nothing holds them
            self._unload_weights(block)
            if kill_after is not None and int(kill_after) == block.index:
                os.kill(os.getpid(), signal.SIGKILL)

    def _head_values(self, batch) -> dict:
        return head_values(self.prepared, batch)

    def _load_weights(self, block: Block) -> None:
        """Read the block's checkpoint tensors (memory-mapped, closed again) into its module."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for target in block.attributes:
            if target in self.sources:
                by_file.setdefault(self.index.entries[self.sources[target]][0], []).append(target)
        for file, targets in by_file.items():
            with safe_open(str(self.model_dir / file), framework="pt") as f:
                for target in targets:
                    fake = get_attr(self.prepared, target)
                    t = f.get_tensor(self.sources[target])
                    if t.dtype != fake.dtype:
                        t = t.to(fake.dtype)
                    set_attr(block.module, target, t, detach=False)

    def _unload_weights(self, block: Block) -> None:
        for target in block.attributes:
            if target in self.sources:
                set_attr(block.module, target, get_attr(self.prepared, target), detach=False)

    def _quantize_weights(self, block: Block) -> dict[str, torch.Tensor]:
        """``q:<node>`` int8 weights of the block's folded observers and ``f:<attribute>`` for
        the float tensors the quantized model keeps."""
        gm = block.module
        modules = dict(gm.named_modules())
        memo: dict = {}
        out: dict[str, torch.Tensor] = {}
        folded_inputs = set()
        for node in gm.graph.nodes:
            if not is_observer_node(node, modules):
                continue
            obs = modules[str(node.target)]
            const = constant_value(gm, node.args[0], memo)
            emitter = emitter_for(obs)
            if not isinstance(const, torch.Tensor) or not emitter.folds_weight(obs):
                continue
            if _is_fake(const):
                raise QuantkitError(f"weight of observer {getattr(obs, 'node_name', node.name)!r} was not loaded")
            if not is_calibrated(obs):
                obs(const)
            out[f"q:{block.origin[node.args[0].name].name}"] = emitter.quantized_weight(obs, const)
            folded_inputs.add(node.args[0])
        for node in gm.graph.nodes:
            if node.op != "get_attr" or str(node.target) not in self.sources:
                continue
            if all(u in folded_inputs or (is_observer_node(u, modules) and u.args[0] in folded_inputs)
                   for u in node.users) and node.users:
                continue
            out[f"f:{node.target}"] = get_attr(gm, str(node.target)).detach()
        return out

    def _finish(self, partial: PartialDir):
        """Convert the prepared graph (weights still absent), fold the int8 weights, write or load."""
        from safetensors import safe_open

        stored: dict[str, tuple[Path, tuple, torch.dtype]] = {}
        for block in self.blocks:
            path = partial.block_file(block.index)
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    stored[key] = (path, tuple(sl.get_shape()), sl.get_dtype())

        groupwise = fold_groupwise(self.prepared, stored)
        converted = convert_in_place(self.prepared, fold_quantize=False)
        converted.meta[QPARAMS_META_KEY] = groupwise + converted.meta[QPARAMS_META_KEY]
        mode = next(t.fake_mode for t in list(converted.parameters()) + list(converted.buffers()) if _is_fake(t))
        streamed: dict[str, tuple[Path, str]] = {}
        graph = converted.graph
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in QUANTIZE_OPS or not node.args:
                continue
            key = f"q:{getattr(node.args[0], 'name', '')}"
            if key not in stored:
                continue
            path, shape, _ = stored[key]
            name = unique_attr_name(converted, FOLDED_PREFIX)
            with mode:
                converted.register_buffer(name, torch.empty(shape, dtype=node.args[-1]))
            with graph.inserting_before(node):
                attr = graph.get_attr(name)
            node.replace_all_uses_with(attr)
            graph.erase_node(node)
            streamed[name] = (path, key)
        graph.eliminate_dead_code()
        _remove_unused_attributes(converted)
        converted.recompile()
        for name, t in list(converted.named_parameters()) + list(converted.named_buffers()):
            if _is_fake(t) and name not in streamed:
                if f"f:{name}" not in stored:
                    raise QuantkitError(f"internal: no stored value for {name!r}")
                streamed[name] = (stored[f"f:{name}"][0], f"f:{name}")

        if self.config is not None:
            converted.meta[CONFIG_META_KEY] = self.config
        if self.out is None:
            return _streamed.load_streamed(converted, streamed)
        _streamed.write_streamed_artifact(converted, streamed, self.out, overwrite=self.overwrite, recipe=self.recipe,
                                          source=self.source or {"model": str(self.model_dir)})
        return Path(self.out)
