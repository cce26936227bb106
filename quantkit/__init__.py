"""quantkit: PT2E-style post-training int8 quantization for PyTorch.

The flow::

    gm = quantkit.capture(model, example_inputs)         # torch.export
    prepared = quantkit.prepare(gm, W8A8Quantizer())      # annotate + observers
    quantkit.calibrate(prepared, calib_batches)          # observe ranges
    qmodel = quantkit.convert(prepared)                   # quantize/dequantize + int8 weights

or ``quantkit.quantize(model, example_inputs, calib_batches)`` for all four;
``quantkit.save(qmodel, dir)`` / ``quantkit.load(dir)`` write and read a deployable
int8 directory (the ``quantkit`` command line does it all from a checkpoint).

Accuracy tools: ``quantkit.debug.compare`` (per-layer numerics), ``quantkit.sensitivity``,
``quantkit.auto_fallback`` (float fallback to an accuracy budget), ``quantkit.smooth_quant``.
"""

from . import _quiet  # noqa: F401  (first: imports torchao without its import-time log noise)
from .pipeline._api import quantize
from .sequential import quantize_pretrained
from .export._artifact import load, save
from .export._compressed_tensors import export_compressed_tensors
from .pipeline._calibrate import calibrate
from .pipeline._distributed import shard
from .pipeline._capture import capture
from .lowering._compile import compile
from .pipeline._convert import convert
from ._errors import CalibrationError, CaptureError, ConvertError, QuantkitError
from .pipeline._prepare import prepare
from .pipeline._qat import prepare_qat
from .accuracy._sensitivity import sensitivity
from .accuracy._fallback import auto_fallback
from .accuracy._smoothquant import smooth_quant
from .accuracy._autotune import autotune
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
    "quantize",
    "quantize_pretrained",
    "save",
    "load",
    "export_compressed_tensors",
    "debug",
    "metrics",
    "sensitivity",
    "auto_fallback",
    "smooth_quant",
    "autotune",
    "QuantkitError",
    "CaptureError",
    "CalibrationError",
    "ConvertError",
    "__version__",
]
