"""llm-compressor rows of bench_llm_accuracy.py, and the one perplexity function every row uses.

This file imports only torch and transformers at the top, so it runs in llm-compressor's own venv
(``/work/llmc-venv``: llm-compressor 0.14 pins transformers <= 5.17, quantkit's venv has 5.24) as a
subprocess of ``bench_llm_accuracy.py``, and that benchmark imports :func:`perplexity` from here
for its quantkit, torchao and float rows: one function scores every model.

The benchmark writes the token windows once (``torch.save({"calibration": [n, L], "heldout":
[m, W]})``); the worker loads the same plain HF folder of SmolLM2 (fp32) for each row, runs
``llmcompressor.oneshot`` on the calibration rows with the row's recipe (``lm_head`` left float, as
llm-compressor does by default), times it, scores the held-out windows and writes one JSON object
per row (``{"row", "ppl", "seconds", "error"}``) to ``--json`` after every row (atomic rename).
A row that raises records its error's first line instead. llm-compressor 0.14's AWQ pins its
cached activations even without an accelerator, which raises on CPU; the worker skips the pinning
there (``_cpu_only_pinning``), so AWQ runs.

Run (normally by the benchmark):
  /work/llmc-venv/bin/python benchmarks/_llmc_worker.py --model DIR --data windows.pt --rows a,b --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

__all__ = ["perplexity", "LLMC_ROWS", "main"]


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    """exp(mean next-token NLL) of ``model`` over ``windows [n, W]``: one plain forward per window.

    Every model is called as an HF causal LM is, ``model(input_ids=[1, W], attention_mask=ones)``,
    and its logits read from ``out["logits"]`` (a ModelOutput or a dict), ``out.logits`` or ``out``
    itself (a tensor: quantkit's KV-cache programs); tokens
    1..W-1 of each window are scored (the first has no context) in float64.
    """
    nll, count = 0.0, 0
    for row in windows:
        ids = row.unsqueeze(0)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
        if isinstance(out, torch.Tensor):  # a captured KV-cache program returns the logits themselves
            logits = out
        else:
            logits = out["logits"] if isinstance(out, dict) or hasattr(out, "keys") else out.logits
        logits = logits[0, :-1].double()
        nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return math.exp(nll / count)


def _int_args(num_bits: int, group_size: int | None, symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs

    if group_size is None:
        return QuantizationArgs(num_bits=num_bits, type="int", symmetric=symmetric, strategy="channel")
    return QuantizationArgs(num_bits=num_bits, type="int", symmetric=symmetric, strategy="group",
                            group_size=group_size)


def _weight_only(num_bits: int, group_size: int | None, symmetric: bool) -> dict:
    from compressed_tensors.quantization import QuantizationScheme

    return {"group_0": QuantizationScheme(targets=["Linear"], weights=_int_args(num_bits, group_size, symmetric))}


def _recipe(row: str):
    """The llm-compressor modifiers of ``row`` (every one ignores ``lm_head``)."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    ignore = ["lm_head"]
    if row == "int8-wo":
        return QuantizationModifier(config_groups=_weight_only(8, None, True), ignore=ignore)
    if row in ("int4-g64-asym-rtn", "int4-g64-sym-rtn"):
        return QuantizationModifier(config_groups=_weight_only(4, 64, "-sym-" in row), ignore=ignore)
    if row in ("int4-g64-asym-gptq", "int4-g64-sym-gptq"):
        return GPTQModifier(config_groups=_weight_only(4, 64, "-sym-" in row), ignore=ignore)
    if row in ("int4-g64-asym-awq", "int4-g64-asym-awq+gptq"):  # 0.14's API: the AWQ transform, then a quantizer
        from llmcompressor.modifiers.transform import AWQModifier

        quantizer = GPTQModifier if row.endswith("+gptq") else QuantizationModifier
        return [AWQModifier(), quantizer(config_groups=_weight_only(4, 64, False), ignore=ignore)]
    if row == "w8a8-pt-rtn":  # llm-compressor's W8A8 preset: int8 channel weights, dynamic per-token int8
        return QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ignore)
    if row == "w8a8-pt-sq-gptq":
        from llmcompressor.modifiers.transform import SmoothQuantModifier

        return [SmoothQuantModifier(smoothing_strength=0.8),
                GPTQModifier(targets="Linear", scheme="W8A8", ignore=ignore)]
    if row == "fp8-dynamic":  # E4M3 channel weights, dynamic per-token E4M3 activations
        return QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=ignore)
    raise KeyError(row)


LLMC_ROWS = ("int8-wo", "int4-g64-asym-rtn", "int4-g64-sym-rtn", "int4-g64-asym-gptq", "int4-g64-sym-gptq",
             "int4-g64-asym-awq", "int4-g64-asym-awq+gptq", "w8a8-pt-rtn", "w8a8-pt-sq-gptq", "fp8-dynamic")


def _cpu_only_pinning() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations for host-to-device copies, which
    raises "Cannot access accelerator device when none is available" on a machine without one;
    with no device to copy to, pinning is skipped (nothing else changes)."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available() or getattr(IntermediatesCache, "_quantkit_cpu_only", False):
        return
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    IntermediatesCache._quantkit_cpu_only = True


def _run(row: str, model_dir: str, calibration: torch.Tensor, heldout: torch.Tensor) -> dict:
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot

    _cpu_only_pinning()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    data = Dataset.from_dict({"input_ids": calibration.tolist(),
                              "attention_mask": torch.ones_like(calibration).tolist()})
    t0 = time.perf_counter()
    try:
        oneshot(model=model, dataset=data, recipe=_recipe(row), max_seq_length=calibration.shape[1],
                num_calibration_samples=calibration.shape[0], batch_size=1, shuffle_calibration_samples=False)
    except Exception as exc:  # recorded in the table: the benchmark shows what llm-compressor says
        first = (str(exc).strip().splitlines() or [""])[0]
        return {"row": row, "ppl": None, "seconds": time.perf_counter() - t0,
                "error": f"{type(exc).__name__}: {first[:300]}"}
    seconds = time.perf_counter() - t0
    model.eval()
    return {"row": row, "ppl": perplexity(model, heldout), "seconds": seconds, "error": None}


def _write(path: str, rows: list) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="plain HF folder of the model")
    ap.add_argument("--data", required=True, help="torch.save'd {'calibration': [n, L], 'heldout': [m, W]}")
    ap.add_argument("--rows", default=",".join(LLMC_ROWS))
    ap.add_argument("--json", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in LLMC_ROWS]
    if unknown:
        print(f"error: unknown llm-compressor rows {unknown}; known: {', '.join(LLMC_ROWS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = torch.load(args.data)
    import llmcompressor

    done = []
    for row in rows:
        result = _run(row, args.model, data["calibration"], data["heldout"])
        result["version"] = llmcompressor.__version__
        done.append(result)
        _write(args.json, done)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
