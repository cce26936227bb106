"""generate: text generation with a program that holds its own static KV cache.

The program follows the contract of ``quantkit.capture(model, example, max_cache_len=N)``:
``program(input_ids [B, L], cache_position [L]) -> logits [B, L, vocab]``, writing K/V at
``cache_position`` into its cache buffers and attending to the slots at or before each position.
So a generation is one prefill call over the whole prompt, then one call per new token; nothing
is reset in between, because a new sequence starts again at position 0 and the causal mask hides
the stale slots beyond the current position. Both calls go through
``_last_position.last_position_program`` of the program where it applies: the lm_head computes the
last position only (the prefill's other L - 1 rows of logits are never read).

Compiling (``compile=True``) happens once per program, at the first call: a converted program
goes through ``quantkit.compile`` (its int8/int4/FP8 kernels), a float one through
``torch.compile``. Two graphs come out: prefill, whose sequence dimension is marked dynamic so a
prompt of another length reuses it, and decode (length 1, which Dynamo specialises); the position
is a tensor, so decode steps never recompile. The compiled forms of the last few programs are
kept, so a second ``generate`` on the same program compiles nothing.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..lowering._compile import compile as quantkit_compile
from ..pipeline._kv_capture import KVCacheError, kv_cache_info
from ._last_position import last_position_program
from ._sampling import GenerationError, SamplingConfig, next_tokens

__all__ = ["generate", "generate_with_stats", "GenerationStats", "clear_compiled", "program_cache_info"]

# compiled forms of the last programs generate() ran, by id (each entry holds its program, so an
# id is never reused while its entry lives); two cover "float and quantized side by side"
_COMPILED: OrderedDict[int, tuple[torch.nn.Module, torch.nn.Module]] = OrderedDict()
# the same for compile=False: the last-position rewrite of each program (sharing its cache)
_PLAIN: OrderedDict[int, tuple[torch.nn.Module, torch.nn.Module]] = OrderedDict()
_KEEP_COMPILED = 2


@dataclass(frozen=True)
class GenerationStats:
    """Timings of one generation (wall clock, ``time.perf_counter``).

    ``prefill_s`` is the prompt's call (it yields the first new token), ``decode_s`` the calls
    after it, one per further token (sampling and stopping checks included: what a user waits for).
    Tokens/s count every row of the batch. A first call on a program also compiles it; call
    :func:`generate_with_stats` with ``warmup=True`` to keep compilation out of the timings.
    """

    batch_size: int
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    compile_s: float = 0.0

    @property
    def decode_steps(self) -> int:
        return max(self.new_tokens - 1, 0)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch_size * self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch_size * self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")


def program_cache_info(program) -> dict | None:
    """The static KV cache ``program`` records (``kv_cache_info``), looking through a compiled wrapper."""
    seen = set()
    while program is not None and id(program) not in seen:
        seen.add(id(program))
        info = kv_cache_info(program)
        if info is not None:
            return info
        program = getattr(program, "_orig_mod", None)
    return None


def clear_compiled() -> None:
    """Drop the compiled (and rewritten) programs generate() keeps (and the programs they hold)."""
    _COMPILED.clear()
    _PLAIN.clear()


def _remember(cache: OrderedDict, program, made) -> None:
    cache[id(program)] = (program, made)
    while len(cache) > _KEEP_COMPILED:
        cache.popitem(last=False)


def _recalled(cache: OrderedDict, program):
    hit = cache.get(id(program))
    if hit is not None and hit[0] is program:
        cache.move_to_end(id(program))
        return hit[1]
    return None


def _uncompiled(program):
    """``program`` with last-position logits (:func:`last_position_program`, kept for later calls),
    or ``program`` itself where the rewrite does not apply."""
    run = _recalled(_PLAIN, program)
    if run is None:
        run = last_position_program(program) or program
        _remember(_PLAIN, program, run)
    return run


def _is_hf_model(program) -> bool:
    # an HF model called as program(ids, positions) would take the positions as its attention mask
    transformers = sys.modules.get("transformers")  # not imported: it cannot be one
    return transformers is not None and isinstance(program, transformers.PreTrainedModel)


def _compiled(program: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
    """``program`` compiled (once; later calls reuse it) and whether it was compiled now."""
    if hasattr(program, "_orig_mod"):  # compiled already (torch.compile or quantkit.compile)
        return program, False
    fast = _recalled(_COMPILED, program)
    if fast is not None:
        return fast, False
    last = last_position_program(program) or program  # prefill and decode: one graph, one cache
    meta = getattr(program, "meta", None)
    if isinstance(meta, dict) and meta.get("quantkit_converted"):
        fast = quantkit_compile(last)  # int8/int4/FP8 kernels; works on a copy (its own cache buffers)
    else:
        fast = torch.compile(last)
    _remember(_COMPILED, program, fast)
    return fast, True


def _eos_ids(eos_token_id, device) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) else eos_token_id
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    if not isinstance(ids, (list, tuple)) or not ids or \
            not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise GenerationError(f"eos_token_id must be a token id (int >= 0), a list of them or None, got {eos_token_id!r}")
    return torch.tensor(ids, dtype=torch.long, device=device)


def _check_call(program, input_ids, max_new_tokens, eos_token_id=None) -> None:
    if _is_hf_model(program):
        raise GenerationError(
            f"generate needs a program with a static KV cache, got the Hugging Face model {type(program).__name__}; "
            "capture it first: quantkit.capture(model, input_ids, max_cache_len=N)")
    if not callable(program):
        raise GenerationError(f"generate needs a callable program(input_ids, cache_position), got "
                              f"{type(program).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64,
                                                                                                   torch.int32):
        what = (f"a {input_ids.dim()}-d {input_ids.dtype} tensor" if isinstance(input_ids, torch.Tensor)
                else type(input_ids).__name__)
        raise GenerationError(f"input_ids must be token ids [batch, length] (a LongTensor), got {what}; "
                              "for one prompt use ids.unsqueeze(0)")
    if input_ids.shape[1] < 1:
        raise GenerationError("input_ids holds no tokens; generation needs a prompt of at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    _eos_ids(eos_token_id, input_ids.device)  # bad arguments before a cache that would not fit
    info = program_cache_info(program)
    if info is None:
        return  # a program without quantkit's record (e.g. transformers' exportable wrapper): it bounds itself
    n, b = info["max_cache_len"], info["batch_size"]
    batch, length = input_ids.shape
    if batch != b:
        raise KVCacheError(f"the program's KV cache holds a batch of {b}, got input_ids of batch {batch}; capture "
                           f"it with an example of batch {batch}")
    # the last new token is returned, never written to the cache: L + max_new_tokens - 1 positions
    need = length + max(max_new_tokens - 1, 0)
    if length > n:
        raise KVCacheError(f"the prompt has {length} tokens, more than the program's max_cache_len={n}; shorten it "
                           f"or capture with max_cache_len >= {need}")
    if need > n:
        raise KVCacheError(f"a prompt of {length} tokens plus max_new_tokens={max_new_tokens} needs {need} cache "
                           f"positions, more than the program's max_cache_len={n}; lower max_new_tokens to at most "
                           f"{n - length + 1} or capture with max_cache_len >= {need}")


def generate(program, input_ids: torch.Tensor, max_new_tokens: int = 32, *, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | list[int] | None = None, compile: bool = True,
             generator: torch.Generator | None = None, streamer=None) -> torch.Tensor:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` with a KV-cache program.

    Prefills the prompt in one call, then decodes one token per call; a row stops at one of
    ``eos_token_id`` (later positions of that row are padded with the first eos id, as
    transformers does) and the loop ends when every row has stopped or after ``max_new_tokens``.

    Args:
        program: ``program(input_ids, cache_position) -> logits``: the result of
            ``quantkit.capture(model, example, max_cache_len=N)``, of ``convert`` on it, or of
            ``quantkit.load`` of its artifact. Its ``max_cache_len`` and batch are checked first.
        input_ids: the prompts, ``[batch, length]`` token ids (no padding: the program has no mask).
        max_new_tokens: at most this many tokens are appended.
        do_sample, temperature, top_k, top_p: greedy (default) or sampling
            (:class:`~quantkit.generation.SamplingConfig`), computed in float32 outside the program.
        eos_token_id: a token id or a list of them that ends a row; None: always ``max_new_tokens``.
        compile: compile the program once (``quantkit.compile`` for a converted program,
            ``torch.compile`` otherwise) and reuse it in later calls; False runs its q/dq (or
            float) graph as it is. Either way the lm_head computes the last position only
            (``last_position_program``), where the program's graph has one lm_head output.
        generator: the ``torch.Generator`` sampling draws from (reproducible runs).
        streamer: an object with ``put(tokens)`` and ``end()`` (transformers' ``TextStreamer``
            works): ``put`` gets the prompt ``[batch, length]`` first, then each new token ``[batch]``.

    Returns:
        LongTensor ``[batch, length + generated]``: the prompt followed by the new tokens.

    Raises:
        KVCacheError: the prompt plus ``max_new_tokens`` does not fit the program's cache, or the
            batch is not the program's (one line, with the limit and how to raise it).
        GenerationError: bad arguments (one line).

    Example:
        >>> lm = quantkit.capture(model, ids, max_cache_len=256)
        >>> out = quantkit.generate(lm, ids, max_new_tokens=64, eos_token_id=tokenizer.eos_token_id)
    """
    out, _ = generate_with_stats(program, input_ids, max_new_tokens, sampling=SamplingConfig(
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p), eos_token_id=eos_token_id,
        compile=compile, generator=generator, streamer=streamer)
    return out


