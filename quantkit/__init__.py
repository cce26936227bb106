"""quantkit: PT2E-style post-training quantization for PyTorch.

One call quantizes a model with a registered scheme (``quantkit.available_schemes()``: w8a8,
w8a8-dynamic, w8a8-per-token, w4a16, w8a16, nf4, fp8, fp8-dynamic) or a quantizer::

    qmodel = quantkit.quantize(model, example_inputs, calib_batches, scheme="w4a16")

The stages it runs, each usable alone::

    gm = quantkit.capture(model, example_inputs)         # -> GraphModule (torch.export)
    prepared = quantkit.prepare(gm, W8A8Quantizer())      # -> GraphModule with observers (a copy)
    quantkit.calibrate(prepared, calib_batches)          # -> prepared itself (observers record ranges)
    qmodel = quantkit.convert(prepared)                   # -> GraphModule with q/dq ops and int8 weights
    fast = quantkit.compile(qmodel)                       # -> compiled module (int8/int4/FP8 kernels)

Causal LMs generate text from a program captured with a static KV cache::

    lm = quantkit.capture(llm, input_ids, max_cache_len=256)   # lm(input_ids, cache_position) -> logits
    out = quantkit.generate(lm, input_ids, max_new_tokens=32)  # prefill once, then one token per call
    out, stats = quantkit.generate_with_stats(lm, input_ids, 32)  # and prefill/decode tokens/s

``quantkit.save(qmodel, dir)`` writes a deployable directory (model.pt2 + quantization.json,
which records the scheme's config); ``quantkit.load(dir)`` returns the model as a module whose
``meta["quantkit_config"]`` is that config. ``quantkit.quantize_pretrained(path, calib)`` quantizes
a Hugging Face checkpoint (block by block when it does not fit in memory); the ``quantkit``
command line does it all from a checkpoint.

Schemes (``quantkit.quantizers``): ``get_scheme(name)`` returns a preset's ``SchemeConfig``
(``QuantConfig``, ``WeightOnlyConfig``, ``FP8Config``: frozen, ``to_dict()``/``from_dict()``);
``register_scheme(name, config, description=...)`` adds one.

Accuracy tools: ``quantkit.debug.compare`` (per-layer numerics), ``quantkit.sensitivity``,
``quantkit.auto_fallback`` (float fallback to an accuracy budget), ``quantkit.smooth_quant``,
``quantkit.autotune`` (the fastest recipe meeting a target).
"""

from . import _quiet  # noqa: F401  (first: imports torchao without its import-time log noise)
from .pipeline._api import quantize
from .sequential import quantize_pretrained
from .export._artifact import load, save
from .export._compressed_tensors import export_compressed_tensors
from .export._gguf import export_gguf
from .pipeline._calibrate import calibrate
from .pipeline._distributed import shard
from .pipeline._capture import capture
from .lowering._compile import compile
from .generation import generate, generate_with_stats
from .pipeline._convert import convert
from ._errors import CalibrationError, CaptureError, ConvertError, QuantkitError
from .pipeline._prepare import prepare
from .pipeline._qat import prepare_qat
from .accuracy._sensitivity import sensitivity
from .accuracy._fallback import auto_fallback
from .accuracy._smoothquant import smooth_quant
from .accuracy._autotune import autotune
from .quantizers._scheme import SchemeConfig, available_schemes, get_scheme, register_scheme
from . import debug, metrics

__version__ = "0.1.0"

__all__ = [
    "capture",
    "prepare",
    "prepare_qat",
    "calibrate",
    "shard",
    "convert",
    "compile",
    "generate",
    "generate_with_stats",
    "quantize",
    "quantize_pretrained",
    "save",
    "load",
    "export_compressed_tensors",
    "export_gguf",
    "debug",
    "metrics",
    "sensitivity",
    "auto_fallback",
    "smooth_quant",
    "autotune",
    "SchemeConfig",
    "available_schemes",
    "get_scheme",
    "register_scheme",
    "QuantkitError",
    "CaptureError",
    "CalibrationError",
    "ConvertError",
    "__version__",
]
