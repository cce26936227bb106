"""``quantkit quantize --max-memory SIZE | --sequential [--resume]``: block-by-block quantization.

Chosen when the checkpoint does not fit the memory budget (or asked for): the model is
calibrated one repeated unit at a time with its weights streamed from safetensors
(:func:`quantkit.quantize_pretrained`). The float model is never in memory, so the
artifact is not evaluated against it (``quantkit eval DIR`` does that where it fits).

With ``--max-memory`` the choice between the paths is made from the checkpoint's measured
sizes (:func:`quantkit.sequential._budget.plan_memory`) and said in one line (unless
``--quiet``); block by block, the calibration batches are made small enough for the budget.
"""

from __future__ import annotations

from pathlib import Path

from .. import _hf
from .._errors import QuantkitError
from ..sequential._budget import MemoryPlan, bound_heap, plan_memory
from . import _data as datasets, _inputs as inputs

__all__ = ["wanted", "run_sequential", "memory_plan"]


def _budget(args) -> int | None:
    if getattr(args, "max_memory", None) is None:
        return None
    from ..sequential._run import parse_size

    try:
        return parse_size(args.max_memory)
    except ValueError as exc:
        raise inputs.UsageError(f"--max-memory: {exc}") from None


def _model_dir(spec: inputs.ModelSpec) -> Path | None:
    if not spec.is_hf:
        return None
    return _hf.default_model_path() if spec.kind == "default" else Path(spec.path)


def _forced(args) -> bool:
    return bool(getattr(args, "sequential", False) or getattr(args, "resume", False))


def memory_plan(args, spec: inputs.ModelSpec, samples: int | None = None) -> MemoryPlan | None:
    """The memory plan of this run (None: no ``--max-memory`` or ``--sequential``, or a factory)."""
    budget = _budget(args)
    forced = _forced(args)
    path = _model_dir(spec)
    if path is None or (not forced and budget is None):
        return None
    from ..pipeline._meta_capture import index_checkpoint

    index_checkpoint(path)  # safetensors weights, or one line saying the block-by-block path needs them
    return plan_memory(path, budget, seq_len=args.seq_len, batch_size=args.batch_size, samples=samples,
                       forced=forced)


def wanted(args, spec: inputs.ModelSpec) -> bool:
    """Whether this run takes the block-by-block path: ``--sequential``/``--resume``, or a
    ``--max-memory`` the in-memory path would not fit (by the checkpoint's measured sizes).
    A ``--max-memory`` that the in-memory path fits is said in one line (unless ``--quiet``)."""
    forced = _forced(args)
    if forced and _model_dir(spec) is None:
        raise inputs.UsageError("--sequential/--resume need a Hugging Face model directory with safetensors "
                                "weights, not a factory")
    plan = memory_plan(args, spec)
    if plan is None:
        return False
    if not plan.sequential and not getattr(args, "quiet", False):
        print(plan.line())
    return plan.sequential


def _check_flags(args) -> None:
    for flag, value in (("--smoothquant", args.smoothquant), ("--accuracy-budget", args.accuracy_budget)):
        if value is not None:
            raise inputs.UsageError(f"{flag} needs the float model in memory; it cannot run block by block "
                                    "(drop it, or raise --max-memory)")
    if getattr(args, "format", "pt2") != "pt2":
        raise inputs.UsageError("block-by-block quantization writes the pt2 artifact only; drop --format")
    if inputs.check_device(args.device).type != "cpu":
        raise inputs.UsageError("block-by-block quantization runs on the CPU; drop --device")


def run_sequential(args, recipe, spec: inputs.ModelSpec, data, out: Path, say) -> int:
    """Quantize block by block and write ``out`` (model.pt2 + quantization.json, atomically)."""
    from ..pipeline._meta_capture import empty_model
    from ..sequential._run import quantize_pretrained

    _check_flags(args)
    path = _model_dir(spec)
    samples, origins = datasets.read_samples(data)
    split = datasets.split_samples(len(samples), num_calib=args.num_calib)
    split, _ = datasets.nonfinite_split(samples, origins, split, args.skip_nonfinite, "calibration")
    plan = memory_plan(args, spec, samples=len(split.calib))
    if plan is not None:
        plan.check()
    batch_size = plan.batch_size if plan is not None and plan.budget is not None else args.batch_size
    if plan is not None and not args.quiet:
        say(plan.line(forced=_forced(args)))
    if plan is not None and plan.budget is not None:
        bound_heap()  # freed block weights go back to the system, not to a heap that stays resident
    model = empty_model(path, spec.task)  # on the meta device: names and signature only
    try:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception:
        tokenizer = None
    loaded = inputs.LoadedModel(model, tokenizer, None, 0, None)
    calib, _ = datasets.device_batches(samples, origins, split.calib, loaded, what="calibration", seq_len=args.seq_len,
                           batch_size=batch_size, device=inputs.check_device("cpu"))
    quantizer = recipe.quantizer([n for n, _ in model.named_modules()])
    del model
    source = {"model": spec.to_json(), "data": data.to_json(), "fingerprint": datasets.fingerprint(data),
              "samples": len(samples), "seq_len": args.seq_len, "batch_size": batch_size,
              "sequential": True, "max_memory": args.max_memory}
    try:
        quantize_pretrained(path, calib, quantizer, max_memory=args.max_memory, out=out, sequential=True,
                            resume=bool(args.resume), overwrite=args.force, task=spec.task,
                            progress=not args.quiet, recipe=recipe.to_json(), source=source,
                            recorded_config=recipe.scheme_config(),
                            dynamic_shapes=_hf.dynamic_shapes(calib[0]) if isinstance(calib[0], dict) else None)
    except FileExistsError as exc:  # pragma: no cover - check_out_dir words this already
        raise QuantkitError(str(exc)) from None
    if not args.quiet:
        say(f"wrote {out}: quantized block by block from safetensors ({len(split.calib)} calibration samples); "
            "not compared with the float model, which does not fit in memory: run quantkit eval where it does")
    return 0