def generate_with_stats(program, input_ids: torch.Tensor, max_new_tokens: int = 32, *,
                        sampling: SamplingConfig = SamplingConfig(), eos_token_id=None, compile: bool = True,
                        generator: torch.Generator | None = None, streamer=None,
                        warmup: bool = False) -> tuple[torch.Tensor, GenerationStats]:
    """:func:`generate` that also returns its :class:`GenerationStats`.

    With ``warmup=True`` a program compiled by this call first runs one prefill of the prompt's
    length and one decode step (compiling both graphs, timed as ``compile_s``), so the timings that
    follow are those of the compiled program. The warm-up writes only cache slots the generation
    overwrites before it reads them.
    """
    if not isinstance(compile, bool):
        raise GenerationError(f"compile must be True or False, got {compile!r}")
    _check_call(program, input_ids, max_new_tokens, eos_token_id)
    eos = _eos_ids(eos_token_id, input_ids.device)
    batch, length = input_ids.shape
    ids = input_ids.to(torch.long).contiguous()  # Dynamo guards on strides: a sliced prompt would recompile
    if max_new_tokens == 0:
        return ids.clone(), GenerationStats(batch, length, 0, 0.0, 0.0)
    run, fresh = _compiled(program) if compile else (_uncompiled(program), False)
    compile_s = 0.0
    with torch.no_grad():
        if warmup and fresh:
            t0 = time.perf_counter()
            _prefill(run, ids)
            if max_new_tokens > 1:
                run(_decode_input(ids[:, -1], batch), torch.tensor([length], device=ids.device))
            compile_s = time.perf_counter() - t0
        if streamer is not None:
            streamer.put(ids.cpu())
        t0 = time.perf_counter()
        logits = _prefill(run, ids)
        token = next_tokens(logits[:, -1, :], sampling, generator)
        prefill_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        pad = eos[0] if eos is not None else None
        unfinished = torch.ones(batch, dtype=torch.bool, device=ids.device)
        tokens = []
        position = length
        with contextlib.ExitStack() as stance:
            while True:
                if eos is not None:
                    token = torch.where(unfinished, token, pad)
                    unfinished = unfinished & ~torch.isin(token, eos)
                tokens.append(token)
                if streamer is not None:
                    streamer.put(token.cpu())
                if len(tokens) == max_new_tokens or (eos is not None and not bool(unfinished.any())):
                    break
                logits = run(_decode_input(token, batch), torch.tensor([position], device=ids.device))
                token = next_tokens(logits[:, -1, :], sampling, generator)
                position += 1
                if compile and position == length + 1:
                    stance.enter_context(_decode_guards())
        decode_s = time.perf_counter() - t0
    if streamer is not None:
        streamer.end()
    out = torch.cat([ids, torch.stack(tokens, dim=1)], dim=1)
    return out, GenerationStats(batch, length, len(tokens), prefill_s, decode_s, compile_s)


def _decode_guards():
    """Dynamo's stance for decode steps after the first: only the guards that tell the compiled
    graphs apart (prefill's dynamic length from decode's length 1) are evaluated.

    Every decode step calls the program with inputs of one shape, dtype, stride and device (a fresh
    ``[B, 1]`` token and a ``[1]`` position tensor, :func:`_decode_input`) and nothing else that a
    guard reads changes between steps, so once the first step has run (compiling the decode graph
    if needed) the full guard check can only repeat its answer. That check cost 0.66 ms of a
    10.5 ms w4a16 step on SmolLM2-135M (profiled idle, 2026-12-02: Dynamo's cache lookup, a guard
    per parameter and buffer of 30 layers).
    """
    return torch.compiler.set_stance(skip_guard_eval_unsafe=True)


def _decode_input(token: torch.Tensor, batch: int) -> torch.Tensor:
    """A fresh ``[B, 1]`` tensor with dense strides ``(1, 1)`` for every decode step: Dynamo guards
    on strides, and a ``[B, 1]`` slice of the prompt (strides ``(L, 1)``, which ``.contiguous()``
    keeps) would recompile the decode graph with symbolic strides (measured: 4x slower per token)."""
    return token.reshape(batch, 1).clone(memory_format=torch.contiguous_format)


def _prefill(run, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1], device=ids.device)
    if ids.shape[1] > 1:  # one dynamic prefill graph for every prompt length (length 1 is the decode graph)
        ids = ids.clone()  # mark a copy, not the caller's tensor
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(positions, 0)
    return run(ids, positions)
